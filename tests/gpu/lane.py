"""Helpers of the GPU lane's tests: the bf16 / fp32 model pair and the kernels a profile shows."""

from __future__ import annotations

from collections import Counter

import torch

from rlpad.core.attn_dispatch import FLASH_ATTN, TORCH_VARLEN, attention_kernel
from rlpad.embedded.tiny import tiny_model

VOCAB = 128
# Profiler op names of each varlen kernel, forward and backward (name endings).
KERNEL_OPS = {
    TORCH_VARLEN: ("_varlen_attn", "_varlen_attn_backward"),  # torch_attn::... custom ops
    FLASH_ATTN: ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"),  # flash_attn::...
}


def model_pair(arch: str, dtype: torch.dtype = torch.bfloat16):
    """``(model on CUDA in dtype, rlpad_varlen, train mode; its fp32 twin on the CPU, sdpa)``: the twin
    holds the SAME (dtype-rounded) weights and is the oracle's model, independent of any CUDA kernel."""
    model = tiny_model(arch, vocab_size=VOCAB, seed=1, dtype=dtype, attn_implementation="rlpad_varlen")
    model32 = tiny_model(arch, vocab_size=VOCAB, seed=1, dtype=torch.float32, attn_implementation="sdpa")
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return model.cuda().train(), model32.train()


def cuda_kernel(dtype: torch.dtype = torch.bfloat16) -> str:
    """The kernel the dispatch picks for a call in ``dtype`` on the current CUDA device."""
    return attention_kernel(torch.empty(1, 1, 1, 8, dtype=dtype, device="cuda"))


def profiled(fn):
    """``(fn(), op counts)``: run ``fn`` under the profiler (CPU ops and CUDA kernels)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, Counter({e.key: e.count for e in prof.key_averages()})


def kernel_calls(counts: Counter, kernel: str) -> dict[str, object]:
    """Forward / backward calls of ``kernel``'s op in a profile, and the CUDA flash kernels seen."""
    fwd_end, bwd_end = KERNEL_OPS[kernel]
    return {
        "forward_calls": sum(c for k, c in counts.items() if k.endswith(fwd_end)),
        "backward_calls": sum(c for k, c in counts.items() if k.endswith(bwd_end)),
        "any_varlen_op": sum(c for k, c in counts.items() if any(k.endswith(e) for ops in KERNEL_OPS.values() for e in ops)),
        "flash_kernels": sorted({k for k in counts if "flash" in k.lower() and "::" not in k})[:6],
    }
