"""Rollout vs training log-probs: measure the mismatch and correct the policy gradient for it.

vLLM samples a response with its own kernels and reports ``rollout_log_probs`` (the log-prob of
each sampled token under the distribution it was sampled from); the FSDP actor recomputes the same
tokens as ``old_log_probs`` with other kernels. Where the two differ, "on-policy" PPO/GRPO is
slightly off-policy: the tokens were drawn from pi_rollout, the loss treats them as drawn from
pi_old.

Sign convention, used everywhere in this module: per valid response token

    d = old_log_probs - rollout_log_probs = log(pi_old(y_t) / pi_rollout(y_t))

so ``exp(d)`` is the importance weight pi_old / pi_rollout that moves an expectation over the
rollout's samples to one over the actor's distribution (> 1: the actor likes the token more than
the sampler did).

* :func:`log_prob_mismatch` measures it: mean and max of ``|d|``, the k3 estimate of
  KL(pi_rollout || pi_old) = mean of ``exp(d) - 1 - d`` (Schulman's k3 with r = pi_old/pi_rollout;
  unbiased for that direction because the tokens are sampled from pi_rollout, and >= 0 per token),
  and the Pearson correlation of the two log-prob vectors.
* ``token_tis`` (truncated importance sampling; verl ``rollout_is: token``): each token's
  policy-gradient term is multiplied by ``min(exp(d), C)``, detached (a weight, not a gradient path).
* ``seq_mask`` (verl ``rollout_rs: geometric``, OpenRLHF's sequence gate): a sequence whose
  geometric-mean ratio ``exp(mean_t d)`` leaves ``[1/C, C]`` is dropped from the actor loss
  (its tokens leave the loss mask, so they leave the token/sequence normalisers too).

``d`` is clamped to [-20, 20] before ``exp`` (as verl does), so a wild token cannot overflow.
Pure torch, no Ray; every function raises ValueError/TypeError on bad input before computing.
"""

from __future__ import annotations

from numbers import Real

import torch

from rlpad.config import ROLLOUT_CORRECTION_MODES

__all__ = [
    "CORRECTION_MODES",
    "apply_rollout_correction",
    "log_prob_mismatch",
    "seq_mask",
    "token_tis_weights",
]

CORRECTION_MODES = ROLLOUT_CORRECTION_MODES
SAFETY_BOUND = 20.0


def _check(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Shapes, dtypes and finiteness on valid tokens; returns the mask as bool."""
    for name, x in (("old_log_probs", old_log_probs), ("rollout_log_probs", rollout_log_probs),
                    ("response_mask", response_mask)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D (batch, response_length), got shape {tuple(x.shape)}")
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"mismatched shapes: old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs "
            f"{tuple(rollout_log_probs.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    for name, x in (("old_log_probs", old_log_probs), ("rollout_log_probs", rollout_log_probs)):
        bad = mask & ~torch.isfinite(x)
        if bool(bad.any()):
            rows = bad.any(dim=1).nonzero().flatten().tolist()
            raise ValueError(f"{name} contains NaN or inf on valid response tokens (rows {rows[:8]})")
    return mask


def _check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, Real):
        raise TypeError(f"rollout correction threshold must be a number, got {type(threshold).__name__}")
    if not threshold > 1.0:
        raise ValueError(f"rollout correction threshold must be > 1 (the cap C; seq_mask keeps [1/C, C]), got {threshold}")
    return float(threshold)


def _log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``d = old - rollout`` in float64, 0 on padding (NaN/inf there never propagate)."""
    d = old_log_probs.double() - rollout_log_probs.double()
    return torch.where(mask, d, 0.0)


@torch.no_grad()
def log_prob_mismatch(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Mismatch over valid response tokens (float64); see the module docstring for ``d``.

    Returns ``abs_diff_mean``, ``abs_diff_max`` (of ``|d|``), ``k3_kl`` (mean of
    ``exp(d) - 1 - d``, an estimate of KL(pi_rollout || pi_old) per token), ``pearson`` (correlation
    of old and rollout log-probs over the tokens; 1.0 if both are constant and equal, 0.0 if one
    is constant and they differ) and ``tokens`` (how many were compared). No valid token: all 0.
    """
    mask = _check(old_log_probs, rollout_log_probs, response_mask)
    n = int(mask.sum())
    if n == 0:
        return {"abs_diff_mean": 0.0, "abs_diff_max": 0.0, "k3_kl": 0.0, "pearson": 0.0, "tokens": 0.0}
    d = _log_ratio(old_log_probs, rollout_log_probs, mask)[mask]
    clamped = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k3 = torch.expm1(clamped) - clamped
    x, y = old_log_probs.double()[mask], rollout_log_probs.double()[mask]
    xc, yc = x - x.mean(), y - y.mean()
    denom = float(torch.sqrt((xc * xc).sum() * (yc * yc).sum()))
    if denom > 0:
        pearson = float((xc * yc).sum()) / denom
    else:
        pearson = 1.0 if bool(torch.equal(x, y)) else 0.0
    return {"abs_diff_mean": float(d.abs().mean()), "abs_diff_max": float(d.abs().max()),
            "k3_kl": float(k3.mean()), "pearson": pearson, "tokens": float(n)}


@torch.no_grad()
def token_tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated per-token importance weights ``min(exp(d), C)`` (B, R), 0 on padding, detached.

    Metrics: ``clipped_token_frac`` (valid tokens whose ``exp(d)`` exceeded C), ``weight_mean``
    (mean weight after truncation over valid tokens).
    """
    mask = _check(old_log_probs, rollout_log_probs, response_mask)
    cap = _check_threshold(threshold)
    d = _log_ratio(old_log_probs, rollout_log_probs, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    raw = torch.exp(d)
    weights = torch.where(mask, raw.clamp(max=cap), 0.0)
    n = max(int(mask.sum()), 1)
    metrics = {"clipped_token_frac": float(((raw > cap) & mask).sum()) / n,
               "weight_mean": float(weights.sum()) / n}
    return weights.to(old_log_probs.dtype), metrics


@torch.no_grad()
def seq_mask(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` with the sequences whose ``exp(mean_t d)`` leaves ``[1/C, C]`` zeroed.

    Rows without a valid token are left as they are (nothing to drop). Metrics:
    ``masked_seq_frac`` (of rows with a valid token), ``masked_token_frac`` (of valid tokens),
    ``weight_mean`` (mean 0/1 weight over valid tokens = 1 - masked_token_frac) and
    ``seq_ratio_min`` / ``seq_ratio_max`` (the geometric-mean ratios seen).
    """
    mask = _check(old_log_probs, rollout_log_probs, response_mask)
    cap = _check_threshold(threshold)
    d = _log_ratio(old_log_probs, rollout_log_probs, mask)
    counts = mask.sum(dim=1)
    has_tokens = counts > 0
    mean_d = d.sum(dim=1) / counts.clamp(min=1)
    ratio = torch.exp(mean_d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    drop = has_tokens & ((ratio < 1.0 / cap) | (ratio > cap))
    new_mask = response_mask * (~drop).unsqueeze(1).to(response_mask.dtype)
    n_tok, n_seq = max(int(counts.sum()), 1), max(int(has_tokens.sum()), 1)
    masked_tokens = float(counts[drop].sum())
    seen = ratio[has_tokens]
    metrics = {
        "masked_seq_frac": float(drop.sum()) / n_seq,
        "masked_token_frac": masked_tokens / n_tok,
        "weight_mean": 1.0 - masked_tokens / n_tok,
        "seq_ratio_min": float(seen.min()) if seen.numel() else 1.0,
        "seq_ratio_max": float(seen.max()) if seen.numel() else 1.0,
    }
    return new_mask, metrics


def apply_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    threshold: float,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """``(weights or None, loss mask, metrics)`` for ``mode`` in :data:`CORRECTION_MODES`.

    ``none``: no weights, the mask unchanged, no metrics. ``token_tis``: the truncated weights,
    the mask unchanged. ``seq_mask``: no weights, the mask with out-of-band sequences dropped.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r}; expected one of {CORRECTION_MODES}")
    if mode == "none":
        _check(old_log_probs, rollout_log_probs, response_mask)
        return None, response_mask, {}
    if mode == "token_tis":
        weights, metrics = token_tis_weights(old_log_probs, rollout_log_probs, response_mask, threshold)
        return weights, response_mask, metrics
    new_mask, metrics = seq_mask(old_log_probs, rollout_log_probs, response_mask, threshold)
    return None, new_mask, metrics
