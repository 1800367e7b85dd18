"""Rewards combined, never dropped: every part of a response's reward computed, logged, weighted, summed.

Parts (names from :mod:`rlpad.rewards.settings`): ``rule`` (the reward function, ``reward.fn``),
``reward_model`` (``reward.reward_model``, when enabled), ``judge`` (``reward.judge``, when enabled:
rlpad.rewards.judge) and each ``reward.extra_fns`` function.
Per response, of data source ``s``::

    reward = sum over parts p of  weight(p, s) * clip(normalize_p(score_p))

``weight(p, s)``: ``reward.source_weights[s][p]``, else ``reward.weights[p]``, else 1.
``normalize_p`` (parts in ``reward.normalize``): ``(x - mean) / std`` over every training score of
that part so far (this batch included; validation never moves the statistics); ``clip``: to
``[-reward.clip, reward.clip]`` when set. A part of weight 0 is still computed and logged: turning
on a reward model never hides the rule reward. ``acc`` is the rule part's (rlpad.rewards.rules).

Each part's raw score rides in the batch as ``reward_parts/<name>`` (B,), so the step's metrics
(``reward/<name>/mean``) see the batch the step trains on, after dynamic sampling; a part's per-row 0/1
flags (the judge's ``unparsable``, ...) ride as ``reward_flags/<name>/<flag>`` and are logged as
fractions, ``reward/<name>/<flag>``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.config.rewards import RewardConfig
from rlpad.functions import load_function
from rlpad.rewards.rules import RewardFn, load_reward_fn, place_scores, score_batch
from rlpad.rewards.settings import JUDGE, MODEL, RULE, part_names

__all__ = ["FLAG_PREFIX", "PART_PREFIX", "CombinedReward", "RunningStats", "build_reward", "part_metrics", "parts_of",
           "score_rewards"]

PART_PREFIX = "reward_parts/"  # batch key prefix of each part's raw (B,) scores
FLAG_PREFIX = "reward_flags/"  # batch key prefix of a part's (B,) 0/1 flags: reward_flags/<part>/<flag>

ModelScorer = Callable[[Batch], torch.Tensor]  # a rollout batch -> its reward-model scores (B,)
# a rollout batch -> the judge's scores (B,) and its flags {name: (B,) 0/1} (rlpad.rewards.judge.JudgeScorer)
JudgeFn = Callable[[Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class RunningStats:
    """Mean and standard deviation of every value seen so far (Welford's update, float64)."""

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

    def normalize(self, values: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        return (values - self.mean) / max(self.std, eps)


class CombinedReward:
    """The reward stage's scorer: the rule function, the optional reward model and the extra rule
    functions, combined as the module docstring says. ``model_scorer`` may be attached after the
    workers start (:meth:`attach_model`)."""

    def __init__(self, reward: RewardConfig, rule_fn: RewardFn, extra_fns: Mapping[str, RewardFn] | None = None,
                 model_scorer: ModelScorer | None = None, model_inputs: Callable[[Batch], Batch] | None = None,
                 judge: JudgeFn | None = None):
        self.config = reward
        self.model_inputs = model_inputs  # rollout batch -> what the reward model reads (rlpad.rewards.model_scorer)
        self.rule_fn = rule_fn
        self.extra_fns = dict(extra_fns or {})
        self.model_scorer = model_scorer
        self.uses_model = reward.reward_model.enable
        self.judge = judge  # the judge part (reward.judge.enable); its engines attached with the workers
        if reward.judge.enable and judge is None:
            raise ValueError("reward.judge.enable=true needs the judge (rlpad.rewards.judge.JudgeScorer)")
        self.stats = {name: RunningStats() for name in reward.normalize}

    def attach_model(self, model_scorer: ModelScorer) -> None:
        self.model_scorer = model_scorer

    def attach_workers(self, workers: Any) -> None:
        """Score the reward-model part with ``workers.compute_rm_scores`` (the Ray or the local stack)
        on :attr:`model_inputs` of each batch, and the judge with ``workers.judge_generate`` (its engines)."""
        if self.uses_model:
            self.attach_model(lambda batch: workers.compute_rm_scores(self.model_inputs(batch))["rm_scores"])
        if self.judge is not None:
            self.judge.attach(workers.judge_generate)

    @property
    def parts(self) -> list[str]:
        return part_names(self.config)

    def weight(self, part: str, data_source: str) -> float:
        per_source = self.config.source_weights.get(str(data_source), {})
        return float(per_source.get(part, self.config.weights.get(part, 1.0)))

    def raw_parts(self, batch: Batch, tokenizer: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``({part: raw scores (B,)}, acc (B,))``; the judge's flags go into ``batch`` (``reward_flags/judge/*``)."""
        _, rule, acc = score_batch(batch, tokenizer, self.rule_fn)
        parts = {RULE: rule}
        if self.uses_model:
            if self.model_scorer is None:
                raise RuntimeError("reward.reward_model.enable=true but no reward-model scorer is attached")
            parts[MODEL] = self.model_scorer(batch).detach().float().cpu().reshape(-1)
        if self.judge is not None:
            parts[JUDGE], flags = self.judge(batch)
            for flag, values in flags.items():
                batch[f"{FLAG_PREFIX}{JUDGE}/{flag}"] = values
        for name, fn in self.extra_fns.items():
            parts[name] = score_batch(batch, tokenizer, fn, keep_extra_info=False)[1]  # the rule's infos stay
        return parts, acc

    def combine(self, parts: Mapping[str, torch.Tensor], data_sources: Sequence[str], *,
                update_stats: bool) -> torch.Tensor:
        """(B,) float32: the weighted sum of the (normalised, clipped) parts."""
        total = torch.zeros_like(parts[RULE], dtype=torch.float32)
        clip = self.config.clip
        for name, raw in parts.items():
            value = raw.float()
            if name in self.stats:
                if update_stats:
                    self.stats[name].update(value)
                value = self.stats[name].normalize(value.double()).float()
            if clip is not None:
                value = value.clamp(-clip, clip)
            weights = torch.tensor([self.weight(name, s) for s in data_sources], dtype=torch.float32)
            total = total + weights * value
        return total

    def score(self, batch: Batch, tokenizer: Any, *, update_stats: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like :func:`rlpad.rewards.rules.score_batch`: ``(token_level_scores (B, R), reward (B,), acc (B,))``;
        also stores each part's raw scores in ``batch`` (``reward_parts/<name>``)."""
        parts, acc = self.raw_parts(batch, tokenizer)
        for name, raw in parts.items():
            batch[PART_PREFIX + name] = raw
        combined = self.combine(parts, list(batch["data_source"]), update_stats=update_stats)
        return place_scores(combined, batch["response_mask"]), combined, acc


def score_rewards(batch: Batch, tokenizer: Any, reward: CombinedReward | RewardFn | None, *,
                  update_stats: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reward stage: ``reward``'s :meth:`CombinedReward.score`, or a plain reward function's
    :func:`rlpad.rewards.rules.score_batch` (None: the default function)."""
    if isinstance(reward, CombinedReward):
        return reward.score(batch, tokenizer, update_stats=update_stats)
    return score_batch(batch, tokenizer, reward)


def parts_of(batch: Batch) -> Batch:
    """The ``reward_parts/*`` and ``reward_flags/*`` tensors of ``batch`` alone (what :func:`part_metrics` reads)."""
    return Batch({k: v for k, v in batch.tensors.items() if k.startswith((PART_PREFIX, FLAG_PREFIX))})


def part_metrics(batches: Batch | Sequence[Batch], prefix: str = "reward/") -> dict[str, float]:
    """``{prefix}<part>/mean`` of every ``reward_parts/<part>`` in ``batches`` (all rows together), and
    ``{prefix}<part>/<flag>`` of every ``reward_flags/<part>/<flag>`` (the fraction of rows flagged)."""
    batches = [batches] if isinstance(batches, Batch) else list(batches)
    keys = sorted({k for b in batches for k in b.tensors if k.startswith((PART_PREFIX, FLAG_PREFIX))})
    out = {}
    for k in keys:
        name = f"{k.removeprefix(PART_PREFIX)}/mean" if k.startswith(PART_PREFIX) else k.removeprefix(FLAG_PREFIX)
        out[f"{prefix}{name}"] = float(torch.cat([b[k] for b in batches if k in b]).float().mean())
    return out


def build_reward(reward: RewardConfig, model_inputs: Callable[[Batch], Batch] | None = None,
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
    return CombinedReward(reward, rule_fn, extra, model_inputs=model_inputs, judge=judge)
