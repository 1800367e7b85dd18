"""Pin a local run's worker processes to CPU cores of their own (benchmarks on one machine).

``pin_cores(workers)`` puts every rollout engine and every actor / ref / critic rank on its own
core (engines on the last cores, ranks on the first), all of each process's threads, so phases
that overlap (asynchronous training) do not take each other's cores. Linux only; the processes
must run on this machine (a local Ray).
"""

from __future__ import annotations

import os
from typing import Any

import ray

__all__ = ["pin_cores", "pin_process"]


def pin_process(pid: int, cores: set[int]) -> int:
    """Restrict every thread of process ``pid`` to ``cores``; returns the number of threads pinned."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return len(tids)


def pin_cores(workers: Any) -> dict[str, list[int]]:
    """One core per engine (``workers.rollout``) and per rank of each group; returns ``{process: [core]}``.

    ValueError when the machine has fewer cores than processes to pin.
    """
    cores = sorted(os.sched_getaffinity(0))
    engines = ray.get([a.placement.remote() for a in workers.rollout.actors])
    ranks = []
    for name in ("actor", "ref", "critic"):
        group = getattr(workers, name, None)
        if group is not None:
            ranks += [(f"{name} rank {r['rank']}", r["pid"]) for r in group.rank_info()]
    wanted = len(engines) + len(ranks)
    if wanted > len(cores):
        raise ValueError(f"pinning {len(engines)} engine(s) and {len(ranks)} rank(s) to a core each needs {wanted} "
                         f"cores; this process may use {len(cores)} ({cores})")
    plan = [(f"rollout replica {i}", e["pid"], cores[-1 - i]) for i, e in enumerate(engines)]
    plan += [(name, pid, cores[i]) for i, (name, pid) in enumerate(ranks)]
    for _, pid, core in plan:
        pin_process(pid, {core})
    return {name: [core] for name, _, core in plan}
