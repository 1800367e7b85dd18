"""Which LM head runs a log-prob + entropy call, and the fp32-output GEMMs of the CUDA heads.

One rule (:func:`head_path`), read by :func:`rlpad.core.logprob.chunked_log_probs_and_entropy`
and by ``rlpad.core.forward`` for ``logits_chunk_size=None``:

* ``torch``: the CPU, fp32 / fp64, mixed dtypes or no tokens: the exact chunked torch path
  (:class:`rlpad.core.logprob._ChunkedHead`), numbers as before;
* ``triton``: CUDA bf16 / fp16 with Triton importable: the fused kernel of
  :mod:`rlpad.core.lm_head_triton` (fp32 logits, never written whole);
* ``torch_cuda``: CUDA bf16 / fp16 without Triton: the chunked torch path with its GEMMs on tensor
  cores, the logits in fp32 (:func:`mm_fp32`) and the weight gradient from a bf16 GEMM.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["HEAD_CHUNK_BYTES", "HEAD_PATHS", "TORCH", "TORCH_CUDA", "TRITON", "addmm_fp32_", "choose_head",
           "chunk_tokens", "head_path", "mm_fp32", "triton_missing"]

TORCH, TRITON, TORCH_CUDA = "torch", "triton", "torch_cuda"
HEAD_PATHS = (TORCH, TRITON, TORCH_CUDA)
LOW_PRECISION = (torch.bfloat16, torch.float16)
# The chunked heads of distillation (rlpad.core.distill_scoring) with logits_chunk_size null: as many tokens as
# keep one chunk's fp32 logits (tokens x columns x 4 B) within this; a chunk holds up to ~4 such blocks at once
# (logits, softmax, the tail's and the gradient's), so ~0.5 GiB at any vocabulary: 220 tokens at 151936 rows.
HEAD_CHUNK_BYTES = 128 << 20


def chunk_tokens(chunk_size: int | None, columns: int, budget: int = HEAD_CHUNK_BYTES) -> int:
    """``chunk_size`` (tokens) when set, else the tokens whose fp32 logits over ``columns`` fit ``budget`` bytes."""
    return chunk_size or max(1, budget // (4 * max(1, columns)))


@functools.cache
def triton_missing() -> str | None:
    """None when Triton imports, else why not (the ``torch_cuda`` head runs then)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means: no Triton head
        return f"triton does not import: {e!r}"
    return None


def choose_head(device_type: str, hidden_dtype: torch.dtype, weight_dtype: torch.dtype, tokens: int,
                triton: bool) -> str:
    """The rule: one of :data:`HEAD_PATHS` for a call on ``device_type`` with these dtypes."""
    if device_type != "cuda" or weight_dtype not in LOW_PRECISION or hidden_dtype != weight_dtype or tokens == 0:
        return TORCH
    return TRITON if triton else TORCH_CUDA


def head_path(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """The LM head for ``hidden (N, H)`` and ``weight (V, H)`` here: :func:`choose_head`."""
    if hidden.device.type != "cuda":
        return TORCH  # no need to look for Triton
    return choose_head(hidden.device.type, hidden.dtype, weight.dtype, hidden.shape[0], triton_missing() is None)


@functools.cache
def _mm_out_dtype_works(device: torch.device) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` (aten ``mm.dtype``, CUDA, torch >= 2.9)
    runs bf16 operands on ``device``; probed once per device."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fp32 (m, n) from same-dtype operands (m, k) and (k, n), never rounded to bf16.

    bf16 / fp16 on CUDA: one tensor-core GEMM with fp32 accumulation and fp32 output where torch has
    aten ``mm.dtype``; elsewhere (the CPU, older torch) the operands are upcast first (exact too,
    slower). fp32 / fp64 operands: a plain ``mm``, promoted to at least fp32.
    """
    if a.dtype in LOW_PRECISION and _mm_out_dtype_works(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    acc = torch.promote_types(a.dtype, torch.float32)
    return torch.mm(a.to(acc), b.to(acc))



@functools.cache
def _addmm_out_dtype_works(device: torch.device) -> bool:
    """Whether aten ``addmm.dtype_out`` accumulates bf16 operands into an fp32 ``out`` that is also
    its input (one cuBLAS GEMM with beta = 1) on ``device``; probed once per device, numbers checked."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        acc = torch.ones(16, 16, dtype=torch.float32, device=device)
        torch.ops.aten.addmm.dtype_out(acc, a, a, torch.float32, out=acc)
        return bool((acc == 17).all())
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in place, ``acc (m, n)`` fp32 from same-dtype ``a (m, k)``, ``b (k, n)``.

    CUDA bf16 / fp16 with aten ``addmm.dtype_out``: the GEMM accumulates into ``acc`` itself (beta = 1,
    no (m, n) temporary); elsewhere :func:`mm_fp32` then an add (one more write and two reads of
    ``m x n`` fp32: at N = 19000, H = 3584 and 6 slices, ~4.9 GB, ~1.5 ms at 3.35 TB/s).
    """
    if a.dtype in LOW_PRECISION and _addmm_out_dtype_works(a.device):
        return torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    return acc.add_(mm_fp32(a, b))
