"""A step's metrics computed from its batch: rewards, lengths and padding, per-stage throughput, the
rollout-vs-actor mismatch; and a run's summary (:func:`summarize`, printed at the end of ``rlpad.train``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from rlpad.algorithms.rollout_correction import log_prob_mismatch
from rlpad.batch import Batch

__all__ = ["batch_metrics", "mismatch_metrics", "stage_metrics", "summarize"]


def batch_metrics(batch: Batch, seq_scores: torch.Tensor) -> dict[str, float]:
    """``reward/{mean,std}`` of the sequence scores, ``response_length/{mean,max}`` (over ``response_mask``)
    and ``padding_ratio`` (the padded slots' share of ``attention_mask``)."""
    mask = batch["response_mask"].float()
    attention = batch["attention_mask"]
    return {
        "reward/mean": float(seq_scores.mean()), "reward/std": float(seq_scores.std()) if len(seq_scores) > 1 else 0.0,
        "response_length/mean": float(mask.sum(1).mean()), "response_length/max": float(mask.sum(1).max()),
        "padding_ratio": 1.0 - float(attention.sum()) / attention.numel(),
    }


def stage_metrics(batch: Batch, timing: dict[str, float], ppo_epochs: int) -> dict[str, float]:
    """``timing_s/<stage>``, ``tokens_per_s/<stage>`` (generated tokens for ``gen``, valid tokens, times
    ``ppo_epochs`` for the updates), ``timing_s/step`` (the stages' sum) and ``tokens_per_s/step`` (the
    step's valid tokens over it)."""
    valid, response_tokens = float(batch["attention_mask"].sum()), float(batch["response_mask"].float().sum())
    throughput = {"gen": response_tokens, "old_log_prob": valid, "ref": valid, "values": valid,
                  "update_actor": valid * ppo_epochs, "update_critic": valid * ppo_epochs}
    out = {f"timing_s/{k}": v for k, v in timing.items()}
    out.update({f"tokens_per_s/{k}": throughput[k] / t for k, t in timing.items() if k in throughput and t > 0})
    out["timing_s/step"] = sum(timing.values())
    if out["timing_s/step"] > 0:  # the whole step: its valid tokens (prompts and responses) per second
        out["tokens_per_s/step"] = valid / out["timing_s/step"]
    return out


def mismatch_metrics(batch: Batch, prefix: str) -> dict[str, float]:
    """:func:`rlpad.algorithms.rollout_correction.log_prob_mismatch` of the batch, keys prefixed (none without rollout log-probs)."""
    if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
        return {}
    stats = log_prob_mismatch(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
    return {f"{prefix}{k}": v for k, v in stats.items()}


def summarize(history: list[dict[str, Any]]) -> dict[str, float]:
    """Initial/final validation reward and mean per-phase throughput of a run."""
    val = [r["val/reward"] for r in history if "val/reward" in r]
    steps = [r for r in history if "reward/mean" in r]
    out: dict[str, float] = {}
    if val:
        out["val_reward_initial"], out["val_reward_final"] = val[0], val[-1]
    for key in sorted({k for r in steps for k in r if k.startswith("tokens_per_s/")}):
        values = [r[key] for r in steps if key in r and math.isfinite(r[key])]
        if values:
            out[key] = float(np.median(values))
    for key in ("mismatch/abs_diff_mean", "mismatch/abs_diff_max", "mismatch/k3_kl"):
        values = [r[key] for r in steps if key in r]
        if values:
            out[key] = float(np.median(values))
    val_mismatch = [r for r in history if "val/mismatch/abs_diff_mean" in r]
    if val_mismatch:
        out.update({k: v for k, v in val_mismatch[-1].items() if k.startswith("val/mismatch/")})
    if steps:
        out["padding_ratio"] = float(np.mean([r["padding_ratio"] for r in steps]))
        out["step_s"] = float(np.median([r["timing_s/step"] for r in steps]))
    return out
