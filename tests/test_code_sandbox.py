"""The code sandbox against hostile programs (tests/hostile_code.py): each contained and scored with its reason,
beside an honest program that still passes; each effect shown by a control outside the sandbox (in a
throwaway folder); then 1000 of them through the pool at once: nothing left running, memory back, the
canary intact (hostile responses in a real training step: tests/test_code_train.py). Run as root (as CI does) the sandboxes get uids of their own; as another user a
user namespace each."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from hostile_code import (CALL_DOUBLE, DOUBLE, FORK_BOMB, HONEST, Listener, hostile_programs, run_outside,
                          sandbox_processes)
from rlpad.config.code import CodeConfig
from rlpad.code import hooks as code
from rlpad.code.scorer import CodeScorer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_FILE = os.path.join(ROOT, "pyproject.toml")
LIMITS = dict(memory_limit_mb=512, max_processes=16, max_output_bytes=1 << 20, max_concurrent=4)
CANARY = "the run's home must survive"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The test's throwaways: a HOME with a canary, a folder outside any sandbox, a listening server."""
    base = tmp_path_factory.mktemp("hostile")
    home, outside = base / "home", base / "outside"
    home.mkdir()
    outside.mkdir()
    (home / "canary").write_text(CANARY)
    listener = Listener()
    yield {"home": str(home), "outside": str(outside / "escaped.txt"), "listener": listener,
           "programs": hostile_programs(listener.port, str(home), PROJECT_FILE, str(outside / "escaped.txt"))}
    listener.close()


def untouched(world, scorer: CodeScorer) -> None:
    assert world["listener"].accepted == 0, "a sandboxed program reached the test's server"
    assert open(os.path.join(world["home"], "canary")).read() == CANARY
    assert not os.path.exists(world["outside"]), "a sandboxed program wrote outside its scratch dir"
    left = sandbox_processes(scorer.pool)
    assert left == [], f"sandboxed processes outlived their case: {[_describe(pid) for pid in left]}"
    if os.geteuid() == 0:
        assert len(scorer.pool.uids) == scorer.pool.workers, "as root every sandbox worker has a uid of its own"


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid} {status.get('State')} uid {status.get('Uid')} ppid {status.get('PPid')}: {cmd[:200]}"
    except OSError as e:
        return f"{pid}: {e}"


def test_the_sandbox_works_here():
    code.configure(CodeConfig())
    assert code.sandbox_problem() is None, code.sandbox_problem()


def test_each_hostile_program_is_contained_and_scored_with_its_reason(world):
    scorer = CodeScorer(CodeConfig(timeout_s=2.0, **LIMITS))
    try:
        hostile = world["programs"]
        honest = f"```python\n{HONEST}```"
        results = scorer.score([(h.response, h.ground_truth) for h in hostile] + [(honest, DOUBLE)])
        got = {h.name: r.outcome for h, r in zip(hostile, results)}
        assert got == {h.name: h.outcome for h in hostile}
        assert results[-1].outcome == "pass" and results[-1].score == 1.0, "a hostile neighbour changed an honest case"
        assert all(r.score == 0.0 for r in results[:-1])
        untouched(world, scorer)
        # what the fork bomb and the reader of expected outputs saw from inside
        bomb = scorer.pool.run({"program": FORK_BOMB.format(forks=10_000, sleep=60), "fn_name": None, "input": ""})
        forked = int(bomb.stdout.split()[1])
        assert 0 < forked < LIMITS["max_processes"], bomb
        untouched(world, scorer)
    finally:
        scorer.close()


def test_controls_outside_the_sandbox_show_each_effect(world, tmp_path):
    """The same programs as plain processes in a throwaway folder: each does what the sandbox stopped."""
    by_name = {h.name: h for h in world["programs"]}
    listener = Listener()
    try:
        run_outside(by_name["socket"].program.replace(str(world["listener"].port), str(listener.port)), str(tmp_path))
        assert listener.accepted == 1
    finally:
        listener.close()
    assert run_outside(by_name["read_project"].program, str(tmp_path)).stdout.strip() == str(len(open(PROJECT_FILE).read()))
    if os.geteuid() == 0:
        assert int(run_outside(by_name["read_shadow"].program, str(tmp_path)).stdout) > 0
    target = tmp_path / "escaped.txt"
    run_outside(by_name["write_outside"].program.replace(world["outside"], str(target)), str(tmp_path))
    assert target.read_text() == "escaped"
    spare_home = tmp_path / "spare_home"
    spare_home.mkdir()
    (spare_home / "canary").write_text(CANARY)
    run_outside(by_name["delete_home"].program.replace(world["home"], str(spare_home)), str(tmp_path))
    assert not (spare_home / "canary").exists()
    # a setsid child outlives its parent (found by its pid, then killed)
    out = run_outside("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    null = os.open(os.devnull, os.O_RDWR)\n"
                      "    os.dup2(null, 1)\n    os.dup2(null, 2)\n    time.sleep(60)\n    os._exit(0)\nprint(pid)\n",
                      str(tmp_path))
    child = int(out.stdout)
    try:
        os.kill(child, 0)  # alive
    finally:
        os.kill(child, signal.SIGKILL)
    # a bounded fork bomb forks more than the sandbox allows (its children exit within a second)
    assert int(run_outside(FORK_BOMB.format(forks=40, sleep=1), str(tmp_path)).stdout.split()[1]) == 40
    # 600 MB (a small allocation, above the 512 MB limit) succeeds outside, not inside
    big = "block = bytearray(600 << 20)\nprint(len(block))\n"
    assert run_outside(big, str(tmp_path)).stdout.strip() == str(600 << 20)
    # 8 MB of output all arrive outside (the sandbox stops at 1 MiB)
    assert len(run_outside("import sys\nsys.stdout.write('x' * (8 << 20))\n", str(tmp_path)).stdout) == 8 << 20
    # a harness comparing in-process (verl's) is fooled by the patched value; it finds the expected outputs
    patched = run_outside(by_name["patch_harness"].program + "sys.stdout.write(str(solve(21) == 42))\n", str(tmp_path))
    assert patched.stdout.strip() == "True"
    in_process = ("import io, sys\nin_outs = {'inputs': ['21\\n'], 'outputs': ['42\\n']}\n"
                  "sys.stdin = io.StringIO(in_outs['inputs'][0])\n" + by_name["read_expected"].program)
    assert run_outside(in_process, str(tmp_path)).stdout.strip() == "42"
    scorer = CodeScorer(CodeConfig(timeout_s=2.0, **LIMITS))
    try:
        assert scorer.score([(f"```python\n{big}```", DOUBLE)])[0].outcome == "oom"
    finally:
        scorer.close()


def test_a_thousand_hostile_programs_through_the_pool_leave_nothing_behind(world):
    hostile = world["programs"]
    items, expected = [], []
    for i in range(1000):  # each a program of its own (numbered): none is a repeat the cache would skip
        h = hostile[i % len(hostile)]
        items.append((h.response.replace("```python\n", f"```python\n# program {i}\n"), h.ground_truth))
        expected.append(h.outcome)
    rss_before, shmem_before = _meminfo_mb("VmRSS", "/proc/self/status"), _meminfo_mb("Shmem")
    scorer = CodeScorer(CodeConfig(timeout_s=0.5, **LIMITS))
    start = time.perf_counter()
    try:
        results = scorer.score(items)
        seconds = time.perf_counter() - start
        untouched(world, scorer)
    finally:
        scorer.close()
    outcomes = [r.outcome for r in results]
    # a loaded machine may time out a slow program (forking, allocating) at this short limit; nothing else changes
    late = sum(got != want for got, want in zip(outcomes, expected))
    assert all(got == want or got == "timeout" for got, want in zip(outcomes, expected)), outcomes
    assert late < 100, f"{late} programs timed out that should not have"
    rss_after, shmem_after = _meminfo_mb("VmRSS", "/proc/self/status"), _meminfo_mb("Shmem")
    print(f"1000 hostile programs in {seconds:.1f} s ({1000 / seconds:.1f}/s, load {os.getloadavg()[0]:.1f}, "
          f"{late} timed out early); driver RSS {rss_before:.0f} -> {rss_after:.0f} MB; "
          f"machine Shmem (tmpfs) {shmem_before:.0f} -> {shmem_after:.0f} MB")
    assert rss_after - rss_before < 64, "the driver kept memory of the cases"


def _meminfo_mb(key: str, path: str = "/proc/meminfo") -> float:
    with open(path) as f:
        return int(re.search(rf"^{key}:\s+(\d+)", f.read(), re.M).group(1)) / 1024


def test_call_based_hostile_value_cannot_pass_by_its_own_equality():
    scorer = CodeScorer(CodeConfig(timeout_s=2.0, **LIMITS))
    try:
        right = scorer.score([("```python\ndef solve(x):\n    return 2 * x\n```", CALL_DOUBLE)])[0]
        assert right.outcome == "pass"
    finally:
        scorer.close()


def test_without_bubblewrap_code_sources_are_refused_at_start(monkeypatch):
    """No sandbox, no code sources: one line at start (rlpad.train.prepare raises it), nothing run unsandboxed."""
    from rlpad.rewards.rules import DEFAULT_REWARD_FN, reward_source_problems

    monkeypatch.setenv("PATH", "/nonexistent")
    code.configure(CodeConfig(scratch_mb=63))  # a fresh scorer: its probe runs now
    try:
        problems = reward_source_problems(DEFAULT_REWARD_FN, {"apps", "openai/gsm8k"})
        assert len(problems) == 1 and "data_source 'apps'" in problems[0] and "bubblewrap (bwrap) is not installed" in problems[0]
        assert reward_source_problems(DEFAULT_REWARD_FN, {"openai/gsm8k"}) == []
    finally:
        code.configure(CodeConfig())


def test_a_case_returns_only_once_its_whole_tree_is_gone():
    """bwrap reports the program's exit while the kernel may still be killing the rest of its pid namespace;
    the run waits for the sandbox's pid 1 (without that wait, 15 of 30 such runs left children behind)."""
    scorer = CodeScorer(CodeConfig(timeout_s=2.0, memory_limit_mb=512, max_processes=16, max_concurrent=1))
    try:
        for _ in range(12):
            run = scorer.pool.run({"program": FORK_BOMB.format(forks=100, sleep=60), "fn_name": None, "input": ""})
            assert run.status == "ok" and sandbox_processes(scorer.pool) == []
    finally:
        scorer.close()


def test_a_failing_sandbox_stops_the_run_after_the_threshold_with_its_reason(tmp_path):
    """Not the programs' fault: the sandbox never starts (a bwrap that exits at once). Each case is tried twice,
    counted as sandbox_error, and max_sandbox_errors of them in a row raise with bwrap's own message."""
    from rlpad.code.scorer import SandboxFailure

    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
    broken.chmod(0o755)
    scorer = CodeScorer(CodeConfig(max_sandbox_errors=3, max_concurrent=1))
    try:
        scorer.pool.sandbox.bwrap = str(broken)
        one = scorer.score([(f"```python\n{HONEST}```", DOUBLE)])[0]
        assert (one.outcome, one.score) == ("sandbox_error", 0.0)
        with pytest.raises(SandboxFailure, match="3 cases in a row.*Creating new namespace failed"):
            scorer.score([(f"```python\n# {i}\n{HONEST}```", DOUBLE) for i in range(5)])
    finally:
        scorer.close()
