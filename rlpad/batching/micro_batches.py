"""Micro-batch plans: which rows of a worker's batch go through each forward (and backward).

By rows (``micro_rows`` per micro-batch) or by a token budget (at most ``max_tokens`` valid tokens
each, :func:`rlpad.batching.balance.split_by_token_budget`; a VL row's vision patches count as tokens:
:func:`row_tokens`). With shared prompts (``model.share_prompts``)
every micro-batch holds whole prompt groups, a group costing its prompt once (``P + sum(R_i)``,
:func:`rlpad.batching.balance.shared_units`).

Every rank of a worker group must run the same number of micro-batches, since each one joins
FSDP's collectives: ``agree`` turns this rank's ``[count, longest row]`` into the element-wise max
over the ranks (the worker passes an all-reduce MAX), and the surplus micro-batches are empty
lists, which the worker runs as zero-weight dummies. A row over the token budget is found in that
same agreement, so every rank raises the ValueError together and none is left waiting in a
collective. Pure functions; the collective stays in the worker.
"""

from __future__ import annotations

from collections.abc import Callable

from rlpad.batch import Batch
from rlpad.core.shared_prompt import prompt_groups
from rlpad.core.vision import MM_KEY
from rlpad.batching.balance import count_micro_batches, pack_units_by_rows, shared_units, split_by_token_budget

__all__ = ["micro_batches", "row_tokens", "vision_patches"]


def vision_patches(batch: Batch) -> list[int]:
    """Vision patches per row of ``batch`` (``multi_modal_inputs``; 0 for a text-only row or batch)."""
    mm = batch.non_tensors.get(MM_KEY)
    if mm is None:
        return [0] * len(batch)
    return [int(m["pixel_values"].shape[0]) if m and "pixel_values" in m else 0 for m in mm]


def row_tokens(batch: Batch) -> list[int]:
    """What each row costs in a token budget or a rank balance: its valid tokens plus its images'
    vision patches (the tower runs on every patch, the language model on every valid token)."""
    return [n + p for n, p in zip(batch["attention_mask"].sum(-1).tolist(), vision_patches(batch))]


def _alone(values: list[int]) -> list[int]:
    return values


def micro_batches(batch: Batch, micro_rows: int | None, max_tokens: int | None, *, share_prompts: bool = False,
                  agree: Callable[[list[int]], list[int]] = _alone) -> list[list[int]]:
    """Row indices per micro-batch of ``batch`` (``attention_mask``; with ``share_prompts`` also
    ``input_ids``, ``responses`` and, if present, ``position_ids``), ascending inside each.

    ``max_tokens`` given: a token budget (a row, or with shared prompts a group, longer than it is a
    ValueError on every rank that agrees, raised after the agreement); else ``micro_rows`` rows each
    (whole groups with shared prompts; a group larger than ``micro_rows`` is cut).
    ``agree([count, longest])``: the element-wise max over the ranks (``count``: the micro-batches
    every rank runs, >= this rank's, the extra ones empty; ``longest``: the longest row's tokens).
    """
    if max_tokens is None and (micro_rows is None or micro_rows < 1):
        raise ValueError(f"micro-batch size must be >= 1 rows, got {micro_rows}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"the micro-batch token budget must be an int >= 1, got {max_tokens!r}")
    lengths = row_tokens(batch)
    longest = max(lengths, default=0)
    if max_tokens is not None and longest > max_tokens:  # no plan here: say so in the agreement
        agree([0, longest])
        row = lengths.index(longest)
        raise ValueError(f"sequence {row} has {longest} tokens, more than the micro-batch token budget {max_tokens}")
    units, tokens = _units(batch, micro_rows, max_tokens, share_prompts)
    if max_tokens is not None:
        count = count_micro_batches(tokens, max_tokens)
    else:
        parts = pack_units_by_rows([len(u) for u in units], micro_rows)
        count = len(parts)
    count, longest_anywhere = agree([count, longest])
    if max_tokens is not None and longest_anywhere > max_tokens:
        raise ValueError(f"another rank holds a sequence of {longest_anywhere} tokens, more than the micro-batch "
                         f"token budget {max_tokens}")
    if max_tokens is not None:
        parts = split_by_token_budget(tokens, max_tokens, count)
    else:
        parts += [[] for _ in range(count - len(parts))]
    return [sorted(r for u in p for r in units[u]) for p in parts]


def _units(batch: Batch, micro_rows: int | None, max_tokens: int | None,
           share_prompts: bool) -> tuple[list[list[int]], list[int]]:
    """``(units, tokens)``: the groups of rows a split keeps whole (one row each without shared
    prompts) and each one's token count."""
    mask = batch["attention_mask"]
    if share_prompts:
        response_length = int(batch["responses"].shape[1])
        prompt_cols = mask.shape[1] - response_length
        groups = prompt_groups(batch["input_ids"], mask, batch.tensors.get("position_ids"), response_length,
                               batch.non_tensors.get(MM_KEY))
        prompts = [n + p for n, p in zip(mask[:, :prompt_cols].sum(-1).tolist(), vision_patches(batch))]  # images once
        units, tokens = shared_units(groups, prompts, mask[:, prompt_cols:].sum(-1).tolist(), max_token_len=max_tokens,
                                     max_rows=micro_rows if max_tokens is None else None)  # fmt: skip
    else:
        units, tokens = [[i] for i in range(len(batch))], row_tokens(batch)
    return units, tokens
