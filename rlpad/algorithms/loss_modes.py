"""The policy-loss modes' math (registered by name in :mod:`rlpad.algorithms.policy_loss`).

Each function takes ``(old_log_prob, log_prob, advantages, response_mask)``, all ``(B, R)``,
the actor's config section (clip ratios, ``loss_agg_mode``, ``policy_loss.*``) and the keywords of
:func:`rlpad.algorithms.losses.compute_policy_loss` (global normalisers, ``rollout_is_weights``), and returns
``(loss share, metric shares)``. For the same inputs the losses equal verl 0.9.1's
``compute_policy_loss_<mode>`` (tests/test_loss_modes.py, fp64). Deliberate differences: bad input
raises; masked-out NaN never reaches the loss; the normalisers are the mini-batch's (see
:mod:`rlpad.algorithms.losses`); ``geo_mean`` averages over the sequences with a valid token (verl: every row of
the micro-batch, the same where no row is fully masked); ``clip_cov`` draws its random choice from
``generator`` (verl: the global RNG); every mode reports the same metrics (``ppo_kl`` is the signed
mean log-ratio for every mode; verl's kl_cov reports its absolute value).

``clip_cov`` and ``kl_cov`` select tokens by a covariance over the tokens of the piece they are
given (a micro-batch, as in verl): unlike the other modes, their gradient depends on how the
mini-batch is split into micro-batches and ranks.
"""

from __future__ import annotations

import torch

from rlpad.algorithms.losses import (
    Normalizer, agg_loss, check_policy_inputs, compute_policy_loss, masked_abs_max, masked_mean, masked_sum, token_stat,
)
from rlpad.algorithms.policy_loss import parse_is_threshold
from rlpad.config.schema import ActorConfig

__all__ = [
    "bypass_mode_loss", "cispo_loss", "clip_cov_loss", "dppo_kl_loss", "dppo_tv_loss", "dro_loss", "geo_mean_loss",
    "gpg_loss", "gspo_loss", "kl_cov_loss", "sapo_loss", "vanilla_loss",
]

Out = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _bounds(actor: ActorConfig) -> tuple[float, float]:
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    return low, high


def _metrics(log_ratio: torch.Tensor, mask: torch.Tensor, global_tokens: Normalizer,
             clipped: torch.Tensor, clipped_lower: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The metric shares every mode reports (``log_ratio`` = log_prob - old_log_prob, unclamped)."""
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    return {
        "pg_clipfrac": token_stat(clipped.float(), mask, global_tokens),
        "pg_clipfrac_lower": zero if clipped_lower is None else token_stat(clipped_lower.float(), mask, global_tokens),
        "ppo_kl": token_stat(-log_ratio.detach(), mask, global_tokens),
        "log_ratio_abs_max": masked_abs_max(log_ratio.detach(), mask),
    }


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights.detach()


def vanilla_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
                 global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
                 rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """PPO clip with dual clip: :func:`rlpad.algorithms.losses.compute_policy_loss`."""
    low, high = _bounds(actor)
    return compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, low, high, actor.clip_ratio_c,
                               actor.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                               loss_scale_factor=loss_scale_factor, rollout_is_weights=rollout_is_weights)


def gspo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
              global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
              rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """GSPO: ``s_i = exp(mean_t log-ratio)`` per sequence; token ratio ``sg(s_i) * p / sg(p)`` (log
    clamped at 10), PPO-clipped, aggregated by ``loss_agg_mode`` (as verl; the paper's is seq-mean-token-mean)."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = _bounds(actor)
    log_ratio = log_prob - old_log_prob
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / lengths
    log_s = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    loss1, loss2 = -advantages * s, -advantages * torch.clamp(s, 1 - low, 1 + high)
    pg_losses = _weighted(torch.maximum(loss1, loss2), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return loss, _metrics(log_ratio, response_mask, global_tokens, torch.gt(loss2, loss1), None)


def cispo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
               global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
               rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """CISPO: ``-sg(clamp(ratio, 1 - low, 1 + high)) * A * log_prob`` per token (log-ratio clamped to
    [-20, 20]); no token loses its gradient."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = _bounds(actor)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = _weighted(-clipped.detach() * advantages * log_prob, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return loss, _metrics(log_ratio, response_mask, global_tokens, torch.ne(ratio, clipped), None)


def geo_mean_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
                  global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
                  rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """GMPO: per sequence ``-mean_t(A) * exp(mean_t clip(log-ratio))`` (the clip in the advantage's
    direction, to [-low, high]); rollout weights enter as their per-sequence geometric mean. Mean
    over the sequences with a valid token (``global_seqs``)."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = _bounds(actor)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    log_ratio_min = sign * torch.min(sign * log_ratio, sign * clamped)
    tokens = response_mask.sum(dim=-1)
    ratio = torch.exp(masked_sum(log_ratio_min, response_mask, dim=-1) / (tokens + 1e-8))
    advantage = masked_sum(advantages, response_mask, dim=-1) / (tokens + 1e-8)
    row_losses = -advantage * ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        row_losses = row_losses * torch.exp(masked_sum(log_w, response_mask, dim=-1) / (tokens + 1e-8))
    valid_rows = tokens > 0
    denom = valid_rows.sum().clamp(min=1) if global_seqs is None else global_seqs
    loss = masked_sum(row_losses, valid_rows) / denom
    clipped = torch.ne(log_ratio, clamped)
    return loss, _metrics(log_ratio, response_mask, global_tokens, clipped & (advantages > 0),
                          clipped & (advantages < 0))


def clip_cov_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
                  global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
                  rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """Clip-Cov: PPO clip (no dual clip, no ratio clamp); of the unclipped valid tokens whose
    ``(A - mean A)(log_prob - mean log_prob)`` lies in (clip_cov_lb, clip_cov_ub), a random
    ``max(1, int(clip_cov_ratio * tokens))`` get no gradient (``generator`` draws them)."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = _bounds(actor)
    pl = actor.policy_loss
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss1, loss2 = -advantages * ratio, -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    valid = response_mask > 0
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob.detach(), response_mask))
        cov = torch.where(valid & ~(loss2 > loss1), cov, -torch.inf)
        count = max(int(pl.clip_cov_ratio * response_mask.sum().item()), 1)
        candidates = torch.nonzero((cov < pl.clip_cov_ub) & (cov > pl.clip_cov_lb) & valid)
        keep = torch.ones_like(advantages)
        if len(candidates):
            perm = torch.randperm(len(candidates), generator=generator)
            chosen = candidates[perm[: min(count, len(candidates))].to(candidates.device)]
            keep[chosen[:, 0], chosen[:, 1]] = 0
    pg_losses = _weighted(torch.maximum(loss1, loss2) * keep, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return loss, _metrics(log_ratio, response_mask, global_tokens, keep == 0, None)


def kl_cov_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
                global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
                rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """KL-Cov: ``-A * ratio`` (unclipped); the ``max(1, int(tokens * kl_cov_ratio))`` valid tokens of
    highest covariance ``(A - mean A)(log_prob - mean log_prob)`` add ``ppo_kl_coef * |log-ratio|``."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    pl = actor.policy_loss
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss_kl = loss1 + pl.ppo_kl_coef * log_ratio.abs()
    valid = response_mask > 0
    chosen = torch.zeros_like(valid)
    with torch.no_grad():
        flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        if len(flat):
            adv, lp = advantages[valid].reshape(-1).cpu(), log_prob.detach()[valid].reshape(-1).cpu()
            cov = (adv - adv.mean()) * (lp - lp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * pl.kl_cov_ratio)), largest=True).indices
            chosen.view(-1)[flat[top.to(flat.device)]] = True
    pg_losses = _weighted(torch.where(chosen, loss_kl, loss1), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return loss, _metrics(log_ratio, response_mask, global_tokens, chosen, None)


def _dppo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
          actor: ActorConfig, kept: torch.Tensor, global_tokens: Normalizer, global_seqs: Normalizer,
          loss_scale_factor: float | None, rollout_is_weights: torch.Tensor | None) -> Out:
    """DPPO's loss given its trust-region mask ``kept`` (B, R): ``-A * sg(min(ratio, clip_ratio_c)) * log_prob``
    on the kept tokens (truncated IS instead of a clip); pg_clipfrac: tokens dropped, pg_clipfrac_lower:
    kept tokens whose ratio was truncated."""
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    truncated = torch.clamp(ratio, max=actor.clip_ratio_c).detach()
    kept = kept.detach().to(log_prob.dtype)
    pg_losses = _weighted(-advantages * truncated * log_prob * kept, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return loss, _metrics(log_ratio, response_mask, global_tokens, kept == 0, (ratio > actor.clip_ratio_c) & (kept > 0))


def dppo_tv_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
                 global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
                 rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """DPPO-Binary-TV: a token keeps its gradient while ``p - p_old <= clip_ratio_high`` (A > 0) or
    ``p - p_old >= -clip_ratio_low`` (A <= 0), probabilities not ratios; see :func:`_dppo`."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = _bounds(actor)
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    kept = torch.where(advantages > 0, change <= high, change >= -low)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, actor, kept, global_tokens, global_seqs,
                 loss_scale_factor, rollout_is_weights)


def dppo_kl_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
                 global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
                 rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """DPPO-Binary-KL: the binary KL ``p_old log(p_old/p) + (1-p_old) log((1-p_old+1e-8)/(1-p+1e-8))``
    must stay <= clip_ratio_high for a token moving up with A > 0 (<= clip_ratio_low moving down with
    A <= 0); a token moving the other way always keeps its gradient; see :func:`_dppo`."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = _bounds(actor)
    p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    kept = torch.where(advantages > 0, (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old))
    return _dppo(old_log_prob, log_prob, advantages, response_mask, actor, kept, global_tokens, global_seqs,
                 loss_scale_factor, rollout_is_weights)


def sapo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
              global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
              rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """SAPO: a soft gate instead of a clip, ``-A * sigmoid(tau (ratio - 1)) * 4 / tau`` with tau = tau_pos
    where A > 0, else tau_neg (log-ratio clamped to [-20, 20]); always seq-mean-token-mean (as verl)."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    tau = torch.where(advantages > 0, torch.as_tensor(actor.tau_pos, dtype=advantages.dtype, device=advantages.device),
                      torch.as_tensor(actor.tau_neg, dtype=advantages.dtype, device=advantages.device))
    pg_losses = _weighted(-torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return loss, _metrics(log_ratio, response_mask, global_tokens, torch.zeros_like(response_mask, dtype=torch.bool),
                          None)


def gpg_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
             response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
             global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
             rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """GPG: plain policy gradient ``-A * log_prob`` (no ratio, no clip)."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    pg_losses = _weighted(-log_prob * advantages, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    none = torch.zeros_like(response_mask, dtype=torch.bool)
    return loss, _metrics(log_prob - old_log_prob, response_mask, global_tokens, none, None)


def dro_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
             response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
             global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
             rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """DRO: ``-(A * log_prob - dro_beta / 2 * (log_prob - old_log_prob)^2)`` (a quadratic trust region)."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    beta = actor.policy_loss.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta={beta!r} must be > 0 with loss_mode=dro")
    log_ratio = log_prob - old_log_prob
    pg_losses = _weighted(-(log_prob * advantages - 0.5 * beta * log_ratio.square()), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    none = torch.zeros_like(response_mask, dtype=torch.bool)
    return loss, _metrics(log_ratio, response_mask, global_tokens, none, None)


def _bypass_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: str,
                    batch_normalize: bool) -> torch.Tensor:
    """pi_current / pi_rollout per token (``level="token"``) or per row (exp of the row's log-ratio sum),
    log clamped to [-20, 20], zero off the mask, truncated at C or zeroed outside [L, U]; divided by their
    mean (over valid tokens, or valid rows' token means) when ``batch_normalize``. Detached."""
    upper, lower = parse_is_threshold(threshold)
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(mask)
    raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0)) * mask
    w = raw.clamp(max=upper) if lower is None else torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(w, mask)
        else:
            rows = (mask.sum(dim=-1) > 0).to(w.dtype)
            mean = (masked_mean(w, mask, dim=-1) * rows).sum() / rows.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
    return w.detach()


def bypass_mode_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                     response_mask: torch.Tensor, actor: ActorConfig, *, global_tokens: Normalizer = None,
                     global_seqs: Normalizer = None, loss_scale_factor: float | None = None,
                     rollout_is_weights: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Out:
    """verl's bypass mode: ``old_log_prob`` is the rollout policy's (the actor worker passes
    ``rollout_log_probs``). ``loss_type=ppo_clip``: vanilla PPO
    clip against it, no weights (the ratio is the correction); ``reinforce``: ``-w * A * log_prob`` with
    ``w`` = :func:`_bypass_weights` of ``sg(log_prob) - old_log_prob`` (none when ``rollout_is`` is null).
    The ``rollout_is_weights`` given are ignored, as verl does (this mode computes its own)."""
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    rc = actor.policy_loss.rollout_correction
    if rc.loss_type == "ppo_clip":
        return vanilla_loss(old_log_prob, log_prob, advantages, response_mask, actor, global_tokens=global_tokens,
                            global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    if rc.loss_type != "reinforce":
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type={rc.loss_type!r} "
                         "must be ppo_clip or reinforce")
    log_ratio = log_prob - old_log_prob
    weights = None if rc.rollout_is is None else _bypass_weights(
        log_ratio.detach(), response_mask, rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize)
    pg_losses = _weighted(-advantages * log_prob, weights)
    loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, global_tokens=global_tokens,
                    global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    none = torch.zeros_like(response_mask, dtype=torch.bool)
    return loss, _metrics(log_ratio, response_mask, global_tokens, none, None)
