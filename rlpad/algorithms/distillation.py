"""On-policy distillation's losses on ``(B, R)`` response tensors (verl's ``distillation.distillation_loss``).

Per token (the student ``s``, the teacher ``t``, both log-probs):

* sampled-token modes (``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``): verl's KL
  estimators of KL(student || teacher) at the sampled token, :func:`rlpad.algorithms.losses.kl_penalty`
  with ``log_prob = s``, ``ref_log_prob = t``;
* ``forward_kl_topk``: KL(teacher || student) over the teacher's top-k ids plus ONE TAIL BUCKET, the
  mass outside them as one more outcome: ``sum_k p_k (log p_k - log q_k) + p_tail (log p_tail - log
  q_tail)`` with ``p_tail = 1 - sum_k p_k`` (likewise q). This is the exact KL between the two
  distributions coarsened to k + 1 outcomes: >= 0 and finite, so verl's ``clamp_min(0)`` (its
  truncated sum goes negative) is not needed. The tail's log is floored at the dtype's epsilon only
  where the top-k mass rounds to 1 (``tail_floor_frac`` counts those tokens).

``loss_max_clamp`` clamps each token's loss to ``[-c, c]`` (verl's); ``log_prob_min_clamp`` clamps the
top-k log-probs of ``forward_kl_topk`` from below (verl's; the tail stays unclamped). Then
:func:`distillation_loss`: with ``use_policy_gradient`` the advantage is ``-loss`` (detached) in a vanilla
PPO term against the old log-probs (Thinking Machines' reverse-KL reward with k1: ``A = -(s - t)``
per token); without it the loss is aggregated and back-propagated (supervised). :func:`combine` mixes it
with the task's policy loss (``use_task_rewards``, ``distillation_loss_coef``), as verl.
"""

from __future__ import annotations

import math

import torch

from rlpad.algorithms.losses import Normalizer, agg_loss, check_tensors, compute_policy_loss, kl_penalty, token_stat
from rlpad.config.choices import SAMPLED_TOKEN_MODES, TOPK_MODES
from rlpad.config.distillation import DistillationLossConfig

__all__ = ["combine", "distillation_loss", "distillation_metrics", "log1mexp", "per_token_losses", "topk_forward_kl"]


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, stable at both ends (Maechler's switch at -log 2)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_forward_kl(
    teacher_topk_log_probs: torch.Tensor, student_topk_log_probs: torch.Tensor, log_prob_min_clamp: float | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token KL(teacher || student) over the top-k ids + the tail bucket: ``(B, R)``, and per-token
    stats ``(B, R)``: ``teacher_mass`` / ``student_mass`` (top-k mass), ``tail_floored`` (1 where a tail
    hit the epsilon floor), ``log_prob_clamped`` (fraction of the k entries ``log_prob_min_clamp`` bound)."""
    t, s = teacher_topk_log_probs, student_topk_log_probs
    if t.shape != s.shape or t.dim() != 3:
        raise ValueError(f"teacher and student top-k log-probs must both be (B, R, k), got {tuple(t.shape)} and "
                         f"{tuple(s.shape)}")
    eps = torch.finfo(s.dtype).eps
    t_mass, s_mass = t.logsumexp(-1), s.logsumexp(-1)
    floored = (t_mass > -eps) | (s_mass > -eps)
    t_tail, s_tail = log1mexp(t_mass.clamp(max=-eps)), log1mexp(s_mass.clamp(max=-eps))
    clamped = torch.zeros_like(t)
    if log_prob_min_clamp is not None:
        clamped = ((t < log_prob_min_clamp) | (s < log_prob_min_clamp)).to(t.dtype)
        t, s = t.clamp_min(log_prob_min_clamp), s.clamp_min(log_prob_min_clamp)
    kl = (t.exp() * (t - s)).sum(-1) + t_tail.exp() * (t_tail - s_tail)
    stats = {"teacher_mass": t_mass.exp().detach(), "student_mass": s_mass.exp().detach(),
             "tail_floored": floored.to(t.dtype), "log_prob_clamped": clamped.mean(-1)}
    return kl, stats


def per_token_losses(
    config: DistillationLossConfig,
    *,
    student_log_probs: torch.Tensor | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    student_topk_log_probs: torch.Tensor | None = None,
    teacher_topk_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(losses (B, R) after loss_max_clamp, stats)``: stats hold ``kl`` (the loss before the clamp),
    ``loss_clamped`` (1 where the clamp bound) and, for ``forward_kl_topk``, :func:`topk_forward_kl`'s."""
    mode = config.loss_mode
    if mode in SAMPLED_TOKEN_MODES:
        if student_log_probs is None or teacher_log_probs is None:
            raise ValueError(f"loss_mode={mode!r} needs the student's and the teacher's log-probs of the sampled tokens")
        kl, stats = kl_penalty(student_log_probs, teacher_log_probs, mode), {}
    elif mode in TOPK_MODES:
        if student_topk_log_probs is None or teacher_topk_log_probs is None:
            raise ValueError(f"loss_mode={mode!r} needs the teacher's top-k log-probs and the student's at those ids")
        kl, stats = topk_forward_kl(teacher_topk_log_probs, student_topk_log_probs, config.log_prob_min_clamp)
    else:
        raise ValueError(f"distillation.distillation_loss.loss_mode={mode!r} is not one of "
                         f"{SAMPLED_TOKEN_MODES + TOPK_MODES}")
    stats["kl"] = kl.detach()
    c = config.loss_max_clamp
    if c is None:
        stats["loss_clamped"] = torch.zeros_like(stats["kl"])
        return kl, stats
    stats["loss_clamped"] = (kl.detach().abs() > c).to(kl.dtype)
    return kl.clamp(-c, c), stats


def distillation_loss(
    config: DistillationLossConfig,
    losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    log_prob: torch.Tensor | None = None,
    old_log_prob: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_tokens: Normalizer = None,
    global_seqs: Normalizer = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The piece's distillation loss (a share, with the global normalisers) and its policy-gradient
    metrics: with ``use_policy_gradient`` a vanilla PPO term with advantages ``-losses`` (detached) on
    ``log_prob`` against ``old_log_prob``; else ``agg_loss(losses)``."""
    norms = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    if not config.use_policy_gradient:
        return agg_loss(losses, response_mask, loss_agg_mode, **norms), {}
    if log_prob is None or old_log_prob is None:
        raise ValueError("use_policy_gradient needs the student's current and old log-probs")
    check_tensors(losses=losses, log_prob=log_prob)
    low, high = (config.clip_ratio if c is None else c for c in (config.clip_ratio_low, config.clip_ratio_high))
    loss, metrics = compute_policy_loss(
        old_log_prob, log_prob, -losses.detach(), response_mask, low, high,
        loss_agg_mode=loss_agg_mode, rollout_is_weights=rollout_is_weights, **norms,
    )  # fmt: skip
    return loss, {f"pg_{k.removeprefix('pg_')}": v for k, v in metrics.items() if k in ("pg_clipfrac", "ppo_kl")}


def distillation_metrics(stats: dict[str, torch.Tensor], response_mask: torch.Tensor,
                         global_tokens: Normalizer = None) -> dict[str, torch.Tensor]:
    """Token-mean shares (``global_tokens``) of the per-token stats, and ``kl_max`` (a maximum)."""
    mask = response_mask.bool()
    out = {"kl_mean": token_stat(stats["kl"], response_mask, global_tokens),
           "kl_max": torch.where(mask, stats["kl"], -torch.inf).amax() if mask.any() else stats["kl"].new_zeros(()),
           "loss_clamp_frac": token_stat(stats["loss_clamped"], response_mask, global_tokens)}
    names = {"teacher_mass": "teacher_topk_mass", "student_mass": "student_topk_mass",
             "tail_floored": "tail_floor_frac", "log_prob_clamped": "log_prob_clamp_frac"}
    out.update({new: token_stat(stats[old], response_mask, global_tokens) for old, new in names.items() if old in stats})
    return out


def combine(config: DistillationLossConfig, task_loss: torch.Tensor, distill_loss: torch.Tensor) -> torch.Tensor:
    """verl's mix: ``task + distillation_loss_coef * distill`` with ``use_task_rewards``, else ``distill``."""
    if config.use_task_rewards:
        return task_loss + config.distillation_loss_coef * distill_loss
    return distill_loss
