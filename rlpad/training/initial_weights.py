"""Whether a fresh run's actor starts from other weights than the engines, and the sync that fixes it.

The rollout engines are built from ``actor_rollout_ref.model.path`` (read in ``rollout.dtype``) and get
the actor's weights only at a sync. The actor starts from other weights when:

- it loads a saved adapter (``model.lora_adapter_path``): the engines would sample the base model;
- it holds the checkpoint in a narrower dtype than the engines (``model.dtype`` bfloat16 / float16 and
  another ``rollout.dtype``): every later sync sends the actor's rounded weights, the first generation
  would sample the unrounded ones.

A fresh LoRA adapter (``lora_B`` = 0) and a resumed run (the resume syncs the checkpoint's weights) need
nothing. :func:`sync_initial_weights` runs before the first generation and step-0 validation.
"""

from __future__ import annotations

from typing import Any

from rlpad.config.choices import DTYPES

__all__ = ["initial_weight_differences", "sync_initial_weights"]


def initial_weight_differences(config: Any) -> list[str]:
    """Why the actor's initial weights differ from what the engines load from ``model.path`` (one line each;
    empty: they are equal)."""
    arr = config.actor_rollout_ref
    reasons = []
    if arr.model.uses_lora and arr.model.lora_adapter_path is not None:
        reasons.append(f"actor_rollout_ref.model.lora_adapter_path={arr.model.lora_adapter_path!r}: the actor "
                       "starts from the saved adapter, the engines from the base model")
    actor_dtype, engine_dtype = DTYPES[arr.model.dtype], DTYPES[arr.rollout.dtype]
    if actor_dtype != "float32" and actor_dtype != engine_dtype:
        reasons.append(f"actor_rollout_ref.model.dtype={arr.model.dtype} rounds the weights the engines read in "
                       f"rollout.dtype={arr.rollout.dtype}")
    return reasons


def sync_initial_weights(config: Any, workers: Any, ahead: Any = None) -> list[str]:
    """On a fresh start, the actor's weights into the engines when :func:`initial_weight_differences` finds a
    difference (``rollout.lora_sync`` decides adapter or merged, as at every sync). ``ahead``: the
    asynchronous schedule (:class:`rlpad.training.async_schedule.RolloutAhead`), whose engines load them as
    its start version, before any generation is submitted. Returns the reasons (empty: nothing sent)."""
    reasons = initial_weight_differences(config)
    if reasons:
        if ahead is None:
            workers.sync_weights()
        else:
            ahead.workers.submit_weight_sync(ahead.version).result()
    return reasons
