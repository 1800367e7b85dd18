"""Synthetic rollout-shaped batches (left-padded prompts, right-padded responses).

Used by ``rlpad check``, the benchmarks and the tests: :func:`rollout_batch` (random lengths),
:func:`grpo_batch` (groups of n rows sharing a prompt), :func:`ppo_batch` (a :class:`Batch` with
every key the workers read), :func:`with_tool_spans` (multi-turn: tool output inside the responses).
"""

from __future__ import annotations

import math

import torch

from rlpad.batch import Batch
from rlpad.core.layout import position_ids_from_mask

__all__ = ["grpo_batch", "ppo_batch", "rollout_batch", "with_tool_spans"]


def rollout_batch(
    batch: int,
    prompt_length: int,
    response_length: int,
    *,
    vocab_size: int,
    seed: int = 0,
    valid_fraction: float = 0.5,
    pad_id: int = 0,
    edge_rows: bool = True,
) -> dict[str, torch.Tensor]:
    """A (batch, prompt_length + response_length) rollout batch with random lengths.

    Prompt and response lengths are drawn so that about ``valid_fraction`` of the tokens are
    valid. With ``edge_rows`` row 0 is full length (no padding) and row 1 has a 1-token response.
    Returns ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``.
    """
    if batch < 1 or prompt_length < 1 or response_length < 1:
        raise ValueError("batch, prompt_length and response_length must be >= 1")
    if not 0 < valid_fraction <= 1:
        raise ValueError(f"valid_fraction must be in (0, 1], got {valid_fraction}")
    gen = torch.Generator().manual_seed(seed)
    # Uniform lengths in [lo, hi] have mean (lo + hi) / 2 = valid_fraction * full length.
    def lengths(full: int) -> torch.Tensor:
        lo = max(1, round(full * max(0.0, 2 * valid_fraction - 1)))
        hi = max(lo, min(full, round(2 * valid_fraction * full) - lo))
        return torch.randint(lo, hi + 1, (batch,), generator=gen)

    prompt_lens, response_lens = lengths(prompt_length), lengths(response_length)
    if edge_rows:
        prompt_lens[0], response_lens[0] = prompt_length, response_length
        if batch > 1:
            response_lens[1] = 1
    seqlen = prompt_length + response_length
    input_ids = torch.randint(pad_id + 1, vocab_size, (batch, seqlen), generator=gen)
    return _layout(input_ids, prompt_length, prompt_lens, response_lens, pad_id)


def grpo_batch(
    groups: int,
    n: int,
    prompt_length: int,
    response_length: int,
    *,
    vocab_size: int,
    seed: int = 0,
    shuffle: bool = False,
    min_prompt: int = 1,
    pad_id: int = 0,
) -> dict[str, torch.Tensor]:
    """A GRPO-shaped rollout batch: ``groups`` prompts x ``n`` responses each, (groups*n, P+R).

    Prompt lengths are drawn in [min_prompt, P] per group (group 0 full length), response lengths
    in [1, R] per row (row 0 full length, row 1 one token when n > 1). Rows of a group are
    adjacent unless ``shuffle``. Also returns ``group`` (rows,): the group of each row.
    """
    if groups < 1 or n < 1 or not 1 <= min_prompt <= prompt_length or response_length < 1:
        raise ValueError("groups, n, response_length must be >= 1 and 1 <= min_prompt <= prompt_length")
    gen = torch.Generator().manual_seed(seed)
    rows = groups * n
    prompt_lens = torch.randint(min_prompt, prompt_length + 1, (groups,), generator=gen)
    prompt_lens[0] = prompt_length
    response_lens = torch.randint(1, response_length + 1, (rows,), generator=gen)
    response_lens[0] = response_length
    if n > 1:
        response_lens[1] = 1
    group = torch.arange(groups).repeat_interleave(n)
    if shuffle:
        perm = torch.randperm(rows, generator=gen)
        group, response_lens = group[perm], response_lens[perm]
    seqlen = prompt_length + response_length
    prompts = torch.randint(pad_id + 1, vocab_size, (groups, prompt_length), generator=gen)
    input_ids = torch.randint(pad_id + 1, vocab_size, (rows, seqlen), generator=gen)
    input_ids[:, :prompt_length] = prompts[group]
    return _layout(input_ids, prompt_length, prompt_lens[group], response_lens, pad_id) | {"group": group}


def ppo_batch(
    rows: int, prompt_length: int, response_length: int, *, vocab_size: int, seed: int = 0, valid_fraction: float = 0.5
) -> Batch:
    """A rollout-shaped :class:`Batch` with every key the workers read.

    ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``, ``response_mask`` (random
    lengths, see :func:`rollout_batch`), ``advantages``, ``returns``, ``values``
    ~ N(0, 1) and ``old_log_probs`` / ``ref_log_probs`` = log(1/V) + N(0, 0.2) noise (near a random
    model's own log-probs, so PPO ratios straddle the clip range); zeros on padding.
    """
    d = rollout_batch(
        rows, prompt_length, response_length, vocab_size=vocab_size, seed=seed, valid_fraction=valid_fraction
    )
    gen = torch.Generator().manual_seed(seed + 1)
    mask = d["response_mask"].float()
    d["responses"] = d["input_ids"][:, prompt_length:]

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(rows, response_length, generator=gen) * scale * mask

    base = -math.log(vocab_size) * mask
    d.update(advantages=noise(1.0), returns=noise(1.0), values=noise(1.0),
             old_log_probs=base + noise(0.2), ref_log_probs=base + noise(0.2))  # fmt: skip
    return Batch(d)


def _layout(input_ids: torch.Tensor, prompt_length: int, prompt_lens: torch.Tensor, response_lens: torch.Tensor,
            pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts of ``prompt_lens`` + right-padded responses of ``response_lens`` tokens."""
    cols = torch.arange(input_ids.shape[1])
    start = prompt_length - prompt_lens
    end = prompt_length + response_lens
    attention_mask = ((cols >= start[:, None]) & (cols < end[:, None])).long()
    return dict(
        input_ids=torch.where(attention_mask.bool(), input_ids, pad_id),
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        response_mask=attention_mask[:, prompt_length:],
    )


def with_tool_spans(response_mask: torch.Tensor, *, seed: int = 0, spans: int = 2, max_span: int = 3) -> torch.Tensor:
    """A multi-turn ``response_mask`` (B, R): up to ``spans`` random runs of at most ``max_span`` valid
    response tokens set to 0 (tool output: attended, not generated), each strictly inside the valid
    response so every row still starts and ends with a generated token. Rows too short keep theirs."""
    gen = torch.Generator().manual_seed(seed)
    out = response_mask.clone()
    for row, n in enumerate(response_mask.sum(1).tolist()):
        for _ in range(spans):
            if n < 3:
                break
            width = int(torch.randint(1, min(max_span, n - 2) + 1, (1,), generator=gen))
            start = int(torch.randint(1, n - width, (1,), generator=gen))
            out[row, start:start + width] = 0
    return out
