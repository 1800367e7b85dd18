"""A teacher's top-k next-token ids and log-probs from hidden states, in vocabulary chunks.

For on-policy distillation's ``forward_kl_topk`` (docs/distillation.md): per scored position the k
most likely ids under the teacher and their log-probs, without ever forming the (N, V) logits. The
LM head runs ``token_chunk`` tokens x ``vocab_chunk`` vocabulary rows at a time; per token a running
top-k (the chunk's logits merged with the best k so far) and a running log-sum-exp (max and the sum
of exp(z - max), rescaled when the max grows) cross the vocabulary once. Peak extra memory is one
``token_chunk x (vocab_chunk + k)`` fp32 block. No gradient: the teacher is frozen.

The student's log-probs at these ids come from the chunked head of :mod:`rlpad.core.logprob`
(:func:`rlpad.core.logprob.chunked_log_probs_at`), differentiable.
"""

from __future__ import annotations

import torch

from rlpad.core.lm_head import mm_fp32

__all__ = ["check_topk", "teacher_topk"]


def check_topk(topk: int, vocab_size: int) -> None:
    """ValueError unless ``1 <= topk <= vocab_size``."""
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= vocab_size:
        raise ValueError(f"topk must be an int in [1, {vocab_size}] (the vocabulary), got {topk!r}")


@torch.no_grad()
def teacher_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk: int,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    token_chunk: int = 1024,
    vocab_chunk: int = 16384,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (N, k) int64, log_probs (N, k))``: the ``topk`` largest log-softmax entries of
    ``hidden (N, H) @ weight (V, H).T (+ bias) / temperature`` per row, largest first.

    Log-probs are fp32 (fp64 for fp64 inputs); bf16 / fp16 operands give fp32 logits
    (:func:`rlpad.core.lm_head.mm_fp32`). ``weight`` may be a row slice of a padded head (the
    tokenizer's ids only): the softmax is then over those rows.
    """
    vocab = weight.shape[0]
    check_topk(topk, vocab)
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be (N, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"token_chunk and vocab_chunk must be >= 1, got {token_chunk} and {vocab_chunk}")
    acc = torch.promote_types(hidden.dtype, torch.float32)
    n = hidden.shape[0]
    out_ids = torch.empty(n, topk, dtype=torch.int64, device=hidden.device)
    out_lp = torch.empty(n, topk, dtype=acc, device=hidden.device)
    for s in range(0, n, token_chunk):
        h = hidden[s : s + token_chunk]
        rows = h.shape[0]
        best = torch.full((rows, topk), float("-inf"), dtype=acc, device=h.device)
        best_ids = torch.zeros(rows, topk, dtype=torch.int64, device=h.device)
        run_max = torch.full((rows,), float("-inf"), dtype=acc, device=h.device)
        run_sum = torch.zeros(rows, dtype=acc, device=h.device)
        for v in range(0, vocab, vocab_chunk):
            w = weight[v : v + vocab_chunk]
            z = mm_fp32(h, w.t()).to(acc)
            if bias is not None:
                z.add_(bias[v : v + vocab_chunk].to(acc))
            if temperature != 1.0:
                z.div_(temperature)
            # the log-sum-exp, online: rescale the running sum when the max grows
            new_max = torch.maximum(run_max, z.amax(dim=-1))
            run_sum.mul_(torch.exp(run_max - new_max)).add_(torch.exp(z - new_max[:, None]).sum(dim=-1))
            run_max = new_max
            # the running top-k: merge this chunk's logits with the best k so far
            chunk_ids = torch.arange(v, v + w.shape[0], device=h.device).expand(rows, -1)
            merged, where = torch.cat([best, z], dim=-1).topk(topk, dim=-1)
            best_ids = torch.cat([best_ids, chunk_ids], dim=-1).gather(-1, where)
            best = merged
        out_ids[s : s + rows] = best_ids
        out_lp[s : s + rows] = best - (run_max + run_sum.log())[:, None]
    return out_ids, out_lp
