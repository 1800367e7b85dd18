"""What the rest of rlpad calls for code rewards: the process's scorer (:func:`configure` at the start of a
run, from ``reward.code``), verl's per-row score (:func:`compute_score`, which rlpad.rewards.verl_default
routes verl's code sources to), the reward stage's batch hook (:func:`prefetch`: every code row of a
batch at once, before the per-row calls read the results) and the start-of-run check (:func:`sandbox_problem`)."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from typing import Any

from rlpad.config.code import CodeConfig
from rlpad.code.harness import decode_value, encode_value
from rlpad.code.sandbox import Sandbox
from rlpad.code.scorer import CodeScorer
from rlpad.code.sources import FLAG_KEY_PREFIX, OUTCOMES, SCORED_SOURCES

__all__ = ["compute_score", "configure", "prefetch", "sandbox_problem", "scorer"]

_scorer: CodeScorer | None = None
_lock = threading.Lock()


def configure(cfg: CodeConfig, data_sources: Sequence[str] = ()) -> CodeScorer:
    """The process's scorer for ``reward.code`` settings ``cfg`` (the previous one closed if they differ).
    ``data_sources``: the run's; when any is scored by running code, every scored batch gets the outcome
    flags (zeros on its other rows), so batches of a mixed data set concatenate."""
    global _scorer
    with _lock:
        if _scorer is not None and _scorer.cfg != cfg:
            _scorer.close()
            _scorer = None
        if _scorer is None:
            _scorer = CodeScorer(cfg)
        _scorer.flag_every_batch = any(ds in SCORED_SOURCES for ds in data_sources)
        return _scorer


def scorer() -> CodeScorer:
    """The process's scorer (the defaults of ``reward.code`` until :func:`configure` is called)."""
    return _scorer if _scorer is not None else configure(CodeConfig())


@atexit.register
def _close() -> None:
    if _scorer is not None:
        _scorer.close()


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """verl's prime_code score of one response (module rlpad.code.scorer): the share of the first 10
    cases passed, or all-or-nothing with ``reward.code.continuous=false``."""
    return scorer().score([(solution_str, ground_truth)])[0].score


def prefetch(texts: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[Any]) -> dict[str, list[float]]:
    """Score every code row of a batch at once (the per-row :func:`compute_score` calls then read the cache);
    ``{"reward_flags/code/<outcome>": one 0/1 per row}`` for every outcome; {} without a code row (unless
    :func:`configure` was told the run has code sources)."""
    rows = [i for i, ds in enumerate(data_sources) if ds in SCORED_SOURCES]
    code = scorer()
    if not rows and not code.flag_every_batch:
        return {}
    code.new_batch()
    results = code.score([(texts[i], ground_truths[i]) for i in rows]) if rows else []
    flags = {FLAG_KEY_PREFIX + o: [0.0] * len(texts) for o in OUTCOMES}
    for i, result in zip(rows, results):
        flags[FLAG_KEY_PREFIX + result.outcome][i] = 1.0
    return flags


def sandbox_problem() -> str | None:
    """Why code cannot run safely on this machine (one line), or None: a tiny program runs in the sandbox
    and must give its answer. A run with code sources is refused at start on a problem; nothing ever
    runs unsandboxed."""
    code = scorer()
    if code.probe is None:
        code.probe = _probe(code)
    return code.probe or None


def _probe(code: CodeScorer) -> str:
    sandbox = Sandbox(code.cfg)
    if (missing := sandbox.missing()) is not None:
        return f"code data sources run programs in a sandbox: {missing}"
    hint = ("as root, bubblewrap needs the right to create namespaces (in a container: --cap-add SYS_ADMIN and "
            "--security-opt seccomp=unconfined, or run as a user with user namespaces)" if sandbox.root else
            "unprivileged user namespaces must be enabled (user.max_user_namespaces > 0; on Ubuntu also "
            "kernel.apparmor_restrict_unprivileged_userns=0)")
    try:
        run = code.pool.run({"program": "def f(x):\n    return x + 1\n", "fn_name": "f", "args": encode_value([41])})
    except (OSError, RuntimeError) as e:
        return f"code data sources run programs in a sandbox, which cannot start here ({e}); {hint}"
    if run.status != "ok" or decode_value(run.value) != 42:
        return (f"code data sources run programs in a bubblewrap sandbox, which does not work here ({run.status}: "
                f"{run.error or run.value}); {hint}")
    return ""
