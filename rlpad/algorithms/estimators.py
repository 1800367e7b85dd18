"""The math of the advantage estimators that :mod:`rlpad.algorithms.advantages` registers: GRPO and GAE.

Inputs are ``(B, R)`` response tensors; the numbers match verl's ``core_algos`` (see
:mod:`rlpad.algorithms.losses` for the shared conventions and the checks).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from numbers import Real

import numpy as np
import torch

from rlpad.algorithms.losses import check_finite, check_tensors, masked_whiten

__all__ = ["compute_gae_advantages", "compute_grpo_advantages"]


def _group_rows(group_ids: Sequence[Hashable] | np.ndarray | torch.Tensor, n: int) -> dict[Hashable, list[int]]:
    if isinstance(group_ids, (np.ndarray, torch.Tensor)):
        group_ids = group_ids.tolist()
    if isinstance(group_ids, (str, bytes)) or not isinstance(group_ids, Sequence):
        raise TypeError(f"group_ids must be a list, numpy array or tensor of ids, got {type(group_ids).__name__}")
    if len(group_ids) != n:
        raise ValueError(f"mismatched row counts: group_ids has {len(group_ids)} entries, token_level_rewards {n}")
    groups: dict[Hashable, list[int]] = {}
    for row, gid in enumerate(group_ids):
        if not isinstance(gid, Hashable):
            raise TypeError(f"group id of row {row} is not hashable: {gid!r}")
        groups.setdefault(gid, []).append(row)
    return groups


@torch.no_grad()
def compute_grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[Hashable] | np.ndarray | torch.Tensor,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    expected_group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages ``(B, R)``, returned twice as ``(advantages, returns)``.

    Score of a row = sum of its token rewards. Per group (rows sharing an id): mean and
    unbiased std (``torch.std``); a group of one has mean 0 and std 1. Advantage =
    ``(score - mean) / (std + epsilon)``, or ``score - mean`` with ``norm_adv_by_std=False``
    (Dr.GRPO), broadcast over ``response_mask``. ``expected_group_size`` (e.g. rollout.n):
    raise ``ValueError`` naming any group of another size.
    """
    check_tensors(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards)
    groups = _group_rows(group_ids, token_level_rewards.shape[0])
    if expected_group_size is not None:
        for gid, rows in groups.items():
            if len(rows) != expected_group_size:
                raise ValueError(
                    f"group {gid!r} has {len(rows)} rows, expected {expected_group_size} (rows {rows[:8]})"
                )
    scores = token_level_rewards.sum(dim=-1)
    adv = torch.empty_like(scores)
    for rows in groups.values():
        idx = torch.tensor(rows, device=scores.device)
        s = scores[idx]
        if len(rows) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = torch.mean(s), torch.std(s)
        adv[idx] = (s - mean) / (std + epsilon) if norm_adv_by_std else s - mean
    advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


@torch.no_grad()
def compute_gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the response tokens: ``(whitened advantages, returns)``, both ``(B, R)``.

    Backwards over t: ``delta = r_t + gamma * V_next - V_t``, ``A_t = delta + gamma * lam *
    A_next``; masked-out positions (padding, tool output inside a multi-turn response) are skipped:
    they carry ``V_next`` and ``A_next`` through and are 0 in both outputs.
    ``returns = A + values`` (raw A); the advantages are then whitened over the mask.
    """
    check_tensors(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if isinstance(x, bool) or not isinstance(x, (Real, torch.Tensor)):
            raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    check_finite("token_level_rewards", token_level_rewards)
    check_finite("values", values)
    mask = response_mask.to(values.dtype)
    next_value, last_adv = 0, 0
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        m = mask[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last_adv = adv_t * m + (1 - m) * last_adv
        reversed_adv.append(last_adv)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    # Masked-out positions (padding, multi-turn tool output) are exactly 0 in both outputs.
    returns = (advantages + values) * mask
    return masked_whiten(advantages, response_mask) * mask, returns
