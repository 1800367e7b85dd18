"""The rollout batch layout: the contract between the rollout, which builds it, and the scoring core.

A batch of B rows and S = P + R columns (docs/design.md, "The batch layout"):

* ``input_ids = cat(prompts, responses)``: prompts left-padded to P columns (every prompt's last
  token in column P-1), responses right-padded to R columns;
* ``attention_mask`` 0/1 with one run of ones per row (padding, prompt, response, padding);
* ``position_ids = clamp(cumsum(attention_mask) - 1, min=0)`` (:func:`position_ids_from_mask`);
* ``response_mask`` (B, R) 0/1: the response tokens the policy generated, a subset of the response
  part of ``attention_mask`` (multi-turn: tool output is attended, never scored; single-turn: equal).

:func:`check_rollout_tensors` is every check of that shape; :func:`left_pad` and
:func:`position_ids_from_mask` are the two rules that build it. Here, below both the rollout
(rlpad.rollout.layout builds batches with it) and the scoring core (rlpad.core.forward checks
them), because the check rests on the core's own mask rule (rlpad.core.padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlpad.core.padding import validate_attention_mask

__all__ = ["check_response_mask", "check_rollout_tensors", "left_pad", "position_ids_from_mask"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``clamp(cumsum(mask) - 1, min=0)``: positions restart at 0 at each row's first valid token."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def left_pad(rows: Sequence[Sequence[int]], width: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ``(ids, attention_mask)``, both (len(rows), width) int64, each row right-aligned."""
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} tokens, more than the {width} columns to left-pad it to")
        if row:
            ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def check_rollout_tensors(
    vocab_size: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    response_mask: torch.Tensor | None = None,
) -> None:
    """Raise ValueError/TypeError naming the first problem with rollout tensors, before any compute.

    Shapes, integer ids inside ``[0, vocab_size)``, a 0/1 mask with one run of ones per row, a
    non-empty left-padded prompt in the first ``S - response_length`` columns, and a
    ``response_mask`` (when given) inside the response part of the attention mask.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D (batch, seq) tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"shapes disagree: attention_mask {tuple(getattr(attention_mask, 'shape', ()))} vs input_ids {tuple(input_ids.shape)}"
        )
    if position_ids is not None and tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(f"shapes disagree: position_ids {tuple(position_ids.shape)} vs input_ids {tuple(input_ids.shape)}")
    seqlen = input_ids.shape[1]
    if isinstance(response_length, bool) or not isinstance(response_length, int):
        raise TypeError(f"response_length must be an int, got {type(response_length).__name__}")
    if not 1 <= response_length < seqlen:
        raise ValueError(
            f"response_length={response_length} must be in [1, {seqlen - 1}]: the sequence has {seqlen} "
            "columns and at least one must be a prompt column"
        )
    validate_attention_mask(attention_mask)
    no_prompt = (attention_mask[:, seqlen - response_length - 1] == 0).nonzero().flatten()
    if no_prompt.numel():
        raise ValueError(
            f"row(s) {no_prompt.tolist()[:8]}: the last prompt column is padding; prompts must be "
            "left-padded and non-empty"
        )
    if response_mask is not None:
        check_response_mask(response_mask, attention_mask[:, -response_length:])
    vocab = vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        bad = ((input_ids < 0) | (input_ids >= vocab)).nonzero()[0].tolist()
        raise ValueError(
            f"token ids must be in [0, {vocab}) (the model's vocabulary); found {input_ids[bad[0], bad[1]].item()} "
            f"at row {bad[0]}, column {bad[1]}"
        )


def check_response_mask(response_mask: torch.Tensor, response_attention: torch.Tensor) -> None:
    """ValueError unless ``response_mask`` is a (B, R) 0/1 tensor that is 1 only where
    ``response_attention`` (the response part of the attention mask) is: a generated token is a real token."""
    if not isinstance(response_mask, torch.Tensor) or tuple(response_mask.shape) != tuple(response_attention.shape):
        raise ValueError(f"response_mask must be a (rows, response_length) = {tuple(response_attention.shape)} "
                         f"tensor, got {tuple(getattr(response_mask, 'shape', ())) or type(response_mask).__name__}")
    if response_mask.is_floating_point() and bool((response_mask != response_mask.round()).any()):
        raise ValueError("response_mask must hold only 0 and 1")
    m = response_mask.long()
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("response_mask must hold only 0 and 1")
    bad = (m.bool() & ~response_attention.bool()).nonzero()
    if bad.numel():
        r, c = bad[0].tolist()
        raise ValueError(f"response_mask is 1 on padding (attention_mask 0) at row {r}, response column {c}: "
                         "a generated token must be a real token")
