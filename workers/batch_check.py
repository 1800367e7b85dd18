"""The one check of a batch where it enters a worker (keys, shapes, finite values, model inputs)."""

from __future__ import annotations

import torch
from torch import nn

from rlpad.batch import Batch
from rlpad.core.forward import check_model_inputs

__all__ = ["INPUT_KEYS", "check_rollout_batch", "finite_check"]

# (B, S) model inputs; every other batch tensor a worker reads is (B, R).
INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def finite_check(batch: Batch, keys: list[str], who: str) -> None:
    """ValueError naming the first of ``keys`` holding NaN/inf (rows listed)."""
    for key in keys:
        x = batch[key]
        bad = ~torch.isfinite(x.float())
        if bool(bad.any()):
            rows = bad.reshape(x.shape[0], -1).any(-1).nonzero().flatten().tolist()
            raise ValueError(f"{who}: {key} contains NaN or inf (rows {rows[:8]})")


def check_rollout_batch(batch: Batch, keys: list[str], finite: list[str], who: str, model: nn.Module,
                        use_remove_padding: bool, share_prompts: bool = False) -> int:
    """The one check of a batch entering a worker: keys, (B, R) response tensors, finite values and
    the model inputs (:func:`rlpad.core.forward.check_model_inputs`); returns R.

    Micro-batches of a checked batch are scored with ``check=False``.
    """
    if not isinstance(batch, Batch):
        raise ValueError(f"{who}: expected an rlpad.batch.Batch, got {type(batch).__name__}")
    batch.require(*keys, who=who)
    if len(batch) == 0:
        raise ValueError(f"{who}: empty batch")
    response_length = int(batch["responses"].shape[1])
    for k in keys:
        x = batch[k]
        if k not in INPUT_KEYS and tuple(x.shape) != (len(batch), response_length):
            raise ValueError(f"{who}: {k} has shape {tuple(x.shape)}, expected (rows, response_length) = "
                             f"{(len(batch), response_length)}")
    finite_check(batch, finite, who)
    try:
        check_model_inputs(model, batch["input_ids"], batch["attention_mask"], batch.tensors.get("position_ids"),
                           response_length, use_remove_padding=use_remove_padding,
                           share_prompts=share_prompts)  # fmt: skip
    except TypeError as e:
        raise ValueError(f"{who}: {e}") from e
    return response_length
