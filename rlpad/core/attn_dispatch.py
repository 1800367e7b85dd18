"""The one kernel dispatch of rlpad's attention: which kernel runs a packed row, and the varlen call.

Both the remove-padding attention (``rlpad_varlen``, :mod:`rlpad.core.attention`) and the
shared-prompt attention (:mod:`rlpad.core.shared_attention`) ask :func:`attention_kernel` and run a
varlen kernel through :func:`varlen_attention`; neither decides on its own.

============  ===============================================================  ==========================
kernel        chosen when                                                      grouped-query attention
============  ===============================================================  ==========================
flash_attn    CUDA, compute capability >= 8.0, bf16/fp16, flash-attn imports   native
torch_varlen  CUDA, compute capability >= 8.0, bf16/fp16, no dropout,          ``enable_gqa=True`` where the
              ``torch.nn.attention.varlen.varlen_attn`` with ``window_size``   signature has it (torch >= 2.12);
              (torch >= 2.11), torch built with FlashAttention                 K/V expanded on torch 2.11
sdpa          anything else: CPU, fp32 (or fp64) on CUDA, a pre-sm80 GPU,      K/V expanded by the caller
              dropout without flash-attn, no varlen kernel. Exact; per
              sequence (packed row) or per shape (shared-prompt row)
============  ===============================================================  ==========================

The sdpa fallback expands K/V (``repeat_interleave``, once per layer) rather than passing sdpa's
``enable_gqa``: on CPU (torch 2.13, 14 query / 2 key-value heads, causal, 8 x 256 tokens) the flag
made sdpa's fused CPU kernel 2.0x slower in fp32 and 1.2x in bf16 than expanding first, with
equal results; on CUDA the fallback is the exact slow path (fp32, pre-sm80) anyway.

A varlen call's tensors always hold exactly ``cu_seqlens[-1]`` tokens (torch's varlen backward
gives NaN gradients for tokens past it); the callers build them so.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from functools import cache

import torch

__all__ = [
    "FLASH_ATTN", "KERNELS", "SDPA", "TORCH_VARLEN", "DeviceKernels", "attention_kernel", "choose_kernel",
    "device_kernels", "expand_kv", "flash_attn_installed", "torch_varlen_gqa", "torch_varlen_missing",
    "varlen_api_missing", "varlen_attention", "varlen_gqa_arguments", "varlen_has_gqa",
]

FLASH_ATTN, TORCH_VARLEN, SDPA = "flash_attn", "torch_varlen", "sdpa"
KERNELS = (FLASH_ATTN, TORCH_VARLEN, SDPA)
HALF_DTYPES = (torch.bfloat16, torch.float16)  # what FlashAttention kernels compute in
MIN_CAPABILITY = (8, 0)  # FlashAttention kernels need an Ampere or newer GPU


def flash_attn_installed() -> bool:
    """True when the flash-attn package is importable (it is never imported here)."""
    return importlib.util.find_spec("flash_attn") is not None


def varlen_api_missing(varlen_attn) -> str | None:
    """None when ``varlen_attn`` takes ``window_size`` (torch >= 2.11: causal = ``(-1, 0)``, a sliding
    window = ``(W - 1, 0)``), which is all rlpad needs; else what lacks. ``enable_gqa`` (torch >= 2.12)
    is used where present (:func:`torch_varlen_gqa`), not required."""
    if "window_size" not in inspect.signature(varlen_attn).parameters:
        return (f"the window_size argument of torch.nn.attention.varlen.varlen_attn (torch {torch.__version__} "
                "is too old; window_size came with torch 2.11)")
    return None


def _varlen_attn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@cache
def torch_varlen_missing() -> str | None:
    """None when this torch has the varlen kernel rlpad calls on CUDA, else what is missing."""
    try:
        fn = _varlen_attn()
    except ImportError:
        return f"torch.nn.attention.varlen.varlen_attn (torch {torch.__version__} has none; it needs torch >= 2.11)"
    missing = varlen_api_missing(fn)
    if missing is not None:
        return missing
    if not torch.backends.cuda.is_flash_attention_available():
        return f"FlashAttention kernels in torch (torch {torch.__version__} was built without them)"
    return None


@cache
def varlen_has_gqa(varlen_attn) -> bool:
    """True when ``varlen_attn`` takes ``enable_gqa`` (K/V with fewer heads than Q; torch >= 2.12)."""
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def torch_varlen_gqa() -> bool:
    """True when this torch's varlen kernel does grouped-query attention itself."""
    return torch_varlen_missing() is None and varlen_has_gqa(_varlen_attn())


@dataclass(frozen=True)
class DeviceKernels:
    """What a device offers the dispatch: everything :func:`choose_kernel` reads besides the call."""

    cuda: bool
    capability: tuple[int, int] | None = None  # (major, minor) of a CUDA device
    flash_attn: bool = False  # flash-attn importable
    torch_varlen: bool = False  # torch's varlen kernel usable (torch_varlen_missing() is None)


@cache
def _cuda_kernels(index: int) -> DeviceKernels:
    return DeviceKernels(cuda=True, capability=torch.cuda.get_device_capability(index),
                         flash_attn=flash_attn_installed(), torch_varlen=torch_varlen_missing() is None)


def device_kernels(device: torch.device | str) -> DeviceKernels:
    """The kernels ``device`` offers (looked up once per CUDA device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceKernels(cuda=False)
    return _cuda_kernels(device.index if device.index is not None else torch.cuda.current_device())


def choose_kernel(offer: DeviceKernels, dtype: torch.dtype, dropout: float = 0.0) -> str:
    """The kernel for a call in ``dtype`` with attention ``dropout`` on a device offering ``offer``:
    :data:`FLASH_ATTN`, :data:`TORCH_VARLEN` or :data:`SDPA` (see the module table)."""
    if not offer.cuda or dtype not in HALF_DTYPES or offer.capability is None or offer.capability < MIN_CAPABILITY:
        return SDPA
    if offer.flash_attn:
        return FLASH_ATTN
    if offer.torch_varlen and not dropout:
        return TORCH_VARLEN
    return SDPA


def attention_kernel(query: torch.Tensor, dropout: float = 0.0) -> str:
    """The kernel that runs an attention call on ``query`` (its device and dtype)."""
    return choose_kernel(device_kernels(query.device), query.dtype, dropout)


def expand_kv(key: torch.Tensor, value: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value with their ``dim`` (head axis) repeated up to ``heads`` query heads (GQA -> MHA)."""
    groups = heads // key.shape[dim]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=dim), value.repeat_interleave(groups, dim=dim)


def varlen_gqa_arguments(kernel: str, q_heads: int, kv_heads: int, has_enable_gqa: bool) -> tuple[bool, dict]:
    """``(expand K/V?, extra keyword arguments)`` for a varlen call of ``kernel`` with GQA heads."""
    if q_heads == kv_heads or kernel == FLASH_ATTN:
        return False, {}
    if has_enable_gqa:
        return False, {"enable_gqa": True}
    return True, {}


def varlen_attention(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None,
    window: int | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """One varlen call: ``q`` (T_q, H, D), ``k/v`` (T_k, H_kv, D), int32 ``cu_q/cu_k`` ending at T_q / T_k,
    Python-int ``max_q/max_k``; returns (T_q, H, D). Causal, aligned bottom-right when a sequence
    has fewer queries than keys; ``window``: sliding window in positions (None: full causal)."""
    left = -1 if window is None else window - 1
    if kernel == FLASH_ATTN:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout, softmax_scale=scale,
                                      causal=True, window_size=(left, 0))  # fmt: skip
    if kernel != TORCH_VARLEN:
        raise ValueError(f"varlen_attention runs {FLASH_ATTN} or {TORCH_VARLEN}, not {kernel!r}")
    if dropout:
        raise ValueError("torch's varlen_attn has no dropout; the dispatch sends dropout to flash-attn or sdpa")
    fn = _varlen_attn()
    expand, extra = varlen_gqa_arguments(kernel, q.shape[1], k.shape[1], varlen_has_gqa(fn))
    if expand:
        k, v = expand_kv(k, v, q.shape[1], dim=1)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, 0), **extra)
