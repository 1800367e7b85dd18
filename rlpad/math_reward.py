"""Math answers checked by HF's ``math-verify`` (as verl scores math), with a timeout per call.

:func:`verify_answer` decides for :func:`rlpad.rewards.math_verify_score`, the scorer of the math data
sources in :data:`rlpad.rewards.SCORERS`.
The ground truth is read as a boxed LaTeX answer, the response's answer is extracted by math-verify
(a ``\\boxed{}``, else the last LaTeX / plain expression), and the two compare symbolically:
``\\frac{3}{4}`` = ``0.75``, ``\\sqrt{2}/2`` = ``\\frac{\\sqrt{2}}{2}``, ``(0, 1]`` != ``[0, 1)``.

Each check runs in one child process of the driver (started on first use, kept): a pathological
answer (``9^{9^{9^{9}}}``: sympy computes the power in C, where no signal reaches it) cannot hang a
step. Past ``timeout_s`` the child is killed (the next call starts another) and there is no verdict:
the scorer then uses rlpad's normaliser, as it does wherever math-verify is not installed or cannot
read the ground truth.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["TIMEOUT_S", "available", "verify_answer"]

TIMEOUT_S = 5.0  # seconds one check may take
START_TIMEOUT_S = 120.0  # the child's start (importing sympy and math-verify)


def available() -> bool:
    """Whether math-verify is installed."""
    return importlib.util.find_spec("math_verify") is not None


def _check(parse: Any, verify: Any, truth: str, solution: str) -> bool | None:
    """math-verify's verdict; None when the ground truth does not parse. Its own timeouts are off: the
    parent's kill is the timeout."""
    gold = parse(f"\\boxed{{{truth}}}", parsing_timeout=None)
    if not gold:
        return None
    answer = parse(solution, parsing_timeout=None)
    return bool(answer) and bool(verify(gold, answer, timeout_seconds=None))


def _serve(conn: Connection) -> None:
    """The child: answer ``(truth, solution)`` requests with ``_check``'s verdict until told to stop (None)."""
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off
    from math_verify import parse, verify

    conn.send("ready")
    while (request := conn.recv()) is not None:
        try:
            conn.send(_check(parse, verify, *request))
        except Exception:  # an answer math-verify cannot handle: the normaliser decides
            conn.send(None)


class _Child:
    """One checking process, restarted after a timeout; calls are serialised by a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: Any = None
        self.conn: Connection | None = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # no fork of a driver holding threads and torch state
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="rlpad-math-verify")
        self.proc.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv() != "ready":
            self._kill()
            raise RuntimeError(f"the math-verify process did not start within {START_TIMEOUT_S:.0f} s")

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
        self.proc, self.conn = None, None

    def check(self, truth: str, solution: str, timeout_s: float) -> bool | None:
        """The verdict, or None (timed out, or undecidable: the caller falls back)."""
        with self.lock:
            if self.proc is None or not self.proc.is_alive():
                self._start()
            self.conn.send((truth, solution))
            if self.conn.poll(timeout_s):
                return self.conn.recv()
            self._kill()
            return None


_CHILD = _Child()


def verify_answer(solution_str: str, ground_truth: Any, timeout_s: float = TIMEOUT_S) -> bool | None:
    """math-verify's verdict on ``solution_str`` against ``ground_truth`` within ``timeout_s`` seconds;
    None when math-verify is not installed, timed out or cannot read the ground truth."""
    if not available():
        return None
    return _CHILD.check(str(ground_truth), solution_str, timeout_s)
