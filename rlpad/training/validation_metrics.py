"""Validation metrics per data source, with verl 0.9.1's names and meaning (numpy only; no torch).

A validation rollout samples ``N = rollout.val_kwargs.n`` responses per prompt. Each response row has a
data source, its prompt's ``uid`` and values of some *variables*: ``reward`` (the validation score) and
what the reward function returned beside it (verl's ``reward_extra_info``: every key of a returned dict,
or ``acc`` = the score when it returned a number). Per data source, per variable, per prompt, then
averaged over the prompts of the source (:func:`per_source_metrics`):

* ``mean@N``, ``std@N``: the mean and the population std of the prompt's N values;
* ``best@k/mean``, ``best@k/std`` (``worst@k/...``): for k = 2, 4, 8, ... below N, then N
  (:func:`subset_sizes`), the max (min) of k values drawn with replacement, over ``N_BOOTSTRAP``
  draws from a RandomState seeded with ``seed`` before each (prompt, k): their mean and std;
* ``maj@k/mean``, ``maj@k/std``: the same draws, each scored by majority vote over the answers the
  reward function extracted (its ``pred``): the most frequent answer of the draw wins, a tie goes to
  the answer drawn first, and the draw's value is the first drawn value of the winning answer. Only
  where every response of the prompt has a ``pred``: a reward function returning a bare number
  extracts no answer, so nothing can be voted on and no maj@k is reported.

Variables whose values are text (``pred`` itself) get no metrics. :func:`metric_keys` names them as
verl's trainer logs them: ``val-core/<source>/<var>/<metric>`` for the source's core variable (``acc``
if any row has one, else ``reward``) and mean / best / maj at the largest k, ``val-aux/...`` for the
rest. :func:`validation_report` adds the same over every source together, as the source ``all``.

The numbers equal verl's ``process_validation_metrics`` (tests/test_validation_metrics.py checks them
against verl's own output on recorded validation outputs, and live where verl is installed).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["ALL_SOURCES", "CORE", "N_BOOTSTRAP", "SEED", "ValidationRows", "majority_values", "metric_keys",
           "per_source_metrics", "prompt_metrics", "subset_sizes", "validation_report"]

SEED = 42  # verl's process_validation_metrics default: the bootstrap's seed
N_BOOTSTRAP = 1000  # draws per (prompt, k), verl's
PRED = "pred"  # the variable holding the extracted answer
CORE, AUX = "val-core", "val-aux"
ALL_SOURCES = "all"  # the source name of the metrics over every data source together


def subset_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k for N = ``n`` responses: 2, 4, 8, ... below n, then n ([] if n <= 1)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


@lru_cache(maxsize=64)
def _draws(n: int, k: int, seed: int, n_bootstrap: int) -> np.ndarray:
    """(n_bootstrap, k) indices into n values, drawn with replacement by numpy's legacy RandomState(seed):
    what ``np.random.seed(seed); np.random.choice(n, (n_bootstrap, k))`` gives (read-only, shared)."""
    draws = np.random.RandomState(seed).choice(n, size=(n_bootstrap, k), replace=True)
    draws.flags.writeable = False
    return draws


def majority_values(values: np.ndarray, answers: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """(D,) the majority-vote value of each draw: ``values`` (n,) and ``answers`` (n,) int codes of the
    responses' extracted answers, ``draws`` (D, k) indices. Per draw the most frequent code wins, a tie
    to the code drawn first; the value is that of the winner's first drawn response."""
    codes = answers[draws]  # (D, k)
    kinds = int(answers.max()) + 1
    rows = np.arange(draws.shape[0])[:, None]
    counts = np.bincount((rows * kinds + codes).ravel(), minlength=draws.shape[0] * kinds).reshape(-1, kinds)
    at = np.take_along_axis(counts, codes, axis=1)  # (D, k): how often each drawn answer occurs in its draw
    # the first position holding a most frequent answer is the first occurrence of the one drawn first
    first = np.argmax(at == at.max(axis=1, keepdims=True), axis=1)
    return values[np.take_along_axis(draws, first[:, None], axis=1)[:, 0]]


def _mean_std(x: np.ndarray) -> tuple[float, float]:
    return float(np.mean(x)), float(np.std(x))


def prompt_metrics(values: Sequence[Any], answers: Sequence[Hashable] | None = None, *, seed: int = SEED,
                   n_bootstrap: int = N_BOOTSTRAP) -> dict[str, float]:
    """One prompt's metrics of one variable over its responses' ``values`` (see the module docstring);
    ``answers``: each response's extracted answer (None: no maj@k)."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    out = {f"mean@{n}": float(np.mean(x))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(x))
    codes = None
    if answers is not None:
        index: dict[Hashable, int] = {}
        codes = np.array([index.setdefault(a, len(index)) for a in answers], dtype=np.int64)
    for k in subset_sizes(n):
        draws = _draws(n, k, seed, n_bootstrap)
        picked = x[draws]
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = _mean_std(picked.max(axis=1))
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = _mean_std(picked.min(axis=1))
        if codes is not None:
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = _mean_std(majority_values(x, codes, draws))
    return out


def _answer(value: Any) -> Hashable:
    """An extracted answer as a vote key (an unhashable one by its repr)."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def per_source_metrics(data_sources: Sequence[str], uids: Sequence[Hashable], variables: Mapping[str, Sequence[Any]],
                       *, seed: int = SEED, n_bootstrap: int = N_BOOTSTRAP) -> dict[str, dict[str, dict[str, float]]]:
    """``{source: {variable: {metric: value}}}``: each prompt's :func:`prompt_metrics` (rows grouped by
    source, then ``uid``, in the order they come), averaged over the prompts of a source that have the
    metric. ``variables``: name -> one value per row (None: no value for that row). A variable whose
    first value is text gets none; ``pred``'s values are the answers voted on."""
    rows = len(data_sources)
    if len(uids) != rows or any(len(v) != rows for v in variables.values()):
        raise ValueError(f"{rows} data sources, {len(uids)} uids, variable lengths "
                         f"{ {k: len(v) for k, v in variables.items()} }: one value per row each")
    groups: dict[str, dict[Hashable, list[int]]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        groups.setdefault(source, {}).setdefault(uid, []).append(i)
    answers_of = variables.get(PRED)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for source, prompts in groups.items():
        per_metric: dict[str, dict[str, list[float]]] = {}
        for idx in prompts.values():
            answers = None if answers_of is None else [answers_of[i] for i in idx]
            for name, column in variables.items():
                values = [column[i] for i in idx if column[i] is not None]
                if not values or isinstance(values[0], str):
                    continue
                voted = answers is not None and len(answers) == len(values) and all(a is not None for a in answers)
                metrics = prompt_metrics(values, [_answer(a) for a in answers] if voted else None,
                                         seed=seed, n_bootstrap=n_bootstrap)
                for metric, value in metrics.items():
                    per_metric.setdefault(name, {}).setdefault(metric, []).append(value)
        out[source] = {name: {metric: float(np.mean(v)) for metric, v in metrics.items()}
                       for name, metrics in per_metric.items()}
    return out


def _k(metric: str) -> int:
    """The N or k of a metric name: ``mean@16`` -> 16, ``best@4/std`` -> 4."""
    return int(metric.split("@")[-1].split("/")[0])


def metric_keys(per_source: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, float]:
    """:func:`per_source_metrics` as verl's trainer logs it: ``val-core/<source>/<var>/<metric>`` for the core
    variable's (``acc`` where the source has it, else ``reward``) mean / best / maj at its largest k,
    ``val-aux/<source>/<var>/<metric>`` for every other metric."""
    out = {}
    for source, by_var in per_source.items():
        core = "acc" if "acc" in by_var else "reward"
        for name, metrics in by_var.items():
            top = max(_k(m) for m in metrics)
            for metric, value in metrics.items():
                is_core = name == core and metric.startswith(("mean", "maj", "best")) and _k(metric) == top
                out[f"{CORE if is_core else AUX}/{source}/{name}/{metric}"] = value
    return out


class ValidationRows:
    """The rows of one validation pass, gathered batch by batch (:meth:`add`), then :meth:`metrics`."""

    def __init__(self) -> None:
        self.data_sources: list[str] = []
        self.uids: list[Hashable] = []
        self.scores: list[float] = []
        self.extra_info: list[Mapping[str, Any]] = []

    def add(self, data_sources: Iterable[Any], uids: Iterable[Hashable], scores: Iterable[Any],
            extra_info: Iterable[Mapping[str, Any]] | None = None) -> None:
        """One batch: its rows' data sources, uids, validation scores (``reward``) and what the reward
        function returned beside each score (``{"acc": ..., "pred": ...}``; None: nothing)."""
        sources, uids, scores = [str(s) for s in data_sources], list(uids), [float(s) for s in scores]
        extras = [{}] * len(sources) if extra_info is None else list(extra_info)
        if not len(sources) == len(uids) == len(scores) == len(extras):
            raise ValueError(f"validation batch: {len(sources)} data sources, {len(uids)} uids, {len(scores)} scores, "
                             f"{len(extras)} reward infos: one per row each")
        self.data_sources += sources
        self.uids += uids
        self.scores += scores
        self.extra_info += extras

    def __len__(self) -> int:
        return len(self.data_sources)

    @property
    def variables(self) -> dict[str, list[Any]]:
        """``reward`` (the scores), then each key of the reward infos in the order first seen (None where a
        row has none)."""
        keys = dict.fromkeys(k for info in self.extra_info for k in info if k != "reward")
        return {"reward": list(self.scores), **{k: [_plain(info.get(k)) for info in self.extra_info] for k in keys}}

    def metrics(self, *, seed: int = SEED, overall: bool = True) -> dict[str, float]:
        """:func:`validation_report` of the rows gathered."""
        return validation_report(self.data_sources, self.uids, self.variables, seed=seed, overall=overall)


def _plain(value: Any) -> Any:
    """A numpy scalar (or a 0-d tensor) as its Python value; anything else as is."""
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", None) == 0 else value


def validation_report(data_sources: Sequence[str], uids: Sequence[Hashable], variables: Mapping[str, Sequence[Any]],
                      *, seed: int = SEED, overall: bool = True) -> dict[str, float]:
    """:func:`metric_keys` of :func:`per_source_metrics`, and with ``overall`` and two or more sources, the
    same over every row as the source ``all`` (ValueError if a data source is itself named so)."""
    out = metric_keys(per_source_metrics(data_sources, uids, variables, seed=seed))
    names = set(data_sources)
    if overall and len(names) > 1:
        if ALL_SOURCES in names:
            raise ValueError(f"a data source is named {ALL_SOURCES!r}, the name of the metrics over every source; "
                             "rename it in the data")
        out.update(metric_keys(per_source_metrics([ALL_SOURCES] * len(data_sources), uids, variables, seed=seed)))
    return out
