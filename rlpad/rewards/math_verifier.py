"""Math answers checked by HF's ``math-verify`` (as verl scores math), with a timeout per call.

:func:`verify_answer` decides for :func:`rlpad.rewards.rules.math_verify_score`, the scorer of the math data
sources in :data:`rlpad.rewards.rules.SCORERS`.
The ground truth is read as a boxed LaTeX answer, the response's answer is extracted by math-verify
(a ``\\boxed{}``, else the last LaTeX / plain expression), and the two compare symbolically:
``\\frac{3}{4}`` = ``0.75``, ``\\sqrt{2}/2`` = ``\\frac{\\sqrt{2}}{2}``, ``(0, 1]`` != ``[0, 1)``.

Each check runs in one child process of the driver (``python -m rlpad.rewards.math_verifier``, started on first
use, kept; it imports math-verify and nothing of rlpad's): a pathological
answer (``9^{9^{9^{9}}}``: sympy computes the power in C, where no signal reaches it) cannot hang a
step. Past ``timeout_s`` the child is killed (the next call starts another) and there is no verdict:
the scorer then uses rlpad's normaliser, as it does wherever math-verify is not installed or cannot
read the ground truth. Such a fall-back is never silent: each is counted (:func:`drain_fallbacks`,
the step metric ``reward/math_verify_fallbacks``) and the first of each kind is logged as a warning;
a run that would score a math data source without math-verify installed is refused at start
(:func:`rlpad.rewards.rules.reward_source_problems`).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import logging
import select
import subprocess
import sys
import threading
from typing import Any

__all__ = ["FALLBACK_METRIC", "TIMEOUT_S", "available", "drain_fallbacks", "verify_answer"]

TIMEOUT_S = 5.0  # seconds one check may take
START_TIMEOUT_S = 120.0  # the child's start (importing sympy and math-verify)
_NO_ANSWER = object()
_TIMED_OUT = object()
FALLBACK_METRIC = "reward/math_verify_fallbacks"  # responses scored by rlpad's normaliser instead, per step
_WHY = {"missing": "math-verify is not installed (pip install math-verify, in rlpad's cpu / gpu extras)",
        "timeout": "a check took longer than its timeout (the child was killed)",
        "unreadable": "math-verify gave no verdict (a ground truth it cannot parse, or an error)"}
_log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """Whether math-verify is installed (looked up once: the scorer asks per response)."""
    return importlib.util.find_spec("math_verify") is not None


def _check(parse: Any, verify: Any, truth: str, solution: str) -> bool | None:
    """math-verify's verdict; None when the ground truth does not parse. Its own timeouts are off: the
    parent's kill is the timeout."""
    gold = parse(f"\\boxed{{{truth}}}", parsing_timeout=None)
    if not gold:
        return None
    answer = parse(solution, parsing_timeout=None)
    return bool(answer) and bool(verify(gold, answer, timeout_seconds=None))


def _serve() -> None:
    """The child (``python -m rlpad.rewards.math_verifier``): one JSON ``[truth, solution]`` per stdin line, one JSON
    verdict (true / false / null) per stdout line."""
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off
    from math_verify import parse, verify

    print("\"ready\"", flush=True)
    for line in sys.stdin:
        try:
            verdict = _check(parse, verify, *json.loads(line))
        except Exception:  # an answer math-verify cannot handle: the normaliser decides
            verdict = None
        print(json.dumps(verdict), flush=True)


class _Child:
    """One checking process (not a fork of the driver, which holds threads and torch state), restarted
    after a timeout; calls are serialised by a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None

    def _read(self, timeout_s: float) -> Any:
        """The child's next line (JSON), or ``_NO_ANSWER`` after ``timeout_s`` seconds."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else _NO_ANSWER

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "rlpad.rewards.math_verifier"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        if self._read(START_TIMEOUT_S) != "ready":
            self._kill()
            raise RuntimeError(f"the math-verify process did not start within {START_TIMEOUT_S:.0f} s")

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def check(self, truth: str, solution: str, timeout_s: float) -> Any:
        """The verdict, None (undecidable) or ``_TIMED_OUT``: the caller falls back."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            self.proc.stdin.write(json.dumps([truth, solution]) + "\n")
            self.proc.stdin.flush()
            verdict = self._read(timeout_s)
            if verdict is _NO_ANSWER:
                self._kill()
                return _TIMED_OUT
            return verdict


_CHILD = _Child()
atexit.register(_CHILD._kill)


class _Tally:
    """Checks asked and fall-backs by kind since the last :func:`drain_fallbacks`; kinds already warned about."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked, self.fallbacks, self.warned = 0, 0, set()

    def record(self, why: str | None) -> None:
        with self.lock:
            self.asked += 1
            if why is None:
                return
            self.fallbacks += 1
            first = why not in self.warned
            self.warned.add(why)
        if first:
            _log.warning("math-verify fell back to rlpad's normaliser: %s; counted in %s (warned once per kind)",
                         _WHY[why], FALLBACK_METRIC)


_TALLY = _Tally()


def drain_fallbacks() -> dict[str, float]:
    """``{FALLBACK_METRIC: fall-backs}`` since the last call (and resets), or ``{}`` when math-verify was not
    asked since then (a run on other rewards gets no such metric)."""
    with _TALLY.lock:
        asked, n = _TALLY.asked, _TALLY.fallbacks
        _TALLY.asked = _TALLY.fallbacks = 0
    return {FALLBACK_METRIC: float(n)} if asked else {}


def verify_answer(solution_str: str, ground_truth: Any, timeout_s: float = TIMEOUT_S) -> bool | None:
    """math-verify's verdict on ``solution_str`` against ``ground_truth`` within ``timeout_s`` seconds;
    None when math-verify is not installed, timed out or cannot read the ground truth (each counted)."""
    if not available():
        _TALLY.record("missing")
        return None
    verdict = _CHILD.check(str(ground_truth), solution_str, timeout_s)
    _TALLY.record("timeout" if verdict is _TIMED_OUT else "unreadable" if verdict is None else None)
    return None if verdict is _TIMED_OUT else verdict


if __name__ == "__main__":
    _serve()
