"""Varlen attention for the packed (1, nnz) row.

Which implementation a model gets is chosen in :mod:`rlpad.core.attn_choice`. With flash-attn
installed on CUDA the model can use transformers' ``flash_attention_2``, which reads
``cu_seq_lens_q/k`` directly. rlpad also registers its own implementation, ``rlpad_varlen``,
through transformers' ``AttentionInterface``:

* on CUDA in bf16/fp16 (torch with ``torch.nn.attention.varlen.varlen_attn``): ONE call of torch's
  FlashAttention varlen kernel on the whole packed row (``cu_seqlens``, GQA through
  ``enable_gqa``, causal through ``window_size=(-1, 0)``, a sliding window through
  ``window_size=(W - 1, 0)``); no flash-attn build needed;
* elsewhere (CPU, fp32): causal sdpa run per sequence (sequences of equal length batched into
  one call; GQA; optional sliding window).

Either way no token attends across a sequence boundary and no nnz x nnz mask is built. With a
padding mask (the padded path) it defers to sdpa. Given the forward keyword ``rlpad_shared_segments``
it runs the shared-prompt attention (:mod:`rlpad.core.shared_attention`, varlen flash kernels on
CUDA), which is why ``share_prompts`` needs ``rlpad_varlen`` on every device.
"""

from __future__ import annotations

import importlib.util
import inspect
from functools import cache

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlpad.core.shared_attention import shared_prompt_attention
from rlpad.core.shared_prompt import SEGMENTS_KWARG

VARLEN_ATTENTION = "rlpad_varlen"
VARLEN_IMPLEMENTATIONS = frozenset({VARLEN_ATTENTION, "flash_attention_2", "flash_attention_3"})

__all__ = [
    "VARLEN_ATTENTION",
    "VARLEN_IMPLEMENTATIONS",
    "require_varlen_attention",
    "flash_attention_available",
    "sequence_bounds",
    "torch_varlen_missing",
    "varlen_api_missing",
    "set_varlen_attention",
    "varlen_attention_forward",
    "varlen_implementation",
]


def flash_attention_available(device: torch.device | str | None = None) -> bool:
    """True when flash-attn is installed and ``device`` (default: any) is CUDA."""
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return on_cuda and importlib.util.find_spec("flash_attn") is not None


@cache
def torch_varlen_missing() -> str | None:
    """None when this torch has the varlen kernel rlpad_varlen calls on CUDA, else what is missing."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch.nn.attention.varlen.varlen_attn (torch {torch.__version__} has none; it needs torch >= 2.10)"
    missing = varlen_api_missing(varlen_attn)
    if missing is not None:
        return missing
    if not torch.backends.cuda.is_flash_attention_available():
        return f"FlashAttention kernels in torch (torch {torch.__version__} was built without them)"
    return None


def varlen_api_missing(varlen_attn) -> str | None:
    """None when ``varlen_attn`` takes ``window_size`` and ``enable_gqa`` (what rlpad passes), else what lacks."""
    params = inspect.signature(varlen_attn).parameters
    lacking = [p for p in ("window_size", "enable_gqa") if p not in params]
    if lacking:
        return (f"the {' and '.join(lacking)} argument(s) of torch.nn.attention.varlen.varlen_attn "
                f"(torch {torch.__version__} is too old; window_size came with torch 2.11)")
    return None


@cache
def _flash_capable(device_index: int) -> bool:
    """FlashAttention kernels need an Ampere or newer GPU (compute capability >= 8.0)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def _use_torch_varlen(query: torch.Tensor, dropout: float) -> bool:
    """The packed row goes to torch's varlen kernel: CUDA (sm80+), half precision, no dropout, kernel present.

    Otherwise (fp32, an older GPU) the per-sequence sdpa path runs, on the same device.
    """
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and not dropout
            and torch_varlen_missing() is None and _flash_capable(query.device.index or 0))


def _torch_varlen(query, key, value, *, cu_seqlens, max_seqlen, scale, window) -> torch.Tensor:
    """One torch varlen call on a packed (1, H, T, D) row; returns (1, T, H, D)."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (T, heads, D)
    out = varlen_attn(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
        window_size=(-1, 0) if window is None else (window - 1, 0), enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip
    return out.unsqueeze(0)


def _packed_cu_seqlens(kwargs: dict, total: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(int32 cu_seqlens on ``device``, max sequence length) of a packed row, from the forward's kwargs."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        max_len = kwargs.get("max_length_q")
        cu = cu.to(device=device, dtype=torch.int32)
        return cu, int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
    bounds = sequence_bounds(None, kwargs.get("position_ids"), total)
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.tensor(bounds, dtype=torch.int32, device=device), max(lengths)


def varlen_implementation(device: torch.device | str) -> str:
    """The attention implementation rlpad uses on ``device``: flash_attention_2 or rlpad_varlen."""
    return "flash_attention_2" if flash_attention_available(device) else VARLEN_ATTENTION


def require_varlen_attention(model: PreTrainedModel, *, share_prompts: bool = False) -> None:
    """ValueError unless ``model`` runs a varlen attention (what a packed (1, nnz) row needs);
    ``share_prompts`` needs ``rlpad_varlen`` itself (it reads the shared-prompt segments)."""
    impl = model.config._attn_implementation
    if share_prompts and impl != VARLEN_ATTENTION:
        raise ValueError(
            f"share_prompts=True needs the {VARLEN_ATTENTION!r} attention (it runs flash kernels on CUDA), the model "
            f"uses {impl!r}; load it with attn_implementation='rlpad_varlen' (model.attn_implementation) or call "
            f"rlpad.core.attention.set_varlen_attention(model, share_prompts=True)"
        )
    if impl not in VARLEN_IMPLEMENTATIONS:
        raise ValueError(
            f"use_remove_padding=True needs a varlen attention ({sorted(VARLEN_IMPLEMENTATIONS)}), the model uses "
            f"{impl!r}; load it with rlpad.core.models.load_causal_lm or call rlpad.core.attention.set_varlen_attention(model)"
        )


def set_varlen_attention(model: PreTrainedModel, *, share_prompts: bool = False) -> str:
    """Switch ``model`` to the varlen attention for its device (``rlpad_varlen`` everywhere with
    ``share_prompts``); returns the implementation name."""
    name = VARLEN_ATTENTION if share_prompts else varlen_implementation(next(model.parameters()).device)
    model.set_attn_implementation(name)
    return name


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


def _causal_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean (L, L) mask: causal, and key within ``window`` tokens of the query (transformers' rule)."""
    i = torch.arange(length, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


def _sdpa(q, k, v, *, scale, dropout, window):
    """Causal sdpa on (B, H, L, D) tensors, with a sliding-window mask when it bites."""
    length = q.shape[2]
    if window is not None and length > window:
        mask = _causal_window_mask(length, window, q.device)
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
    """Per-sequence causal attention; ``query/key/value`` are (B, H, S, D), output (B, S, H, D)."""
    if attention_mask is not None:  # padded batch: the mask already encodes padding and windows
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("rlpad_varlen attention supports neither logit soft-capping nor attention sinks")
    window = sliding_window if sliding_window else None
    segments = kwargs.get(SEGMENTS_KWARG)
    if segments is not None:  # a shared-prompt row (rlpad.core.shared_prompt)
        out = shared_prompt_attention(query, key, value, segments, scale=scaling, dropout=dropout, window=window)
        return out, None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: expand the key/value heads once for the whole row
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if query.shape[0] == 1 and _use_torch_varlen(query, dropout):
        cu_seqlens, max_seqlen = _packed_cu_seqlens(kwargs, query.shape[2], query.device)
        return _torch_varlen(query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                             scale=scaling, window=window), None
    if query.shape[0] > 1:  # an unpadded batch: each row is one sequence
        return _sdpa(query, key, value, scale=scaling, dropout=dropout, window=window).transpose(1, 2), None
    bounds = sequence_bounds(kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), query.shape[2])
    if len(bounds) == 2:  # one sequence
        return _sdpa(query, key, value, scale=scaling, dropout=dropout, window=window).transpose(1, 2), None
    # One split of the row into per-sequence views (its backward is one cat, not a row-sized zero
    # buffer per sequence as slicing would give); sequences of equal length run as one batch (one
    # sdpa call per distinct length); the outputs go back in row order with one cat.
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
    return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(0), None  # (1, total, heads, dim)


def _varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask for a packed or unpadded row (the attention reads bounds); sdpa's mask otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)
