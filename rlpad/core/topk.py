"""A teacher's top-k next-token ids, their log-probs and the tail bucket's, from hidden states in vocabulary chunks.

For on-policy distillation's ``forward_kl_topk`` (docs/distillation.md): per scored position the k
most likely ids under the teacher, their log-probs and the log of the mass outside them (the tail
bucket), without ever forming the (N, V) logits. The LM head runs ``token_chunk`` tokens x
``vocab_chunk`` vocabulary rows at a time; per token a running top-k (the chunk's logits merged with
the best k so far) and a running sum of ``exp(z - max)`` over every entry NOT in it (an entry the
merge evicts joins it; rescaled when the max grows) cross the vocabulary once. The tail is that
sum's log, not ``log(1 - sum_k p_k)``: exact for any tail mass down to fp32's 1e-38, 1e-30 as 0.5
(the subtraction loses everything once the top-k mass rounds to 1). Peak extra memory is a few
``token_chunk x (vocab_chunk + k)`` fp32 blocks. No gradient: the teacher is frozen.

The student's log-probs at these ids and its own tail come from the chunked head of
:mod:`rlpad.core.logprob` (:func:`rlpad.core.logprob.chunked_log_probs_at`), differentiable.
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
    candidates: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (N, k) int32, log_probs (N, k + 1))``: the ``topk`` largest log-softmax entries of
    ``hidden (N, H) @ weight (V, H).T (+ bias) / temperature`` per row, largest first, then the log of
    the mass outside them (-inf when nothing is: k = V).

    The softmax is over all V rows; the ids are chosen among the first ``candidates`` rows (None: all;
    a padded head's tokenizer ids: its padding rows count in the tail, never in the top-k). Log-probs
    are fp32 (fp64 for fp64 inputs); bf16 / fp16 operands give fp32 logits (:func:`rlpad.core.lm_head.mm_fp32`).
    """
    vocab = weight.shape[0]
    candidates = vocab if candidates is None else candidates
    if isinstance(candidates, bool) or not isinstance(candidates, int) or not 1 <= candidates <= vocab:
        raise ValueError(f"candidates must be an int in [1, {vocab}] (the head's rows), got {candidates!r}")
    check_topk(topk, candidates)
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be (N, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"token_chunk and vocab_chunk must be >= 1, got {token_chunk} and {vocab_chunk}")
    acc = torch.promote_types(hidden.dtype, torch.float32)
    n = hidden.shape[0]
    out_ids = torch.empty(n, topk, dtype=torch.int32, device=hidden.device)
    out_lp = torch.empty(n, topk + 1, dtype=acc, device=hidden.device)
    for s in range(0, n, token_chunk):
        h = hidden[s : s + token_chunk]
        rows = h.shape[0]
        best = torch.full((rows, topk), float("-inf"), dtype=acc, device=h.device)
        best_ids = torch.zeros(rows, topk, dtype=torch.int64, device=h.device)
        run_max = torch.full((rows,), float("-inf"), dtype=acc, device=h.device)
        rest = torch.zeros(rows, dtype=acc, device=h.device)  # sum of exp(z - run_max) outside ``best``
        for v in range(0, vocab, vocab_chunk):
            w = weight[v : v + vocab_chunk]
            z = mm_fp32(h, w.t()).to(acc)
            if bias is not None:
                z.add_(bias[v : v + vocab_chunk].to(acc))
            if temperature != 1.0:
                z.div_(temperature)
            new_max = torch.maximum(run_max, z.amax(dim=-1))
            rest.mul_(torch.exp(run_max - new_max))  # 0 on the first chunk (run_max -inf)
            run_max = new_max
            cut = max(0, min(w.shape[0], candidates - v))  # columns that may enter the top-k
            if cut < w.shape[0]:  # past the candidates (a padded head's rows): straight to the tail
                rest.add_(torch.exp(z[:, cut:] - run_max[:, None]).sum(dim=-1))
            if cut == 0:
                continue
            chunk_ids = torch.arange(v, v + cut, device=h.device).expand(rows, -1)
            both = torch.cat([best, z[:, :cut]], dim=-1)
            best, where = both.topk(topk, dim=-1)
            best_ids = torch.cat([best_ids, chunk_ids], dim=-1).gather(-1, where)
            evicted = torch.exp(both - run_max[:, None]).scatter_(-1, where, 0.0)  # what the merge left out
            rest.add_(evicted.sum(dim=-1))
        lse = run_max + torch.log(rest + torch.exp(best - run_max[:, None]).sum(dim=-1))
        out_ids[s : s + rows] = best_ids
        out_lp[s : s + rows, :topk] = best - lse[:, None]
        out_lp[s : s + rows, topk] = torch.log(rest) + run_max - lse
    return out_ids, out_lp
