"""Running tool calls concurrently, each under a real time limit, in worker processes.

:class:`ToolPool` keeps ``workers`` processes (:mod:`rlpad.rollout.tool_worker`), each running up to
``ceil(concurrency / workers)`` calls at once in threads. :meth:`ToolPool.run` sends a turn's calls
(all samples together) as slots free up; a call gets ``timeout`` seconds from the moment it is sent.
A call past its time is answered ``("timeout", seconds)`` at once; its process takes no more calls
and is killed (its whole session: the hung thread, and any process the tool started) as soon as its
other calls are answered, then replaced. So a turn whose calls all hang costs about one ``timeout``
(when ``concurrency`` covers the turn's calls), and nothing a tool started outlives the pool
(:meth:`ToolPool.close`). A process that dies under its calls (a tool calling ``os._exit``) answers each
of its calls in flight ``("crashed", exit code)`` and is replaced; a call sent as it died goes to another
worker. A worker whose pool is gone (end of its pipe) kills its own session, so what its tools started
ends with it even when the pool's process is killed without closing the pool
(:func:`rlpad.rollout.tool_worker.end_session`). The tools' prints are logged (logger ``rlpad.tools``: run.log).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["ToolPool"]

log = logging.getLogger("rlpad.tools")
START_TIMEOUT_S = 120.0  # a worker's start: a fresh interpreter importing the tools' modules


class _Worker:
    """One worker process, its two pipe ends, the thread logging its output, and its calls in flight."""

    def __init__(self, specs: Sequence[str], threads: int, max_chars: int):
        down_r, down_w = os.pipe()  # pool -> worker
        up_r, up_w = os.pipe()  # worker -> pool
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        argv = [sys.executable, "-m", "rlpad.rollout.tool_worker", str(down_r), str(up_w), json.dumps(list(specs)),
                str(threads), str(max_chars)]
        self.proc = subprocess.Popen(argv, pass_fds=(down_r, up_w), env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        os.close(down_r)
        os.close(up_w)
        self.send_end, self.recv_end = Connection(down_w, readable=False), Connection(up_r, writable=False)
        self.inflight: dict[int, float] = {}  # call id -> deadline (time.monotonic)
        self.tainted = False  # a call of it timed out: it takes no more calls and is killed when idle
        self.logger = threading.Thread(target=self._log_output, daemon=True, name=f"rlpad-tool-log-{self.proc.pid}")
        self.logger.start()

    def _log_output(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            log.info("tool output (pid %d): %s", self.proc.pid, line.decode(errors="replace").rstrip())

    def wait_ready(self, deadline: float) -> None:
        if not self.recv_end.poll(max(0.0, deadline - time.monotonic())):
            self.kill()
            raise RuntimeError(f"multi_turn: a tool worker did not start within {START_TIMEOUT_S:g} s")
        try:
            status, _, reason = self.recv_end.recv()
        except EOFError:
            status, reason = "failed", f"exit code {self.proc.wait()}"
        if status != "ready":
            self.kill()
            raise RuntimeError(f"multi_turn: a tool worker could not load the tools: {reason}")

    def exit_code(self, block: bool = False) -> int | None:
        """The worker's exit code (None: running; ``block``: wait for it), read without reaping it: its pid,
        which is its session's group id, stays reserved until :meth:`kill` (so the group is never another's)."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG))
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def kill(self) -> None:
        if self.proc.returncode is None:  # not reaped: the group is still the worker's
            try:  # its session: its threads and any child, also when the worker itself has exited
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for end in (self.send_end, self.recv_end):
            end.close()
        self.logger.join(timeout=5)
        self.proc.stderr.close()


def _kill_all(workers: list[_Worker | None]) -> None:
    for i, w in enumerate(workers):
        if w is not None:
            w.kill()
            workers[i] = None


class ToolPool:
    """``workers`` tool processes running the tools named ``specs`` (see the module docstring).

    ``max_chars``: an output longer than this many characters is answered ``("too_long", length)``
    by the worker, never sent whole.
    """

    def __init__(self, specs: Sequence[str], *, timeout: float, workers: int, concurrency: int, max_chars: int):
        if not timeout > 0 or workers < 1 or concurrency < 1:
            raise ValueError(f"ToolPool: timeout {timeout}, workers {workers}, concurrency {concurrency} must be > 0")
        self.specs, self.timeout, self.max_chars = list(specs), float(timeout), int(max_chars)
        self.per_worker = math.ceil(concurrency / workers)
        self._workers: list[_Worker | None] = [None] * workers
        self._close = weakref.finalize(self, _kill_all, self._workers)  # at exit or when dropped

    def _retire_idle(self) -> None:
        """Kill the workers with no call in flight that had a call time out or died."""
        for i, w in enumerate(self._workers):
            if w is not None and (w.tainted or w.exit_code() is not None) and not w.inflight:
                w.kill()
                self._workers[i] = None

    def _start_missing(self) -> None:
        fresh = []
        for i, w in enumerate(self._workers):
            if w is None:
                self._workers[i] = w = _Worker(self.specs, self.per_worker, self.max_chars)
                fresh.append(w)
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in fresh:
            w.wait_ready(deadline)

    def run(self, jobs: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``(status, payload)`` per ``(tool name, arguments)`` job, in order: a worker status
        (:data:`rlpad.rollout.tool_worker.STATUSES`), ``("timeout", seconds)``, or ``("crashed", exit
        code)`` when the process died under the call."""
        try:
            return self._run(jobs)
        except BaseException:  # never leave a worker holding calls of this turn: the next turn starts clean
            self.close()
            raise

    def _run(self, jobs: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        results: list[tuple[str, Any] | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        workers = self._workers
        while pending or any(w is not None and w.inflight for w in workers):
            self._retire_idle()  # then start replacements and fill the slots
            if pending:
                self._start_missing()
            for w in workers:
                if w is not None and w.exit_code() is not None:
                    w.tainted = True  # died (a tool exited it): its calls in flight are answered "crashed" below
                while pending and w is not None and not w.tainted and len(w.inflight) < self.per_worker:
                    j = pending.popleft()
                    try:
                        w.send_end.send((j, *jobs[j]))
                    except OSError:  # it died since (BrokenPipeError): the call never got there, requeued
                        pending.appendleft(j)
                        w.tainted = True
                        break
                    w.inflight[j] = time.monotonic() + self.timeout
            busy = {w.recv_end: w for w in workers if w is not None and w.inflight}
            if not busy:
                continue
            first = min(d for w in busy.values() for d in w.inflight.values())
            for end in wait(list(busy), timeout=max(0.0, first - time.monotonic())):
                w = busy[end]
                try:
                    j, status, payload = end.recv()
                except (EOFError, OSError, pickle.UnpicklingError):  # the process died (a tool exited it, a crash)
                    code = w.exit_code(block=True)
                    for j in w.inflight:
                        results[j] = ("crashed", code)
                    w.inflight.clear()
                    w.tainted = True
                    continue
                if w.inflight.pop(j, None) is not None:  # else: a late answer to a call already timed out
                    results[j] = (status, payload)
            now = time.monotonic()
            for w in busy.values():
                for j, deadline in list(w.inflight.items()):
                    if deadline <= now:
                        results[j] = ("timeout", self.timeout)
                        del w.inflight[j]
                        w.tainted = True
        self._retire_idle()  # a worker that held a hung call is not kept
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Kill every worker process (and what its tools started); the pool starts new ones if used again."""
        _kill_all(self._workers)
