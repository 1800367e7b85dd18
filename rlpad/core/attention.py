"""rlpad's varlen attention, ``rlpad_varlen``, for the packed (1, nnz) row.

Registered through transformers' ``AttentionInterface`` (which implementation a model gets is
chosen in :mod:`rlpad.core.attn_choice`). The kernel of each call comes from the one dispatch,
:mod:`rlpad.core.attn_dispatch`, shared with the shared-prompt attention:

* on CUDA in bf16/fp16 (sm80+): ONE varlen call on the whole packed row (``cu_seqlens``; GQA
  without expanding K/V where the kernel can do it; causal, or a sliding window of W positions);
  torch's FlashAttention varlen kernel, or flash-attn's when it is installed;
* elsewhere (CPU, fp32 on CUDA, an older GPU): causal sdpa run per sequence (sequences of equal
  length batched into one call; K/V expanded for GQA; optional sliding window). Exact.

Either way no token attends across a sequence boundary and no nnz x nnz mask is built. With a
padding mask (the padded path) it defers to sdpa, with a mask in which no query row is fully
masked (:func:`unmask_unattended_rows`: finite in bf16 whatever kernel sdpa picks). Given the
forward keyword ``rlpad_shared_segments`` it runs the shared-prompt attention
(:mod:`rlpad.core.shared_attention`), which is why ``share_prompts`` needs ``rlpad_varlen`` on every device. Given ``rlpad_sequence_shard``
(sequence parallelism, :mod:`rlpad.core.sequence_parallel`) it exchanges this rank's slice of the
row for a slice of the heads over the whole row, attends as above, and exchanges back.

Nothing here reads the device once per layer on the varlen path: the forward passes
``cu_seq_lens_q`` (a device tensor) and ``max_length_q`` (a Python int), computed once per
forward. The sdpa path needs the bounds as Python ints: :class:`PackedBounds` reads them once per
forward, at the first layer that asks.
"""

from __future__ import annotations

import weakref
from functools import cached_property

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlpad.core.attn_dispatch import SDPA, attention_kernel, expand_kv, varlen_attention
from rlpad.core.sequence_parallel import SHARD_KWARG
from rlpad.core.shared_attention import shared_prompt_attention
from rlpad.core.shared_prompt import SEGMENTS_KWARG

VARLEN_ATTENTION = "rlpad_varlen"
# The forward keyword carrying a packed row's :class:`PackedBounds` (read by the sdpa path only).
BOUNDS_KWARG = "rlpad_packed_bounds"

__all__ = ["BOUNDS_KWARG", "VARLEN_ATTENTION", "PackedBounds", "guard_padded_sdpa", "packed_row_mask",
           "sequence_bounds", "unmask_unattended_rows", "varlen_attention_forward"]


def packed_row_mask(device: torch.device) -> torch.Tensor:
    """The ``attention_mask`` rlpad passes with a packed row: a 4D mask with no entries.

    transformers hands a 4D mask to the attention function as it is, without building one (which,
    for a row with ``attention_mask=None``, would first look for packed sequences in
    ``position_ids`` and read the device to decide: a host sync per forward). ``rlpad_varlen``
    reads it as "no mask: the packed row", whose bounds come from ``cu_seq_lens_q`` or the segments.
    """
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)


def _is_packed_row(attention_mask: torch.Tensor | None) -> bool:
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.numel() == 0)


class PackedBounds:
    """Boundaries ``[0, e1, ..., total]`` of a packed row's sequences as Python ints, read from the
    device tensor ``cu_seqlens`` on first use and kept: one host sync per forward, and none when
    only varlen kernels run (they read ``cu_seqlens`` itself)."""

    def __init__(self, cu_seqlens: torch.Tensor, total: int):
        self.cu_seqlens, self.total = cu_seqlens, total

    @cached_property
    def bounds(self) -> list[int]:
        return sequence_bounds(self.cu_seqlens, None, self.total)


def _packed_cu_seqlens(kwargs: dict, total: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(int32 cu_seqlens on ``device``, max sequence length) of a packed row, from the forward's kwargs.

    No host sync when the forward passes ``cu_seq_lens_q`` and an int ``max_length_q`` (rlpad's does);
    otherwise the bounds are read from the device (once per layer: pass them to avoid it).
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        bounds = sequence_bounds(None, kwargs.get("position_ids"), total)
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.tensor(bounds, dtype=torch.int32, device=device), max(lengths)
    max_len = kwargs.get("max_length_q")
    if max_len is None:
        max_len = (cu[1:] - cu[:-1]).max()
    return cu.to(device=device, dtype=torch.int32), max_len if isinstance(max_len, int) else int(max_len)


def sequence_bounds(
    cu_seqlens: torch.Tensor | None, position_ids: torch.Tensor | None, total: int
) -> list[int]:
    """Boundaries ``[0, e1, e2, ..., total]`` of the sequences in a packed row.

    Taken from ``cu_seqlens`` when given, else from the restarts of ``position_ids`` to 0.
    """
    if cu_seqlens is not None:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"cu_seqlens must run from 0 to {total} (the packed length), got {bounds[:3]}..{bounds[-1]}")
        return bounds
    if position_ids is None:
        return [0, total]
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return [*starts, total]


def _causal_window_mask(length: int, window: int | None, device: torch.device, keys: int | None = None) -> torch.Tensor:
    """Boolean (L, K) mask: causal, and key within ``window`` tokens of the query (transformers' rule).
    ``keys`` K > L (decoding with a KV cache): the L queries are the last L of the K positions."""
    keys = length if keys is None else keys
    i = torch.arange(keys - length, keys, device=device)
    diff = i[:, None] - torch.arange(keys, device=device)[None, :]
    return (diff >= 0) & (diff < window) if window is not None else diff >= 0


def _sdpa(q, k, v, *, scale, dropout, window):
    """Causal sdpa on (B, H, L, D) tensors, with a sliding-window mask when it bites. With a KV cache
    (more keys than queries, as in ``generate``) the queries are the last positions (bottom-right causal)."""
    length, keys = q.shape[2], k.shape[2]
    if keys != length or (window is not None and length > window):
        mask = _causal_window_mask(length, window, q.device, keys)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Per-sequence causal attention; ``query/key/value`` are (B, H, S, D), output (B, S, H, D).

    With a sequence shard (``rlpad_sequence_shard``) S is this rank's slice of the packed row: the
    attention runs on the whole row for a slice of the heads, between two all-to-all exchanges."""
    if _is_packed_row(attention_mask):
        attention_mask = None
    shard = kwargs.get(SHARD_KWARG)
    if shard is None:
        return _attend(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, **kwargs)
    if attention_mask is not None:
        raise ValueError("sequence parallelism runs the packed row only (use_remove_padding=True)")
    query, key, value = shard.to_heads(query, key, value)
    out, _ = _attend(module, query, key, value, None, dropout, scaling, sliding_window, softcap, **kwargs)
    return shard.to_tokens(out), None


def _attend(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, **kwargs):
    if attention_mask is not None:  # padded batch: the mask already encodes padding and windows
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("rlpad_varlen attention supports neither logit soft-capping nor attention sinks")
    window = sliding_window if sliding_window else None
    segments = kwargs.get(SEGMENTS_KWARG)
    if segments is not None:  # a shared-prompt row (rlpad.core.shared_prompt)
        out = shared_prompt_attention(query, key, value, segments, scale=scaling, dropout=dropout, window=window)
        return out, None
    kernel = attention_kernel(query, dropout)
    if kernel != SDPA and query.shape[0] == 1:  # the packed row, one varlen call
        cu_seqlens, max_seqlen = _packed_cu_seqlens(kwargs, query.shape[2], query.device)
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (T, heads, D)
        out = varlen_attention(kernel, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                               scale=scaling, window=window, dropout=dropout)  # fmt: skip
        return out.unsqueeze(0), None
    key, value = expand_kv(key, value, query.shape[1], dim=1)  # GQA: once for the whole row
    if query.shape[0] > 1:  # an unpadded batch: each row is one sequence
        return _sdpa(query, key, value, scale=scaling, dropout=dropout, window=window).transpose(1, 2), None
    packed = kwargs.get(BOUNDS_KWARG)
    bounds = packed.bounds if packed is not None else sequence_bounds(
        kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), query.shape[2])
    if len(bounds) == 2:  # one sequence
        return _sdpa(query, key, value, scale=scaling, dropout=dropout, window=window).transpose(1, 2), None
    # One split of the row into per-sequence views (its backward is one cat, not a row-sized zero
    # buffer per sequence as slicing would give); sequences of equal length run as one batch (one
    # sdpa call per distinct length); the outputs go back in row order with one cat, token-major, so the
    # caller's (1, total, heads * dim) reshape is a view, not one more copy of the row.
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    qs, ks, vs = (t[0].split(lengths, dim=1) for t in (query, key, value))  # (heads, length, dim) views
    by_length: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        by_length.setdefault(length, []).append(i)
    outs: list[torch.Tensor | None] = [None] * len(lengths)
    for idx in by_length.values():
        q, k, v = (torch.stack([parts[i] for i in idx]) if len(idx) > 1 else parts[idx[0]].unsqueeze(0)
                   for parts in (qs, ks, vs))  # (sequences, heads, length, dim)
        out = _sdpa(q, k, v, scale=scaling, dropout=dropout, window=window)
        for i, piece in zip(idx, out.unbind(0)):
            outs[i] = piece
    return torch.cat([o.transpose(0, 1) for o in outs]).unsqueeze(0), None  # (1, total, heads, dim), contiguous


def _varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask for a packed or unpadded row (the attention reads bounds); for a padded batch sdpa's
    mask with no fully masked query row (:func:`unmask_unattended_rows`)."""
    if attention_mask is None:
        return None
    return unmask_unattended_rows(sdpa_mask(*args, attention_mask=attention_mask, **kwargs))


def unmask_unattended_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A boolean (B, 1, Q, K) mask whose query rows that see no key (left padding; padding beyond a
    sliding window) see every key instead.

    Such a row's output is never read (its token is padding, and padding keys are masked for every
    real query), but a kernel given a row with no key may return NaN in its backward (cuDNN's sdpa
    in bf16 does), which then reaches the weights through the gradient. Rows with a key are
    unchanged, so real tokens get exactly the attention they had. No host sync: one reduction.
    """
    if mask is None or mask.dtype != torch.bool:
        return mask
    return mask | ~mask.any(dim=-1, keepdim=True)


def guard_padded_sdpa(model: torch.nn.Module) -> int:
    """For a model on transformers' own ``sdpa`` (the padded path): a forward pre-hook on each
    decoder layer passes the layer's boolean ``attention_mask`` through
    :func:`unmask_unattended_rows`, so no query row reaches sdpa fully masked there either (the
    mask is fixed once per distinct mask of a forward, not per layer). Hooks stay with the module
    (FSDP wrapping and activation checkpointing's recompute run them too). Returns the hook count."""
    # id(mask) -> fixed mask, dropped when the mask is freed (nothing is kept past its forward)
    fixed: dict[int, torch.Tensor] = {}

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            return None
        out = fixed.get(id(mask))
        if out is None:
            out = fixed[id(mask)] = unmask_unattended_rows(mask)
            weakref.finalize(mask, fixed.pop, id(mask), None)
        return args, {**kwargs, "attention_mask": out}

    backbone = getattr(model, model.base_model_prefix, model)
    layers = getattr(getattr(backbone, "language_model", backbone), "layers", [])  # a VL model: its decoder
    for layer in layers:
        layer.register_forward_pre_hook(hook, with_kwargs=True)
    return len(layers)


AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)
