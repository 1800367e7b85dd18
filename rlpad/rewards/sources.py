"""The reward against the run's data, checked in set-up (``rlpad.train.prepare``, before any worker
starts): which data sources the rule function scores, and every problem of scoring the data's sources.

- the rule part (``reward.fn``) must score each source it weighs (a nonzero weight): the default function
  (verl's, rlpad.rewards.verl_default) and rlpad's lenient one know their sources; any other function is
  taken to score every source;
- every ``reward.source_weights`` key must be a ``data_source`` of the training or validation data (a typo
  would leave that source's weights at their defaults, silently);
- the lenient function's math sources need math-verify (:func:`rlpad.rewards.rules.reward_source_problems`).
"""

from __future__ import annotations

from collections.abc import Iterable

from rlpad.config.rewards import RewardConfig
from rlpad.rewards import rules, verl_default
from rlpad.code.sources import SCORED_SOURCES
from rlpad.rewards.settings import RULE, part_weight

__all__ = ["LENIENT_FN", "data_source_problems", "rule_scores_source"]

LENIENT_FN = "rlpad.rewards.rules:compute_score"  # rlpad's lenient verifier


def rule_scores_source(spec: str, data_source: str) -> bool:
    """The reward function ``spec`` (``reward.function_spec``) has a reward for ``data_source``: the default
    and the lenient function by their tables; any other function is taken to score every source."""
    if spec == RewardConfig.fn:
        return verl_default.scores_source(data_source)
    if spec == LENIENT_FN:
        return data_source in SCORED_SOURCES or rules._lenient_scorer(data_source) is not None
    return True


def data_source_problems(reward: RewardConfig, data_sources: Iterable[str]) -> list[str]:
    """Every problem of scoring ``data_sources`` (the training and validation data's) with ``reward``, one line
    each naming its key (the module docstring's rules)."""
    sources = sorted({str(s) for s in data_sources})
    spec, problems = reward.function_spec, []
    for key in reward.source_weights:
        if key not in sources:
            problems.append(f"reward.source_weights.{key}: no row of the training or validation data has data_source "
                            f"{key!r} (the data's sources: {', '.join(sources)})")
    weighed = [s for s in sources if part_weight(reward, RULE, s) != 0]
    unknown = [s for s in weighed if not rule_scores_source(spec, s)]
    if unknown:
        problems.append(f"reward.fn={spec} has no reward for data_source {', '.join(map(repr, unknown))}, and the rule "
                        "part weighs it; name a function that scores it (reward.fn=package.module:function or "
                        "reward.custom_reward_function.path), or give the rule weight 0 there (reward.weights.rule=0 "
                        "or reward.source_weights.<source>.rule=0: a reward-model-only data set)")
    return problems + rules.reward_source_problems(spec, [s for s in sources if rule_scores_source(spec, s)])
