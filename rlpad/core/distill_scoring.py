"""What on-policy distillation reads from the packed row, beside the log-probs of the sampled tokens.

* :func:`compute_teacher_topk`: the teacher's top-k next-token ids and log-probs, and its tail bucket's
  log-mass, at every scored response position, the LM head run in vocabulary chunks
  (:func:`rlpad.core.topk.teacher_topk`, never an (N, V) tensor);
* :func:`compute_student_topk`: the student's log-probs of its sampled tokens, its entropy, and its
  log-probs at the teacher's ids and its own tail, differentiable, from ONE pass of the chunked head
  (:func:`rlpad.core.logprob.chunked_log_probs_at`).

JAGGED LAYOUT: the teacher's numbers exist for the scored positions only (``response_mask`` 1, or the
valid response tokens), listed row after row, column order inside a row: ``(n, k)`` for a batch with n
scored positions (:func:`scored_mask`, :func:`jagged_positions`). The workers keep them per row
(:func:`split_rows`), so a rank receives its rows' only. Ids are int32; log-probs ``(n, k + 1)``, the
tail last. The softmax of each model is over its whole head (a padded head's extra rows fall in the
tail); the ids are chosen among the first ``vocab_size`` rows (the tokenizer's ids), which both heads have.

Both functions take the hidden states of :func:`rlpad.core.forward.scoring_hidden_states` (padded,
packed, shared prompts, sequence parallelism) and the same batch arguments. With sequence parallelism
the teacher's positions are gathered over the group; the student's stay on the rank that scored them
(its per-token losses are summed over the group as (B, R) grids: no (B, R, k) tensor is exchanged).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rlpad.core.forward import backbone_of, check_model_inputs, scoring_hidden_states
from rlpad.core.lm_head import chunk_tokens
from rlpad.core.logprob import chunked_log_probs_at
from rlpad.core.sequence_parallel import SequenceParallel, active, response_grid
from rlpad.core.topk import check_topk, teacher_topk

__all__ = ["compute_student_topk", "compute_teacher_topk", "head_of", "jagged_positions", "join_rows",
           "scored_mask", "split_rows"]


def head_of(model: nn.Module, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``(weight (V, H), bias (V,) | None, candidates)``: the LM head and how many of its first rows are
    token ids (``vocab_size``; None: all), the ones a top-k may choose."""
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise NotImplementedError("models with logit soft-capping or logit scaling are not supported yet")
    head = model.get_output_embeddings()
    rows = head.weight.shape[0]
    if vocab_size is None:
        return head.weight, head.bias, rows
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= rows:
        raise ValueError(f"vocab_size must be an int in [1, {rows}] (the LM head's rows), got {vocab_size!r}")
    return head.weight, head.bias, vocab_size


def scored_mask(attention_mask: torch.Tensor, response_length: int,
                response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, R)`` bool: the response positions the scoring core scores (``response_mask``, else the valid ones)."""
    return (response_mask if response_mask is not None else attention_mask[:, -response_length:]).bool()


def jagged_positions(scored: torch.Tensor, response_idx: torch.Tensor) -> torch.Tensor:
    """Where the tokens at flat ``response_idx`` (into ``(B, R)``) sit in the jagged layout of ``scored``."""
    return (scored.flatten().cumsum(0) - 1)[response_idx]


def split_rows(flat: torch.Tensor, scored: torch.Tensor) -> np.ndarray:
    """A jagged ``(n, ...)`` tensor -> one tensor per row (an object array, as :class:`rlpad.batch.Batch`
    keeps per-row fields): row b's ``scored[b].sum()`` positions, each its own storage (a view would
    pickle the whole batch's)."""
    rows = np.empty(scored.shape[0], dtype=object)
    for i, t in enumerate(torch.split(flat, scored.sum(-1).tolist())):  # one by one: numpy would stack equal shapes
        rows[i] = t.clone()
    return rows


def join_rows(rows: np.ndarray | list) -> torch.Tensor:
    """The inverse of :func:`split_rows`: the rows' tensors one after another."""
    return torch.cat(list(rows))


def _hidden(model, input_ids, attention_mask, position_ids, response_length, check, kw):
    if check:
        check_model_inputs(model, input_ids, attention_mask, position_ids, response_length,
                           use_remove_padding=kw["use_remove_padding"], share_prompts=kw.get("share_prompts", False),
                           sp=kw.get("sp"), response_mask=kw.get("response_mask"),
                           multi_modal_inputs=kw.get("multi_modal_inputs"))  # fmt: skip
    return scoring_hidden_states(backbone_of(model), input_ids, attention_mask, position_ids, response_length, **kw)


def _in_row_order(sp: SequenceParallel | None, response_idx: torch.Tensor, *values: torch.Tensor) -> list[torch.Tensor]:
    """``values`` (N, ...) of the tokens at ``response_idx`` in row-major order of their positions; with
    ``sp`` every rank's tokens (an all-gather over the group: each position is scored on one rank)."""
    if active(sp) is not None:
        count = torch.tensor([response_idx.numel()], device=response_idx.device)
        counts = [torch.zeros_like(count) for _ in range(sp.size)]
        dist.all_gather(counts, count, group=sp.group)
        most = max(int(c) for c in counts)
        if most == 0:  # nothing scored anywhere in the group (an empty exchange is not every backend's)
            return list(values)
        gathered = []
        for x in (response_idx, *values):
            padded = x.new_zeros(most, *x.shape[1:])
            padded[: x.shape[0]] = x
            parts = [torch.empty_like(padded) for _ in range(sp.size)]
            dist.all_gather(parts, padded, group=sp.group)
            gathered.append(torch.cat([p[: int(c)] for p, c in zip(parts, counts)]))
        response_idx, values = gathered[0], gathered[1:]
    order = torch.argsort(response_idx)
    return [v[order] for v in values]


def compute_teacher_topk(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    topk: int,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    logits_chunk_size: int | None = None,
    vocab_chunk_size: int = 16384,
    check: bool = True,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (n, k) int32, log_probs (n, k + 1))`` in the jagged layout: the teacher's ``topk`` most likely
    next tokens at each of the batch's n scored positions, largest first, their log-probs and the tail's
    (the mass outside them). ``scoring``: the batch keywords of :func:`rlpad.core.forward.compute_log_probs`
    (``use_remove_padding``, ``share_prompts``, ``sp``, ``host``, ``share_min_saved``, ``response_mask``).
    ``logits_chunk_size`` tokens (None: :func:`rlpad.core.lm_head.chunk_tokens`'s byte budget) x
    ``vocab_chunk_size`` vocabulary rows per LM-head block."""
    weight, bias, candidates = head_of(model, vocab_size)
    check_topk(topk, candidates)
    with torch.no_grad():
        hidden, response_idx = _hidden(model, input_ids, attention_mask, position_ids, response_length, check, scoring)
        ids, log_probs = teacher_topk(hidden, weight, topk, bias=bias, temperature=temperature, candidates=candidates,
                                      token_chunk=chunk_tokens(logits_chunk_size, vocab_chunk_size + topk),
                                      vocab_chunk=vocab_chunk_size)
        ids, log_probs = _in_row_order(scoring.get("sp"), response_idx, ids, log_probs)
    return ids, log_probs


def compute_student_topk(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    at_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    logits_chunk_size: int | None = None,
    check: bool = True,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A ``forward_kl_topk`` student's forward: ``(log_probs (B, R), entropy (B, R) | None, at (N, K + 1),
    response_idx (N,))`` from ONE forward of the decoder and ONE pass of its LM head (chunks of
    ``logits_chunk_size`` tokens, None: the byte budget of :func:`rlpad.core.lm_head.chunk_tokens`).

    ``log_probs`` / ``entropy``: of the sampled tokens, zero elsewhere (with sequence parallelism every
    rank's, summed over the group). ``at``: for the N tokens this rank scored (at flat ``response_idx``
    into (B, R)), its log-probs at their rows of ``at_ids`` ((n, K) in the jagged layout of the batch,
    the teacher's top-k) and its tail, differentiable; ``at_ids`` None (the old log-probs' pass): (N, 0).
    The sampled tokens' numbers come from the same arithmetic either way (the same chunks, one logsumexp
    per token), so the old log-probs equal the update's bit for bit."""
    weight, bias, _ = head_of(model, None)
    hidden, response_idx = _hidden(model, input_ids, attention_mask, position_ids, response_length, check, scoring)
    batch, sp = input_ids.shape[0], scoring.get("sp")
    labels = input_ids[:, -response_length:].reshape(-1)[response_idx]
    if at_ids is None:
        ids = labels.new_zeros(labels.shape[0], 0)
    else:
        scored = scored_mask(attention_mask, response_length, scoring.get("response_mask"))
        host = scoring.get("host")  # the count from the host copy when there is one: no device read
        n = int((scored_mask(host.attention_mask, response_length, host.response_mask) if host is not None
                 else scored).sum())
        if at_ids.dim() != 2 or at_ids.shape[0] != n:
            raise ValueError(f"at_ids must be (n, K) with n = the batch's {n} scored positions, got {tuple(at_ids.shape)}")
        ids = at_ids[jagged_positions(scored, response_idx)]
    at, log_probs, entropy = chunked_log_probs_at(
        hidden, weight, ids, labels=labels, bias=bias, temperature=temperature,
        chunk_size=chunk_tokens(logits_chunk_size, weight.shape[0]), calculate_entropy=calculate_entropy,
    )  # fmt: skip
    log_probs = response_grid(log_probs, response_idx, batch, response_length, sp)
    entropy = response_grid(entropy, response_idx, batch, response_length, sp) if calculate_entropy else None
    return log_probs, entropy, at, response_idx
