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
    """``(fn(), counts)``: run ``fn`` under the profiler; ``counts`` by event name, CPU ops as
    ``op:<name>``, CUDA kernels as ``kernel:<name>``."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        out = fn()
        torch.cuda.synchronize()
    counts: Counter = Counter()
    for e in prof.key_averages():
        kind = "kernel" if e.device_type == torch.autograd.DeviceType.CUDA else "op"
        counts[f"{kind}:{e.key}"] += e.count
    return out, counts


def kernel_calls(counts: Counter, kernel: str) -> dict[str, object]:
    """Forward / backward calls of ``kernel``'s op in a profile, and the FlashAttention CUDA kernels
    launched (names with ``flash`` and ``fwd`` / ``bwd``: the evidence below the op names)."""
    fwd_end, bwd_end = KERNEL_OPS.get(kernel, ("<no varlen op>", "<no varlen op>"))
    ops = {k[len("op:"):]: c for k, c in counts.items() if k.startswith("op:")}
    flash = {k[len("kernel:"):]: c for k, c in counts.items() if k.startswith("kernel:") and "flash" in k.lower()}
    return {
        "forward_calls": sum(c for k, c in ops.items() if k.endswith(fwd_end)),
        "backward_calls": sum(c for k, c in ops.items() if k.endswith(bwd_end)),
        "any_varlen_op": sum(c for k, c in ops.items() if any(k.endswith(e) for pair in KERNEL_OPS.values() for e in pair)),
        "cuda_fwd_launches": sum(c for k, c in flash.items() if "fwd" in k.lower()),
        "cuda_bwd_launches": sum(c for k, c in flash.items() if "bwd" in k.lower()),
        "flash_kernels": sorted({k.split("<")[0].split("(")[0] for k in flash})[:8],
    }


def ran_forward_and_backward(calls: dict[str, object], per_forward: int) -> bool:
    """The varlen kernel ran ``per_forward`` times forward and backward: by its op's name, or where a
    torch version names the op otherwise, by the FlashAttention kernels launched."""
    fwd = calls["forward_calls"] >= per_forward or calls["cuda_fwd_launches"] >= per_forward
    bwd = calls["backward_calls"] >= per_forward or calls["cuda_bwd_launches"] >= per_forward
    return bool(fwd and bwd)
