"""Policy-loss modes by name (``actor_rollout_ref.actor.policy_loss.loss_mode``): one registry.

:data:`POLICY_LOSSES` maps a name to the function computing it and the loss aggregations it
admits; the config check (rlpad.recipe.load) and the actor worker read it and nothing else, so
a new mode is one function (rlpad/algorithms/loss_modes.py) and one entry here. Every function has the
signature of :data:`LossFn` and returns the same metric keys (``pg_clipfrac``,
``pg_clipfrac_lower``, ``ppo_kl``, ``log_ratio_abs_max``) as shares of the mini-batch (see
:mod:`rlpad.algorithms.losses`). This module stays torch-free: the functions are imported when first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlpad.config.choices import LOSS_AGG_MODES

if TYPE_CHECKING:
    import torch

__all__ = ["POLICY_LOSSES", "LossFn", "PolicyLoss", "get_policy_loss", "parse_is_threshold", "policy_loss_problems"]

# fn(old_log_prob, log_prob, advantages, response_mask, actor: ActorConfig, *, global_tokens, global_seqs,
#    loss_scale_factor, rollout_is_weights, generator) -> (loss share, metric shares); tensors (B, R)
LossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@dataclass(frozen=True)
class PolicyLoss:
    """``target``: ``"module:function"`` of the loss; ``agg_modes``: the ``loss_agg_mode`` values it
    admits (the others are refused at config load; verl ignores them for these modes)."""

    target: str
    agg_modes: tuple[str, ...] = LOSS_AGG_MODES
    summary: str = ""

    def load(self) -> LossFn:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": PolicyLoss("rlpad.algorithms.loss_modes:vanilla_loss",
                          summary="PPO clip (clip_ratio_low / clip_ratio_high) with dual clip clip_ratio_c"),
    "gspo": PolicyLoss("rlpad.algorithms.loss_modes:gspo_loss",
                       summary="GSPO: one length-normalised ratio per sequence, clipped; gradient per token "
                               "(any aggregation, as verl; the paper's: seq-mean-token-mean)"),
    "cispo": PolicyLoss("rlpad.algorithms.loss_modes:cispo_loss",
                        summary="CISPO: -sg(clip(ratio)) * A * log_prob; every token keeps a gradient"),
    "geo_mean": PolicyLoss("rlpad.algorithms.loss_modes:geo_mean_loss", ("seq-mean-token-mean",),
                           summary="GMPO: geometric mean of token-clipped ratios per sequence"),
    "clip_cov": PolicyLoss("rlpad.algorithms.loss_modes:clip_cov_loss",
                           summary="Clip-Cov: PPO clip, plus clip_cov_ratio of the tokens with covariance in "
                                   "(clip_cov_lb, clip_cov_ub) get no gradient"),
    "kl_cov": PolicyLoss("rlpad.algorithms.loss_modes:kl_cov_loss",
                         summary="KL-Cov: unclipped ratio; the kl_cov_ratio highest-covariance tokens add "
                                 "ppo_kl_coef * |log-ratio|"),
    "dppo_tv": PolicyLoss("rlpad.algorithms.loss_modes:dppo_tv_loss",
                          summary="DPPO-Binary-TV: -A * sg(min(ratio, clip_ratio_c)) * log_prob on the tokens whose "
                                  "probability moved by at most clip_ratio_low / clip_ratio_high"),
    "dppo_kl": PolicyLoss("rlpad.algorithms.loss_modes:dppo_kl_loss",
                          summary="DPPO-Binary-KL: as dppo_tv, the trust region a binary KL <= clip_ratio_low / "
                                  "clip_ratio_high"),
    "sapo": PolicyLoss("rlpad.algorithms.loss_modes:sapo_loss", ("seq-mean-token-mean",),
                       summary="SAPO: a sigmoid gate of the ratio (tau_pos / tau_neg) instead of a clip"),
    "gpg": PolicyLoss("rlpad.algorithms.loss_modes:gpg_loss", summary="GPG: -A * log_prob, no ratio"),
    "dro": PolicyLoss("rlpad.algorithms.loss_modes:dro_loss",
                      summary="DRO: -(A * log_prob - dro_beta / 2 * log-ratio^2)"),
    "bypass_mode": PolicyLoss("rlpad.algorithms.loss_modes:bypass_mode_loss",
                              summary="verl's bypass mode (old = rollout policy): policy_loss.rollout_correction."
                                      "loss_type ppo_clip (vanilla) or reinforce (IS-weighted -A * log_prob)"),
}


def get_policy_loss(name: str) -> LossFn:
    """The loss function registered as ``name``; ValueError naming the choices otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={name!r} is not valid; "
                         f"choose one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name].load()


def policy_loss_problems(actor: Any) -> list[str]:
    """The config problems of ``actor.policy_loss`` (an ActorConfig): unknown mode, refused
    aggregation, keys out of range."""
    key = "actor_rollout_ref.actor.policy_loss"
    pl, problems = actor.policy_loss, []
    entry = POLICY_LOSSES.get(pl.loss_mode)
    if entry is None:
        return [f"{key}.loss_mode={pl.loss_mode!r} is not valid; choose one of {', '.join(POLICY_LOSSES)}"]
    if actor.loss_agg_mode not in entry.agg_modes:
        problems.append(f"{key}.loss_mode={pl.loss_mode} aggregates per sequence: set "
                        f"actor_rollout_ref.actor.loss_agg_mode to {' | '.join(entry.agg_modes)} "
                        f"(got {actor.loss_agg_mode!r})")
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        if not 0 < getattr(pl, name) <= 1:
            problems.append(f"{key}.{name}={getattr(pl, name)!r} must be a fraction in (0, 1]")
    if not pl.clip_cov_lb < pl.clip_cov_ub:
        problems.append(f"{key}.clip_cov_lb={pl.clip_cov_lb!r} must be < clip_cov_ub={pl.clip_cov_ub!r}")
    if pl.ppo_kl_coef < 0:
        problems.append(f"{key}.ppo_kl_coef={pl.ppo_kl_coef!r} must be >= 0")
    if pl.loss_mode == "dro" and not (pl.dro_beta is not None and pl.dro_beta > 0):
        problems.append(f"{key}.dro_beta={pl.dro_beta!r} must be > 0 with loss_mode=dro")
    if pl.loss_mode == "sapo":
        problems += [f"actor_rollout_ref.actor.{n}={getattr(actor, n)!r} must be > 0"
                     for n in ("tau_pos", "tau_neg") if not getattr(actor, n) > 0]
    if pl.loss_mode == "bypass_mode":
        problems += _bypass_problems(pl.rollout_correction, f"{key}.rollout_correction")
    return problems


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """``"C"`` -> ``(C, None)`` (truncate at C); ``"L_U"`` -> ``(U, L)`` (zero outside [L, U]); ValueError
    naming ``policy_loss.rollout_correction.rollout_is_threshold`` otherwise."""
    key = "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold"
    text = str(spec).strip()
    try:
        lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise ValueError(f"{key}={spec!r} must be a number C or 'L_U' (e.g. '0.5_2.0')") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{key}={spec!r}: need 0 < L <= U and C > 0")
    return upper, lower


def _bypass_problems(rc: Any, key: str) -> list[str]:
    """``policy_loss.rollout_correction`` (bypass_mode's keys, verl's names) out of range."""
    problems = []
    if rc.loss_type not in ("ppo_clip", "reinforce"):
        problems.append(f"{key}.loss_type={rc.loss_type!r} is not valid; choose one of ppo_clip, reinforce")
    if rc.rollout_is not in (None, "token", "sequence"):
        problems.append(f"{key}.rollout_is={rc.rollout_is!r} is not valid; choose one of token, sequence, null")
    try:
        parse_is_threshold(rc.rollout_is_threshold)
    except ValueError as e:
        problems.append(str(e))
    return problems
