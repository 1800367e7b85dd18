"""Rewards combined: every weighted part of a response's reward computed, logged, weighted, summed.

Parts (names from :mod:`rlpad.rewards.settings`): ``rule`` (the reward function, ``reward.fn``),
``reward_model`` (``reward.reward_model``, when enabled), ``judge`` (``reward.judge``, when enabled:
rlpad.rewards.judge) and each ``reward.extra_fns`` function.
Per response, of data source ``s``::

    reward = sum over parts p of  weight(p, s) * clip(normalize_p(score_p))

``weight(p, s)``: :func:`rlpad.rewards.settings.part_weight` (``reward.source_weights[s][p]``, else
``reward.weights[p]``, else 1; the rule's default is 0 when a reward model is enabled and no function is
named, verl 0.9's meaning). ``normalize_p`` (parts in ``reward.normalize``): ``(x - mean) / std`` over every
score of that part training used so far (this batch included; validation never moves the statistics; a
std below 1e-6 of max(1, |mean|), a part constant so far, is not divided by: :class:`RunningStats`);
``clip``: to ``[-reward.clip, reward.clip]`` when set.

In training a part is computed only for the rows it weighs (weight != 0 for the row's source): a part of
weight 0 could not change the update, and its function may not know the source. Validation computes every
part for every row (the rule only where it weighs or knows the source), so a weight-0 part is still
reported. A non-finite score of a computed part stops the run with the part named.

Each part's raw score rides in the batch as ``reward_parts/<name>`` (B,), NaN on the rows it did not score,
so the step's metrics (``reward/<name>/mean``, over the rows scored) see the batch the step trains on, after
dynamic sampling; a part's per-row 0/1 flags (the judge's ``unparsable``, the reward model's ``truncated``,
:data:`rlpad.rewards.settings.PART_FLAGS`) ride as ``reward_flags/<name>/<flag>`` and are logged as
fractions, ``reward/<name>/<flag>``. ``acc`` is the rule part's (rlpad.rewards.rules), NaN where it did not
score.

Validation (:func:`rlpad.rewards.stage.validation_scores`) reports each row's reward in the task's own units: every part raw
(no normalisation; the clip only on parts that are not normalised, as it is in standard deviations on those
that are), weighted; beside it the trained reward (normalised with the statistics so far) when
``reward.normalize`` is set.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.config.rewards import RewardConfig
from rlpad.functions import load_function
from rlpad.rewards.rules import REWARD_EXTRA_INFO, RewardFn, load_reward_fn, place_scores, score_batch
from rlpad.rewards.settings import JUDGE, MODEL, PART_FLAGS, RULE, part_names, part_weight
from rlpad.rewards.sources import rule_scores_source

__all__ = ["FLAG_PREFIX", "PART_PREFIX", "CombinedReward", "RunningStats", "build_reward", "load_reward_state",
           "part_metrics", "parts_of", "reward_state", "rows_back"]

PART_PREFIX = "reward_parts/"  # batch key prefix of each part's raw (B,) scores
FLAG_PREFIX = "reward_flags/"  # batch key prefix of a part's (B,) 0/1 flags: reward_flags/<part>/<flag>

Flags = dict[str, torch.Tensor]
# a batch -> its reward-model scores (B,), or (scores, {flag: (B,) 0/1}) (rlpad.rewards.model_scorer's flags)
ModelScorer = Callable[[Batch], "torch.Tensor | tuple[torch.Tensor, Flags]"]
# a batch -> the judge's scores (B,) and its flags {name: (B,) 0/1} (rlpad.rewards.judge.JudgeScorer)
JudgeFn = Callable[[Batch], tuple[torch.Tensor, Flags]]


class RunningStats:
    """Mean and standard deviation of every value seen so far (Welford's update, float64)."""

    DEGENERATE = 1e-6  # a std at most this times max(1, |mean|) is not divided by (a part constant so far)

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        x = values.detach().double().reshape(-1)
        n = x.numel()
        if n == 0:
            return
        batch_mean = float(x.mean())
        batch_m2 = float(((x - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """The population standard deviation (1.0 before two values were seen)."""
        return (self.m2 / self.count) ** 0.5 if self.count >= 2 else 1.0

    @property
    def scale(self) -> float:
        """What :meth:`normalize` divides by: the std, or 1.0 while it is degenerate (fewer than two values, or
        at most ``DEGENERATE * max(1, |mean|)``: the values are centred, never blown up)."""
        std = self.std
        return std if self.count >= 2 and std > self.DEGENERATE * max(1.0, abs(self.mean)) else 1.0

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        return (values - self.mean) / self.scale

    def state_dict(self) -> dict[str, float]:
        """The statistics as JSON numbers (a float64 round-trips exactly through JSON)."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def _finite(name: str, scores: torch.Tensor, rows: Sequence[int], sources: Sequence[str]) -> None:
    """ValueError naming the part, the rows and their data sources where ``scores`` is not finite."""
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        where = ", ".join(f"row {rows[i]} ({sources[rows[i]]!r}): {float(scores[i])}" for i in bad[:4])
        raise ValueError(f"reward part {name!r} scored {len(bad)} row(s) non-finite ({where}); rewards must be finite")


def rows_back(batch: Batch, part: Batch, rows: Sequence[int], *, keys: tuple[str, ...] = (FLAG_PREFIX,),
               replace: bool = False) -> None:
    """What scoring ``part`` (``batch``'s ``rows``) left beside its scores, onto ``batch``: the rule's reward
    infos (``{}`` on the other rows) and the (B,) tensors under ``keys`` prefixes a scorer wrote itself
    (``reward_flags/...``, e.g. the code outcomes; the parts' scores too for :func:`rlpad.rewards.stage._env_rule`; NaN on the
    other rows): only those ``batch`` lacks, unless ``replace``."""
    n = len(batch)
    if REWARD_EXTRA_INFO in part:
        infos = [{} for _ in range(n)]
        for i, info in zip(rows, part[REWARD_EXTRA_INFO]):
            infos[i] = info
        batch[REWARD_EXTRA_INFO] = infos
    index = torch.tensor(list(rows))
    for key in part.tensors:
        if key.startswith(keys) and (replace or key not in batch):
            full = torch.full((n,), math.nan)
            full[index] = part.tensors[key].float()
            batch[key] = full


class CombinedReward:
    """The reward stage's scorer: the rule function, the optional reward model and judge, and the extra rule
    functions, combined as the module docstring says. ``model_scorer`` may be attached after the workers
    start (:meth:`attach_model`). ``rule_sources(data_source)``: the rule function scores that source
    (validation computes a weight-0 rule only there; rlpad.rewards.sources)."""

    def __init__(self, reward: RewardConfig, rule_fn: RewardFn, extra_fns: Mapping[str, RewardFn] | None = None,
                 model_scorer: ModelScorer | None = None, model_inputs: Callable[[Batch], Any] | None = None,
                 judge: JudgeFn | None = None, rule_sources: Callable[[str], bool] | None = None):
        self.config = reward
        # rollout batch -> (what the reward model reads, its flags) (rlpad.rewards.model_scorer.RewardModelInputs)
        self.model_inputs = model_inputs
        self.rule_fn = rule_fn
        self.extra_fns = dict(extra_fns or {})
        self.model_scorer = model_scorer
        self.uses_model = reward.reward_model.enable
        self.judge = judge  # the judge part (reward.judge.enable); its engines attached with the workers
        self.rule_sources = rule_sources or (lambda _source: True)
        if reward.judge.enable and judge is None:
            raise ValueError("reward.judge.enable=true needs the judge (rlpad.rewards.judge.JudgeScorer)")
        self.stats = {name: RunningStats() for name in reward.normalize}

    def attach_model(self, model_scorer: ModelScorer) -> None:
        self.model_scorer = model_scorer

    def attach_workers(self, workers: Any) -> None:
        """Score the reward-model part with ``workers.compute_rm_scores`` (the Ray or the local stack)
        on :attr:`model_inputs` of each batch, and the judge with ``workers.judge_generate`` (its engines)."""
        if self.uses_model:
            def score(batch: Batch) -> tuple[torch.Tensor, Flags]:
                inputs, flags = self.model_inputs(batch)
                return workers.compute_rm_scores(inputs)["rm_scores"], flags

            self.attach_model(score)
        if self.judge is not None:
            self.judge.attach(workers.judge_generate)

    @property
    def parts(self) -> list[str]:
        return part_names(self.config)

    def weight(self, part: str, data_source: str) -> float:
        return part_weight(self.config, part, data_source)

    def _rows(self, part: str, sources: Sequence[str], validation: bool) -> list[int]:
        """The rows ``part`` scores: those it weighs (training); every row, the rule's where it weighs or knows
        the source (validation)."""
        if not validation:
            return [i for i, s in enumerate(sources) if self.weight(part, s) != 0]
        if part != RULE:
            return list(range(len(sources)))
        return [i for i, s in enumerate(sources) if self.weight(part, s) != 0 or self.rule_sources(s)]

    def _score_part(self, name: str, batch: Batch, tokenizer: Any) -> tuple[torch.Tensor, Flags, torch.Tensor | None]:
        """``(scores, flags, acc or None)`` of one part on ``batch``."""
        if name == MODEL:
            if self.model_scorer is None:
                raise RuntimeError("reward.reward_model.enable=true but no reward-model scorer is attached")
            out = self.model_scorer(batch)
            scores, flags = out if isinstance(out, tuple) else (out, {})
            return scores.detach().float().cpu().reshape(-1), flags, None
        if name == JUDGE:
            scores, flags = self.judge(batch)
            return scores, flags, None
        fn = self.rule_fn if name == RULE else self.extra_fns[name]
        try:
            _, scores, acc = score_batch(batch, tokenizer, fn, keep_extra_info=name == RULE)  # the rule's infos
        except ValueError as e:
            raise ValueError(f"reward part {name!r}: {e}") from e
        return scores, {}, acc if name == RULE else None

    def raw_parts(self, batch: Batch, tokenizer: Any, *, validation: bool = False
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``({part: raw scores (B,), NaN on rows it did not score}, acc (B,))``; each part's flags go into
        ``batch`` (``reward_flags/<part>/<flag>``, NaN on rows it did not score)."""
        sources = [str(s) for s in batch["data_source"]]
        n = len(sources)
        parts, acc = {}, torch.full((n,), math.nan)
        for name in self.parts:
            rows = self._rows(name, sources, validation)
            raw = torch.full((n,), math.nan)
            flags = {flag: torch.full((n,), math.nan) for flag in PART_FLAGS.get(name, ())}
            if rows:
                index = torch.tensor(rows)
                part_batch = batch if len(rows) == n else batch.index(rows)
                scores, part_flags, part_acc = self._score_part(name, part_batch, tokenizer)
                if part_batch is not batch:
                    rows_back(batch, part_batch, rows)
                _finite(name, scores, rows, sources)
                raw[index] = scores.float()
                for flag, values in part_flags.items():
                    flags.setdefault(flag, torch.full((n,), math.nan))[index] = values.float()
                if part_acc is not None:
                    acc[index] = part_acc.float()
            parts[name] = raw
            for flag, values in flags.items():
                batch[f"{FLAG_PREFIX}{name}/{flag}"] = values
        return parts, acc

    def combine(self, parts: Mapping[str, torch.Tensor], data_sources: Sequence[str], *, update_stats: bool,
                normalize: bool = True) -> torch.Tensor:
        """(B,) float32: the weighted sum of the (normalised, clipped) parts over the rows each part weighs.
        ``normalize=False``: the task's units (each part raw; the clip only on parts not normalised)."""
        total = torch.zeros(len(data_sources), dtype=torch.float32)
        clip = self.config.clip
        for name, raw in parts.items():
            weights = torch.tensor([self.weight(name, s) for s in data_sources], dtype=torch.float32)
            scored = ~raw.isnan() & (weights != 0)
            value = raw.float()
            if name in self.stats:
                if update_stats:
                    self.stats[name].update(value[scored])
                if not normalize:
                    total = total + torch.where(scored, weights * value, 0.0)
                    continue
                value = self.stats[name].normalize(value.double()).float()
            if clip is not None:
                value = value.clamp(-clip, clip)
            total = total + torch.where(scored, weights * value, 0.0)
        return total

    def _store(self, batch: Batch, parts: Mapping[str, torch.Tensor]) -> None:
        for name, raw in parts.items():
            batch[PART_PREFIX + name] = raw

    def score(self, batch: Batch, tokenizer: Any, *, update_stats: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like :func:`rlpad.rewards.rules.score_batch`: ``(token_level_scores (B, R), reward (B,), acc (B,))``;
        also stores each part's raw scores in ``batch`` (``reward_parts/<name>``)."""
        parts, acc = self.raw_parts(batch, tokenizer)
        self._store(batch, parts)
        combined = self.combine(parts, [str(s) for s in batch["data_source"]], update_stats=update_stats)
        return place_scores(combined, batch["response_mask"]), combined, acc

    def validate(self, batch: Batch, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reward in the task's units (B,), trained reward (B,))`` of a validation batch (every part it can
        score, stored in ``batch``); the statistics do not move."""
        parts, _ = self.raw_parts(batch, tokenizer, validation=True)
        self._store(batch, parts)
        sources = [str(s) for s in batch["data_source"]]
        return (self.combine(parts, sources, update_stats=False, normalize=False),
                self.combine(parts, sources, update_stats=False))

    def state_dict(self) -> dict[str, dict[str, float]]:
        """``reward.normalize``'s running statistics, per part (what a checkpoint keeps)."""
        return {name: stats.state_dict() for name, stats in self.stats.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, float]]) -> list[str]:
        """Restore :meth:`state_dict`'s statistics; the normalised parts the state lacks start afresh (a warning
        line each, returned)."""
        missing = [name for name in self.stats if name not in state]
        for name, stats in self.stats.items():
            if name in state:
                stats.load_state_dict(state[name])
        return [f"rlpad: warning: the checkpoint holds no running statistics of reward part {name!r} "
                "(reward.normalize): they start afresh from this step" for name in missing]


def reward_state(reward: Any) -> dict[str, Any]:
    """The reward's part of a checkpoint's trainer state (JSON): ``reward.normalize``'s statistics."""
    return reward.state_dict() if isinstance(reward, CombinedReward) else {}


def load_reward_state(reward: Any, state: Mapping[str, Any] | None) -> list[str]:
    """Restore :func:`reward_state` (``None``: a checkpoint written before it was kept); warning lines."""
    return reward.load_state_dict(state or {}) if isinstance(reward, CombinedReward) else []


def parts_of(batch: Batch) -> Batch:
    """The ``reward_parts/*`` and ``reward_flags/*`` tensors of ``batch`` alone (what :func:`part_metrics` reads)."""
    return Batch({k: v for k, v in batch.tensors.items() if k.startswith((PART_PREFIX, FLAG_PREFIX))})


def part_metrics(batches: Batch | Sequence[Batch], prefix: str = "reward/") -> dict[str, float]:
    """``{prefix}<part>/mean`` of every ``reward_parts/<part>`` in ``batches`` (all rows together, those it
    scored), and ``{prefix}<part>/<flag>`` of every ``reward_flags/<part>/<flag>`` (the fraction of those rows
    flagged); a part that scored no row has none."""
    batches = [batches] if isinstance(batches, Batch) else list(batches)
    keys = sorted({k for b in batches for k in b.tensors if k.startswith((PART_PREFIX, FLAG_PREFIX))})
    out = {}
    for k in keys:
        name = f"{k.removeprefix(PART_PREFIX)}/mean" if k.startswith(PART_PREFIX) else k.removeprefix(FLAG_PREFIX)
        values = torch.cat([b[k] for b in batches if k in b]).float()
        values = values[~values.isnan()]
        if values.numel():
            out[f"{prefix}{name}"] = float(values.mean())
    return out


def build_reward(reward: RewardConfig, model_inputs: Callable[[Batch], Any] | None = None,
                 judge: Any = None) -> CombinedReward | RewardFn:
    """The run's reward: the plain reward function (``reward.reward_kwargs`` bound) when it is the only
    part, else a :class:`CombinedReward` (its reward-model part and the ``judge``'s engines, a
    :class:`rlpad.rewards.judge.JudgeScorer`, attached once the workers run: :meth:`CombinedReward.attach_workers`)."""
    rule_fn = load_reward_fn(reward.function_spec)
    if reward.reward_kwargs:
        rule_fn = functools.partial(rule_fn, **reward.reward_kwargs)
    extra = {name: load_function(spec, f"reward.extra_fns.{name}") for name, spec in reward.extra_fns.items()}
    combined = (reward.reward_model.enable or reward.judge.enable or extra or reward.weights or reward.source_weights
                or reward.normalize or reward.clip is not None)
    if not combined:
        return rule_fn
    return CombinedReward(reward, rule_fn, extra, model_inputs=model_inputs, judge=judge,
                          rule_sources=functools.partial(rule_scores_source, reward.function_spec))
