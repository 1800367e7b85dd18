"""Attention over a shared-prompt packed row (:mod:`rlpad.core.shared_prompt`), no nnz x nnz mask.

Each prompt attends causally to itself; each response's queries attend to [its prompt's keys, its
own keys] with a bottom-right causal mask (response token i sits at position P + i of that
sequence), the sliding window counting positions the same way. That is exactly the last L rows of
the attention of the sequence prompt + response run alone.

* CPU: batched sdpa, one call per prompt length and one per (prompt length, response length)
  shape; a (L, P + L) boolean mask per shape, made once per forward and reused by every layer.
* CUDA: two varlen flash calls (flash-attn when installed, else ``torch.nn.attention.varlen``):
  prompts as sequences, then responses as queries over keys gathered as [prompt, own response];
  both kernels align a causal mask bottom-right when queries are fewer than keys.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from rlpad.core.shared_prompt import SharedSegments

__all__ = ["shared_prompt_attention"]


def _response_mask(prompt_len: int, length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean (L, P + L): query i (position P + i) sees key j iff j <= P + i and P + i - j < window."""
    diff = (prompt_len + torch.arange(length, device=device))[:, None] - torch.arange(prompt_len + length, device=device)
    keep = diff >= 0
    return keep & (diff < window) if window is not None else keep


def _cpu(query, key, value, seg: SharedSegments, scale, dropout, window) -> torch.Tensor:
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


def _varlen_kernel():
    """``fn(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left)`` on (T, H, D), causal bottom-right."""
    if importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_varlen_func

        def run(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, dropout):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout, softmax_scale=scale,
                                          causal=True, window_size=(left, 0))  # fmt: skip
        return run
    from torch.nn.attention.varlen import varlen_attn

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, dropout):
        if dropout:
            raise NotImplementedError("torch varlen_attn has no dropout; install flash-attn for attention dropout")
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, 0),
                           enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip
    return run


def _cuda(query, key, value, seg: SharedSegments, scale, dropout, window) -> torch.Tensor:
    run = _varlen_kernel()
    left = window - 1 if window is not None else -1
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    pq, pk, pv = (t.index_select(0, seg.prompt_index) for t in (q, k, v))
    out_p = run(pq, pk, pv, seg.prompt_cu, seg.prompt_cu, seg.prompt_max, seg.prompt_max, scale, left, dropout)
    parts, order = [out_p], [seg.prompt_index]
    if seg.resp_index.numel():
        rq = q.index_select(0, seg.resp_index)
        rk, rv = (t.index_select(0, seg.resp_kv_index) for t in (k, v))
        parts.append(run(rq, rk, rv, seg.resp_cu_q, seg.resp_cu_k, seg.resp_max_q, seg.resp_max_k, scale, left,
                         dropout))  # fmt: skip
        order.append(seg.resp_index)
    out = q.new_zeros(q.shape).index_copy(0, torch.cat(order), torch.cat(parts))
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
    if query.is_cuda:
        return _cuda(query, key, value, segments, scale, dropout, window)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: expand the key/value heads once for the whole row
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return _cpu(query, key, value, segments, scale, dropout, window)
