"""``rlpad bench code``: the code sandbox's cost. Per case: the same trivial case run one at a time as a bare
subprocess (the harness alone, no sandbox) and in the sandbox (bubblewrap, namespaces, own uid,
rlimits): median wall seconds each, the sandbox's overhead their difference, and the CPU seconds of the
case's Python process (as the harness reports them; bubblewrap's own processes are not in it).
Throughput: programs scored per second through the pool (every case of every program at once), for
programs that pass (all their cases run) and programs that fail at their first case.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from typing import Any

from rlpad.bench.table import Table
from rlpad.config.code import CodeConfig
from rlpad.code.harness import READY
from rlpad.code.pool import default_workers
from rlpad.code.sandbox import HARNESS, Sandbox, limits_of
from rlpad.code.scorer import CodeScorer

__all__ = ["run_code_bench", "tables"]

CASE = {"program": "a, b = map(int, input().split())\nprint(a + b)\n", "fn_name": None, "input": "20 22\n"}
CASES = json.dumps({"inputs": [f"{i} {i + 1}\n" for i in range(4)], "outputs": [f"{2 * i + 1}\n" for i in range(4)]})


def _bare(sandbox: Sandbox) -> float:
    """The case as a plain subprocess: the same interpreter and harness, no sandbox."""
    read, write = os.pipe()
    job = json.dumps({**CASE, "limits": limits_of(sandbox.cfg, userns=False)}).encode()
    proc = subprocess.Popen([sandbox.python, "-I", "-S", "-B", HARNESS, str(write)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write,))
    os.close(write)
    proc.communicate(job)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    if not data.startswith(READY):
        raise RuntimeError("the bare harness did not run")
    return json.loads(data[len(READY):].split(b"\n", 1)[0])["cpu_s"]


def _timed(fn: Any, reps: int) -> tuple[float, float]:
    """(median wall s, median CPU s the case reported) of ``reps`` calls of ``fn`` (which returns the CPU s)."""
    walls, cpus = [], []
    for _ in range(reps):
        start = time.perf_counter()
        cpus.append(fn())
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), statistics.median(cpus)


def run_code_bench(reps: int = 20, programs: int = 64) -> dict[str, Any]:
    cfg = CodeConfig(timeout_s=10.0, memory_limit_mb=512, continuous=False)  # a failing program stops at once
    scorer = CodeScorer(cfg)
    try:
        pool = scorer.pool
        def sandboxed() -> float:
            run = pool.run(CASE)
            if run.status != "ok":
                raise RuntimeError(f"the sandbox did not run the bench case: {run.status} {run.error}")
            return run.cpu_s

        sandboxed()
        _bare(pool.sandbox)  # warm both paths once
        bare_wall, bare_cpu = _timed(lambda: _bare(pool.sandbox), reps)
        box_wall, box_cpu = _timed(sandboxed, reps)
        throughput = {}
        for kind, body in (("pass", "a, b = map(int, input().split())\nprint(a + b)"),
                           ("fail", "print(-1)")):
            items = [(f"```python\n# {i}\n{body}\n```", CASES) for i in range(programs)]
            scorer.new_batch()
            start = time.perf_counter()
            results = scorer.score(items)
            seconds = time.perf_counter() - start
            if not all(r.outcome == ("pass" if kind == "pass" else "wrong") for r in results):
                raise RuntimeError(f"bench programs scored {sorted({r.outcome for r in results})}")
            throughput[kind] = {"programs": programs, "cases": sum(r.ran for r in results), "seconds": seconds}
        return {"reps": reps, "workers": pool.workers, "root": pool.sandbox.root, "load": os.getloadavg(),
                "bare": {"wall_s": bare_wall, "cpu_s": bare_cpu}, "sandbox": {"wall_s": box_wall, "cpu_s": box_cpu},
                "throughput": throughput, "cpus": default_workers()}
    finally:
        scorer.close()


def tables(result: dict[str, Any]) -> list[Table]:
    bare, box = result["bare"], result["sandbox"]
    per_case = Table(
        ["one case (a + b, stdin)", "wall ms (median)", "its Python's CPU ms (median)"],
        [["bare subprocess (the harness alone)", f"{bare['wall_s'] * 1e3:.1f}", f"{bare['cpu_s'] * 1e3:.1f}"],
         ["in the sandbox", f"{box['wall_s'] * 1e3:.1f}", f"{box['cpu_s'] * 1e3:.1f}"],
         ["sandbox overhead", f"{(box['wall_s'] - bare['wall_s']) * 1e3:+.1f}", ""]],
        title=f"Code sandbox, per case ({result['reps']} runs each, one at a time; "
              f"{'root: a uid per sandbox' if result['root'] else 'a user namespace per sandbox'})")
    rows = []
    for kind, t in result["throughput"].items():
        what = "pass (4 cases each)" if kind == "pass" else "fail at the first case"
        rows.append([what, str(t["programs"]), str(t["cases"]), f"{t['programs'] / t['seconds']:.1f}",
                     f"{t['cases'] / t['seconds']:.1f}"])
    load = ", ".join(f"{x:.1f}" for x in result["load"])
    through = Table(["programs", "n", "cases run", "programs/s", "cases/s"], rows,
                    title=f"Throughput through the pool ({result['workers']} workers, {result['cpus']} CPUs)",
                    notes=[f"load average before the run: {load} (2-core machines shared by others read slower)"])
    return [per_case, through]
