"""The reward stage: which rule scores each row of a rollout batch.

Three rules meet here, each written once: rows an environment ran take its per-turn rewards and the reward
function is never called on them (:func:`_env_rule`); stateful tools' rewards reach the reward function
through ``extra_info``, verl's rule (:func:`_tool_reward_rule`); every other row is scored by the combined
reward (:class:`rlpad.rewards.combine.CombinedReward`) or a plain reward function
(:func:`rlpad.rewards.rules.score_batch`). :func:`score_rewards` is training's stage,
:func:`validation_scores` validation's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.rewards.combine import FLAG_PREFIX, PART_PREFIX, CombinedReward, rows_back
from rlpad.rewards.rules import RewardFn, score_batch
from rlpad.rollout.stateful_tools import TOOL_REWARD_SCORES, TOOL_STEP_REWARDS

__all__ = ["ENV_ROWS", "ENV_SCORES", "score_rewards", "validation_scores"]

ENV_SCORES, ENV_ROWS = "env_scores", "env_rows"  # the rollout's environment rewards (rlpad.rollout.agent.turn_scores)


def _tool_reward_rule(batch: Batch) -> None:
    """Stateful tools' rewards reach the reward function, verl's rule: each row's ``extra_info`` gets
    ``rollout_reward_scores`` (``{tool name: calc_reward}``, the rollout's ``reward_scores`` column) and
    ``tool_rewards`` (each call's step reward, in order), and the function's score is the row's score: rlpad
    adds nothing itself (a function that wants the tools' rewards in the score adds them). A batch without
    stateful tools is left as it is."""
    if TOOL_REWARD_SCORES not in batch:
        return
    infos = batch["extra_info"] if "extra_info" in batch else [None] * len(batch)
    batch["extra_info"] = [{**(info if isinstance(info, dict) else {}), "rollout_reward_scores": dict(scores),
                            "tool_rewards": list(steps)}
                           for info, scores, steps in zip(infos, batch[TOOL_REWARD_SCORES], batch[TOOL_STEP_REWARDS])]


def score_rewards(batch: Batch, tokenizer: Any, reward: CombinedReward | RewardFn | None, *,
                  update_stats: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reward stage: ``reward``'s :meth:`CombinedReward.score`, or a plain reward function's
    :func:`rlpad.rewards.rules.score_batch` (None: the default function). The rows an environment ran
    (``env_rows``) take the environment's rewards instead, the one rule (:func:`_env_rule`); stateful tools'
    rewards reach the function through ``extra_info`` (:func:`_tool_reward_rule`)."""
    _tool_reward_rule(batch)

    def score(rows: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isinstance(reward, CombinedReward):
            return reward.score(rows, tokenizer, update_stats=update_stats)
        return score_batch(rows, tokenizer, reward)
    return _env_rule(batch, score)


def _env_rule(batch: Batch, score: Callable[[Batch], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The environment wins: a row an environment ran (``env_rows``) is scored by its per-turn rewards alone
    (token-level: each on its turn's last generated token, ``env_scores``; sequence score and acc: their
    sum), and the reward function is never called on it; the other rows by ``score`` (a sub-batch of them).
    ``score``'s outputs are ``(token-level (B, R), ...(B,))``; a batch without environments: ``score(batch)``."""
    if ENV_ROWS not in batch or not bool(batch[ENV_ROWS].any()):  # no row an environment ran: as without one
        return score(batch)
    rows, env = batch[ENV_ROWS].bool(), batch[ENV_SCORES].float()
    seq = env.sum(-1)
    others = (~rows).nonzero().flatten()
    if len(others):
        sub = batch.index(others)
        scored = score(sub)
        # the other rows' reward infos, flags and parts as a batch without environments has them (the
        # environment's rows: {} and NaN, not scored)
        rows_back(batch, sub, others.tolist(), keys=(FLAG_PREFIX, PART_PREFIX), replace=True)
        out = [torch.zeros_like(env) if s.dim() == 2 else seq.clone() for s in scored]
        for o, s in zip(out, scored):
            o[others] = s.to(o.dtype)
    else:
        out = [env.clone(), seq, seq.clone()]
    out[0][rows] = env[rows]
    for o in out[1:]:
        o[rows] = seq[rows]
    return tuple(out)


def validation_scores(batch: Batch, tokenizer: Any, reward: CombinedReward | RewardFn | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A validation batch's per-row rewards: ``(in the task's own units (B,), the trained reward (B,) or None)``.
    The first is what validation reports (``val/reward``): every part raw, weighted (the module docstring);
    the second only where it differs, with ``reward.normalize`` set. Finite, or ValueError naming the part.
    Rows an environment ran: the sum of its rewards (:func:`_env_rule`); stateful tools' rewards as in
    :func:`score_rewards`."""
    def score(rows: Batch) -> tuple[torch.Tensor, ...]:
        if isinstance(reward, CombinedReward):
            task, trained = reward.validate(rows, tokenizer)
            return (task, trained) if reward.stats else (task,)
        return (score_batch(rows, tokenizer, reward)[1],)

    def with_token_level(rows: Batch) -> tuple[torch.Tensor, ...]:  # _env_rule's shape: token-level first
        return (torch.zeros(len(rows), 1), *score(rows))

    _tool_reward_rule(batch)

    got = score(batch) if ENV_ROWS not in batch else _env_rule(batch, with_token_level)[1:]
    return got[0], (got[1] if isinstance(reward, CombinedReward) and reward.stats else None)
