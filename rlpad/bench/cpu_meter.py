"""CPU core-seconds a run spends per step: its process tree's CPU time read at each step's end.

A run on Ray is the driver and its descendants (a local Ray cluster's gcs, raylet and every worker and
engine process are started under the driver), so summing their user + system time counts the run's work
and nothing else on the machine. :class:`StepCPU` polls in a thread: each time the run's
``metrics.jsonl`` gains a line (a step ended), it records the tree's CPU seconds. The work a loop does per
trained sample, divided by the cores it may use, bounds how fast any overlap of that work can make it:
``bound = cores x wall / cpu`` (a loop that already keeps every core busy cannot be sped up by overlap).
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["StepCPU", "tree_cpu_seconds", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system seconds of ``pid`` (default: this process) and all its live descendants, with the time
    of their children already reaped."""
    import psutil  # vLLM's and Ray's dependency: present wherever a run on engines happens

    root = psutil.Process(pid or os.getpid())
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited between the listing and the read
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class StepCPU:
    """``with StepCPU(path) as meter: fit(...)``; then ``meter.steps`` = [(step_index, wall_time, cpu_s)] at each
    line ``path`` gained (a step's end), ``meter.window(skip)`` = (steps, wall s, CPU s) from the first reading at
    or after step ``skip``'s end to the last step's end."""

    def __init__(self, metrics_path: str, period_s: float = 0.05):
        self.path, self.period = metrics_path, period_s
        self.steps: list[tuple[int, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-cpu", daemon=True)

    def _lines(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    def _size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def _run(self) -> None:
        seen, size = 0, 0
        while not self._stop.wait(self.period):
            if self._size() == size:  # nothing appended since the last read: no re-read of the whole file
                continue
            size = self._size()
            lines = self._lines()
            if lines > seen:  # one or more steps ended since the last poll: the reading belongs to the last
                self.steps.append((lines, time.perf_counter(), tree_cpu_seconds()))
                seen = lines

    def __enter__(self) -> StepCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, skip: int) -> tuple[int, float, float]:
        """(steps, wall s, CPU core-s) between the first reading at or after step ``skip``'s end and the last."""
        start = next((s for s in self.steps if s[0] >= skip), None)
        if start is None or start is self.steps[-1]:
            raise ValueError(f"{len(self.steps)} step ends seen in {self.path}: none after step {skip}")
        end = self.steps[-1]
        return end[0] - start[0], end[1] - start[1], end[2] - start[2]
