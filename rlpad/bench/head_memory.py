"""Peak memory of the LM head's log-prob + entropy forward+backward: full logits vs chunked; and of
on-policy distillation's two head computations (:data:`DISTILL_VARIANTS`): the teacher's top-k
(forward, no gradient; full logits + ``torch.topk`` vs vocabulary chunks, rlpad.core.topk) and the
student's log-probs at those k ids and its tail (forward+backward; full log-softmax + gather vs the
chunked head), each with the tail bucket's log-mass.

One computation (:func:`head_fwd_bwd`), two ways to measure it:

* CPU: each variant in a fresh process (``python -m rlpad.bench.head_memory {full|chunked} TOKENS
  HIDDEN VOCAB CHUNK`` prints one JSON line), peak RSS (VmHWM) growth over the RSS after the
  inputs were allocated, after a small warm-up (:func:`measure_in_subprocess`);
* CUDA: ``torch.cuda.max_memory_allocated`` growth over the memory the inputs hold (:func:`measure_cuda`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import torch

from rlpad.bench.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rlpad.core.logprob import chunked_log_probs_and_entropy, chunked_log_probs_at, log_probs_and_entropy
from rlpad.core.topk import teacher_topk

__all__ = ["DISTILL_TOPK", "DISTILL_VARIANTS", "VARIANTS", "head_fwd_bwd", "head_inputs", "measure_cuda",
           "measure_in_subprocess"]

VARIANTS = ("full", "chunked")
# distillation (forward_kl_topk): the teacher's top-k, forward only; the student's log-probs at k ids, fwd+bwd
DISTILL_VARIANTS = ("topk_full", "topk_chunked", "at_ids_full", "at_ids_chunked")
DISTILL_TOPK = 64


def head_inputs(tokens: int, hidden: int, vocab: int, *, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden (T, H), weight (V, H), labels (T,))``, the gradient buffers already allocated (both
    variants have them)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, device=device, dtype=dtype) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    return h, w, labels


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp64 stays fp64), as the chunked heads compute."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _with_tail(log_softmax: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The full-logits twin of the chunked heads' ``(N, k + 1)``: log-probs at ``ids``, then the rest's log-mass."""
    outside = torch.ones_like(log_softmax, dtype=torch.bool).scatter_(-1, ids, False)
    rest = torch.where(outside, log_softmax, float("-inf")).logsumexp(-1, keepdim=True)
    return torch.cat([log_softmax.gather(-1, ids), rest], dim=-1)


def head_fwd_bwd(variant: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> float:
    """Log-prob + entropy through the head, then backward of their sum; returns the sum."""
    if variant.startswith("topk_"):
        with torch.no_grad():
            if variant == "topk_full":
                full = _fp32(hidden @ weight.T).log_softmax(-1)
                top = _with_tail(full, full.topk(DISTILL_TOPK, dim=-1).indices)
            else:
                top = teacher_topk(hidden, weight, DISTILL_TOPK, token_chunk=chunk)[1]
        return float(top.sum())
    if variant.startswith("at_ids_"):
        ids = (labels[:, None] + torch.arange(DISTILL_TOPK, device=labels.device)) % weight.shape[0]
        if variant == "at_ids_full":
            at = _with_tail(_fp32(hidden @ weight.T).log_softmax(-1), ids)
        else:
            at = chunked_log_probs_at(hidden, weight, ids, chunk_size=chunk)[0]
        at.sum().backward()
        return float(at.detach().sum())
    if variant == "full":
        lp, ent = log_probs_and_entropy(hidden @ weight.T, labels)
    elif variant == "chunked":
        lp, ent = chunked_log_probs_and_entropy(hidden, weight, labels, chunk_size=chunk)
    else:
        raise ValueError(f"unknown memory variant {variant!r}; use one of {VARIANTS + DISTILL_VARIANTS}")
    total = lp.sum() + ent.sum()
    total.backward()
    return float(total.detach())


def _cpu_main(variant: str, tokens: int, hidden: int, vocab: int, chunk: int) -> dict[str, Any]:
    """The CPU measurement in THIS process (meant to be a fresh one)."""
    # A small warm-up first: the math libraries' one-time buffers are not part of either variant's peak.
    head_fwd_bwd(variant, *head_inputs(8, hidden, 64, device=torch.device("cpu"), dtype=torch.float32), min(chunk, 8))
    h, w, labels = head_inputs(tokens, hidden, vocab, device=torch.device("cpu"), dtype=torch.float32)
    reset_peak_rss()
    base = rss_bytes()
    start = time.perf_counter()
    checksum = head_fwd_bwd(variant, h, w, labels, chunk)
    seconds = time.perf_counter() - start
    return {"variant": variant, "tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk": chunk,
            "peak_gib": max(peak_rss_bytes() - base, 0) / 2**30, "seconds": seconds, "checksum": checksum}


def measure_in_subprocess(variant: str, *, tokens: int = 4096, hidden: int = 896, vocab: int = 151936,
                          chunk: int = 256) -> dict[str, Any]:
    """Run one CPU variant in a fresh process; returns its peak RSS growth (``peak_gib``)."""
    if variant not in VARIANTS + DISTILL_VARIANTS:
        raise ValueError(f"unknown memory variant {variant!r}; use one of {VARIANTS + DISTILL_VARIANTS}")
    cmd = [sys.executable, "-m", "rlpad.bench.head_memory", variant, str(tokens), str(hidden), str(vocab), str(chunk)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_cuda(variant: str, device: torch.device, *, tokens: int = 4096, hidden: int = 896, vocab: int = 151936,
                 chunk: int = 256, seed: int = 0) -> dict[str, Any]:
    """Peak CUDA memory above the inputs of one variant in bf16 (``peak_gib``)."""
    if variant not in VARIANTS + DISTILL_VARIANTS:
        raise ValueError(f"unknown memory variant {variant!r}; use one of {VARIANTS + DISTILL_VARIANTS}")
    h, w, labels = head_inputs(tokens, hidden, vocab, device=device, dtype=torch.bfloat16, seed=seed)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    checksum = head_fwd_bwd(variant, h, w, labels, chunk)
    torch.cuda.synchronize(device)
    out = {"variant": variant, "tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk": chunk,
           "peak_gib": (torch.cuda.max_memory_allocated(device) - base) / 2**30,
           "seconds": time.perf_counter() - start, "checksum": checksum}
    del h, w, labels
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    name, *numbers = sys.argv[1:]
    print(json.dumps(_cpu_main(name, *map(int, numbers))))
