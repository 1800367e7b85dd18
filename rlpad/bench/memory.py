"""One memory variant of ``rlpad bench logprob``, run in its own process.

``python -m rlpad.bench.memory {full|chunked} TOKENS HIDDEN VOCAB CHUNK`` prints one JSON line:
the growth of peak RSS over the RSS after the inputs were allocated.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

from rlpad.core.logprob import chunked_log_probs_and_entropy, log_probs_and_entropy


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    """VmHWM: this process's own peak RSS (ru_maxrss would carry the parent's over fork + exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main(variant: str, tokens: int, hidden_size: int, vocab: int, chunk: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    weight.grad = torch.zeros_like(weight)  # the gradient buffers exist in both variants
    hidden.grad = torch.zeros_like(hidden)
    base = _rss_bytes()
    start = time.perf_counter()
    if variant == "full":
        lp, ent = log_probs_and_entropy(hidden @ weight.T, labels)
    elif variant == "chunked":
        lp, ent = chunked_log_probs_and_entropy(hidden, weight, labels, chunk_size=chunk)
    else:
        raise ValueError(f"unknown memory variant {variant!r}; use full or chunked")
    (lp.sum() + ent.sum()).backward()
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    return {"variant": variant, "tokens": tokens, "hidden": hidden_size, "vocab": vocab, "chunk": chunk,
            "peak_gib": max(peak - base, 0) / 2**30, "seconds": seconds,
            "checksum": float((lp.sum() + ent.sum()).detach())}


if __name__ == "__main__":
    variant, *numbers = sys.argv[1:]
    print(json.dumps(main(variant, *map(int, numbers))))
