"""Scoring code responses: each response's program run on its problem's cases in the sandbox pool,
the cases of all responses at once, one outcome and one score per response.

Score (verl 0.9.1's prime_code as its default_compute_score calls it, ``reward.code.continuous``):
continuous: the share of the first 10 cases passed; else 1.0 when every case passes (the remaining
cases are not run after the first failure), 0.0 otherwise. A response without a ```` ```python````
block is still run whole, as verl does (a bare program passes), and when it does not pass its outcome
is ``no_code``. A program that does not compile fails every case: only its first case runs.

Results are cached per (program, case set) for the batch being scored (a GRPO group often repeats a
program). A case whose sandbox fails (not the program: it never started) scores 0 and counts as
``sandbox_error``; ``reward.code.max_sandbox_errors`` of them in a row stop the run with the reason.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from typing import Any

from rlpad.config.code import CodeConfig
from rlpad.errors import WorkerFailed
from rlpad.code.harness import decode_value, encode_value
from rlpad.code.pool import SandboxPool
from rlpad.code.program import CaseSet, extract_program, has_code_block, parse_cases
from rlpad.code.sandbox import CaseRun
from rlpad.code.sources import CONTINUOUS_CASES
from rlpad.code.verdict import call_passes, stdin_passes

__all__ = ["CodeResult", "CodeScorer", "SandboxFailure", "case_outcome"]

_FAILED_TO_COMPILE = "syntax_error"  # the same for every case of the program: one run tells
CACHE_LIMIT = 1 << 16  # results kept at most (a batch's are cleared by new_batch)


class SandboxFailure(WorkerFailed):
    """The sandbox itself failed ``reward.code.max_sandbox_errors`` cases in a row: the run stops (scoring
    every response 0 would teach the policy that everything fails), and, as for a failed worker, the
    trainer names the checkpoint to resume from once the machine is fixed."""


@dataclass(frozen=True)
class CodeResult:
    """One response: its score, its outcome (rlpad.code.sources.OUTCOMES), cases passed / counted / run."""

    score: float
    outcome: str
    passed: int
    cases: int  # the cases the score counts (the first 10 when continuous)
    ran: int = 0  # the cases actually run (fewer after an early failure, or none for a repeated program)


def case_outcome(run: CaseRun, cases: CaseSet, index: int) -> str:
    """A case's outcome: ``pass`` / ``wrong`` by verl's verdict on what the program produced, or why it
    produced nothing (``error`` for anything the program raised, ``timeout``, ``oom``, ...)."""
    if run.status not in ("ok", "timeout", "oom", "output_limit", "sandbox_error"):
        return "error"  # syntax_error, compile_error, error, or whatever else a program wrote on the channel
    if run.status != "ok":
        return run.status
    try:
        if cases.fn_name is None:
            ok = stdin_passes(run.stdout.decode("utf-8", "surrogatepass"), cases.outputs[index])
        else:
            ok = call_passes(decode_value(run.value), cases.outputs[index])
    except Exception:  # noqa: BLE001  the program wrote something else on the channel (it is the program's)
        return "error"
    return "pass" if ok else "wrong"


class CodeScorer:
    """Scores code responses with the sandbox pool of ``cfg`` (created on first use, :meth:`close` ends it)."""

    def __init__(self, cfg: CodeConfig | None = None):
        self.cfg = cfg or CodeConfig()
        self._pool: SandboxPool | None = None
        self._cache: dict[str, CodeResult] = {}
        self._parsed: dict[str, CaseSet] = {}
        self._lock = threading.Lock()
        self.sandbox_errors_in_a_row = 0
        self.probe: str | None = None  # rlpad.code.sandbox_problem's verdict ("" : the sandbox works)
        self.flag_every_batch = False  # the run has code sources: every batch gets the outcome flags

    @property
    def pool(self) -> SandboxPool:
        with self._lock:
            if self._pool is None or self._pool.closed:
                self._pool = SandboxPool(self.cfg)
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def new_batch(self) -> None:
        """Forget the cached results and parsed ground truths (called for each batch: they live within a step)."""
        self._cache.clear()
        self._parsed.clear()

    def _cases(self, truth: Any) -> CaseSet:
        """The test cases of a ground truth; a JSON text is parsed once per batch (a group repeats it, and the
        per-row calls after :func:`rlpad.code.hooks.prefetch` read it again)."""
        if not isinstance(truth, str):
            return parse_cases(truth)
        cases = self._parsed.get(truth)
        if cases is None:
            cases = self._parsed[truth] = parse_cases(truth)
        return cases

    def score(self, items: Sequence[tuple[str, Any]]) -> list[CodeResult]:
        """``(response, ground_truth)`` pairs -> their results; every case of every response through the pool
        at once (cached ones and repeats of a program run once)."""
        if len(self._cache) + len(self._parsed) > CACHE_LIMIT:  # per-row calls without a batch never clear them
            self.new_batch()
        keys, work = [], {}  # work: the (program, case set)s to run; a repeat reads the first one's result
        for response, truth in items:
            cases = self._cases(truth)
            program = extract_program(response)
            key = hashlib.sha256(f"{cases.digest}\0{self.cfg.continuous}\0{program}".encode(
                "utf-8", "surrogatepass")).hexdigest()
            keys.append(key)
            if key not in self._cache and key not in work:
                work[key] = _Task(program, cases, has_code_block(response), self.cfg)
        if work:
            self._run(work)
        results, seen = [], set()
        for key in keys:  # the cases ran for the first response of a program only
            result = self._cache[key]
            results.append(result if key in work and key not in seen else replace(result, ran=0))
            seen.add(key)
        return results

    # ---- running the cases -----------------------------------------------------------------------

    def _run(self, work: dict[str, _Task]) -> None:
        pending: dict[Future[CaseRun], tuple[str, int]] = {}
        for key, task in work.items():
            if not task.program.strip():  # nothing to run (verl: no function to call, every case fails)
                self._cache[key] = CodeResult(0.0, "no_code" if not task.has_code else "error", 0, task.n)
        runnable = [(key, task) for key, task in work.items() if key not in self._cache]
        for i in range(max((task.n for _, task in runnable), default=0)):  # every program's first case first:
            for key, task in runnable:  # a program that fails it has its later cases cancelled before they start
                if i < task.n:
                    pending[self.pool.submit(task.job(i))] = (key, i)
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    key, i = pending.pop(future)
                    if future.cancelled():
                        continue
                    task = work[key]
                    run = future.result()
                    self._count_sandbox(run)
                    task.outcomes[i] = case_outcome(run, task.cases, i)
                    if task.settled(run):
                        for other, (k, _) in list(pending.items()):
                            if k == key and other.cancel():
                                pending.pop(other)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
        for key, task in work.items():
            if key not in self._cache:
                self._cache[key] = task.result()

    def _count_sandbox(self, run: CaseRun) -> None:
        if run.status != "sandbox_error":
            self.sandbox_errors_in_a_row = 0
            return
        self.sandbox_errors_in_a_row += 1
        if self.sandbox_errors_in_a_row >= self.cfg.max_sandbox_errors:
            raise SandboxFailure(f"the code sandbox failed {self.sandbox_errors_in_a_row} cases in a row "
                                 f"(reward.code.max_sandbox_errors={self.cfg.max_sandbox_errors}), the programs never "
                                 f"ran: {run.error}")


class _Task:
    """One (program, case set): the cases to run and their outcomes so far."""

    def __init__(self, program: str, cases: CaseSet, has_code: bool, cfg: CodeConfig):
        self.program, self.cases, self.has_code, self.continuous = program, cases, has_code, cfg.continuous
        self.n = min(len(cases), CONTINUOUS_CASES) if self.continuous else len(cases)
        self.outcomes: dict[int, str] = {}

    def job(self, i: int) -> dict[str, Any]:
        job: dict[str, Any] = {"program": self.program, "fn_name": self.cases.fn_name}
        if self.cases.fn_name is None:
            job["input"] = self.cases.inputs[i]
        else:
            job["args"] = encode_value(list(self.cases.inputs[i]))
        return job

    def settled(self, run: CaseRun) -> bool:
        """No other case can change the result: the program does not compile, or (all-or-nothing) a case failed."""
        failed = any(o != "pass" for o in self.outcomes.values())
        return run.status == _FAILED_TO_COMPILE or (failed and not self.continuous)

    def result(self) -> CodeResult:
        passed, ran = sum(o == "pass" for o in self.outcomes.values()), len(self.outcomes)
        if passed == self.n:
            return CodeResult(1.0, "pass", passed, self.n, ran)
        first = next(self.outcomes[i] for i in sorted(self.outcomes) if self.outcomes[i] != "pass")
        outcome = first if self.has_code else "no_code"
        return CodeResult(passed / self.n if self.continuous else 0.0, outcome, passed, self.n, ran)
