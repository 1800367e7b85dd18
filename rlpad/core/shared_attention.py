"""Attention over a shared-prompt packed row (:mod:`rlpad.core.shared_prompt`), no nnz x nnz mask.

Each prompt attends causally to itself; each response's queries attend to [its prompt's keys, its
own keys] with a bottom-right causal mask (response token i sits at position P + i of that
sequence), the sliding window counting positions the same way. That is exactly the last L rows of
the attention of the sequence prompt + response run alone.

The kernel comes from the one dispatch (:mod:`rlpad.core.attn_dispatch`), as for the plain
packed row:

* varlen (CUDA in bf16/fp16, sm80+): one varlen call per layer, as for the plain packed row: the
  row's queries in place (each prompt and each response is a contiguous sequence of it), keys and
  values gathered once as [prompt, own tokens] per sequence; the kernels align a causal mask
  bottom-right when queries are fewer than keys, so a prompt (queries = keys) is plain causal.
  Per layer: two gathers (K, V) and the call; no index is built, no output scattered back. K/V
  keep their heads where the kernel does GQA.
* sdpa (CPU, fp32 on CUDA, an older GPU): batched sdpa, one call per prompt length and one per
  (prompt length, response length) shape; a (L, P + L) boolean mask per shape, made once per
  forward and reused by every layer. Exact. Its shapes are Python ints of the segments, so no
  layer reads the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlpad.core.attn_dispatch import SDPA, attention_kernel, expand_kv, varlen_attention
from rlpad.core.shared_prompt import SharedSegments

__all__ = ["shared_prompt_attention"]


def _response_mask(prompt_len: int, length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean (L, P + L): query i (position P + i) sees key j iff j <= P + i and P + i - j < window."""
    diff = (prompt_len + torch.arange(length, device=device))[:, None] - torch.arange(prompt_len + length, device=device)
    keep = diff >= 0
    return keep & (diff < window) if window is not None else keep


def _sdpa(query, key, value, seg: SharedSegments, scale, dropout, window) -> torch.Tensor:
    # Gathers along the token axis of (T, H, D) views: whole rows where the memory is token-major
    # (value, a transpose of the projection). One gather per tensor for all blocks, then split:
    # backward is one index_add and one cat, not a row-sized zero buffer per block.
    q_all, k_all, v_all = (t[0].transpose(0, 1) for t in (query, key, value))
    qs = q_all.index_select(0, seg.q_order).split(seg.q_sizes)  # (tokens, H, D) per block
    ks = k_all.index_select(0, seg.kv_order).split(seg.kv_sizes)
    vs = v_all.index_select(0, seg.kv_order).split(seg.kv_sizes)
    outs = []
    for (count, plen, length), q, k, v in zip(seg.blocks, qs, ks, vs):
        q, k, v = (t.unflatten(0, (count, -1)).transpose(1, 2) for t in (q, k, v))  # (count, H, n, D)
        if plen == 0 and (window is None or length <= window):  # a prompt: plain causal
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale)
        else:
            mask = seg.masks.get((plen, length, window))
            if mask is None:
                mask = seg.masks[(plen, length, window)] = _response_mask(plen, length, window, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
        outs.append(out.transpose(1, 2).flatten(0, 1))  # (count * n, H, D)
    # (T, H, D) in block order -> row order -> (1, T, H, D)
    return torch.cat(outs).index_select(0, seg.inverse).unsqueeze(0)


def _varlen(kernel, query, key, value, seg: SharedSegments, scale, dropout, window) -> torch.Tensor:
    # ONE varlen call: the queries as the row holds them (every sequence is a contiguous run), the
    # keys/values gathered per sequence as [its prompt, itself] (one gather each); the output is
    # in row order. The gathered tensors hold exactly cu_k[-1] tokens (SharedSegments builds them so).
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D), (T, H_kv, D)
    q = q.contiguous()  # as the plain packed row passes it (a view already dense after rotary: no copy)
    k, v = (t.index_select(0, seg.kv_index) for t in (k, v))
    out = varlen_attention(kernel, q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, scale=scale, window=window,
                           dropout=dropout)  # fmt: skip
    return out.unsqueeze(0)  # (1, T, H, D)


def shared_prompt_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: SharedSegments,
    *,
    scale: float | None,
    dropout: float = 0.0,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of a shared-prompt row; ``query`` (1, H, T, D), ``key/value`` (1, H_kv, T, D);
    returns (1, T, H, D). ``window``: sliding window in positions (None: full causal)."""
    if query.shape[0] != 1 or query.shape[2] != segments.total:
        raise ValueError(f"shared-prompt attention expects one packed row of {segments.total} tokens, "
                         f"got query {tuple(query.shape)}")  # fmt: skip
    kernel = attention_kernel(query, dropout)
    if kernel != SDPA:
        return _varlen(kernel, query, key, value, segments, scale, dropout, window)
    key, value = expand_kv(key, value, query.shape[1], dim=1)  # GQA: once for the whole row
    return _sdpa(query, key, value, segments, scale, dropout, window)
