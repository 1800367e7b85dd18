"""The sandbox workers: ``reward.code.max_concurrent`` threads (default: the CPUs this process may use),
each starting one sandbox at a time (the sandboxes are processes: the threads only wait on them). As
root every worker owns a uid of its own for its sandboxes (rlpad.code.sandbox.UidSlots)."""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rlpad.config.code import CodeConfig
from rlpad.code.sandbox import CaseRun, Sandbox, UidSlots

__all__ = ["SandboxPool", "default_workers"]


def default_workers() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class SandboxPool:
    """Runs cases concurrently, each in a fresh sandbox; :meth:`submit` returns a future of its
    :class:`CaseRun`. A case whose sandbox fails to come up is tried once more before it is reported."""

    def __init__(self, cfg: CodeConfig):
        self.sandbox = Sandbox(cfg)
        self.workers = cfg.max_concurrent or default_workers()
        self._slots: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._uids = UidSlots(self.workers) if self.sandbox.root else None
        for uid in (self._uids.uids if self._uids is not None else [None] * self.workers):
            self._slots.put(uid)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="rlpad-sandbox")
        self._lock = threading.Lock()
        self.closed = False

    @property
    def uids(self) -> list[int]:
        """The uids this pool's sandboxes run as (as root; none otherwise)."""
        return self._uids.uids if self._uids is not None else []

    def run(self, job: dict[str, Any]) -> CaseRun:
        """One case now, on the calling thread (a slot taken for its duration)."""
        uid = self._slots.get()
        try:
            result = self._once(job, uid)
            if result.status == "sandbox_error":  # a transient failure (fork refused on a loaded machine): once more
                result = self._once(job, uid)
            return result
        finally:
            self._slots.put(uid)

    def _once(self, job: dict[str, Any], uid: int | None) -> CaseRun:
        try:
            return self.sandbox.run(job, uid)
        except OSError as e:  # no pipe, no process: this machine, not the program
            return CaseRun("sandbox_error", error=f"{type(e).__name__}: {e}")

    def submit(self, job: dict[str, Any]) -> Future[CaseRun]:
        return self._executor.submit(self.run, job)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._uids is not None:
            self._uids.release()
