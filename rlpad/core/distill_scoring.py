"""What on-policy distillation reads from the packed row, beside the log-probs of the sampled tokens.

* :func:`compute_teacher_topk`: the teacher's top-k next-token ids and log-probs at every scored
  response position, ``(B, R, k)`` each, the LM head run in vocabulary chunks
  (:func:`rlpad.core.topk.teacher_topk`, never an (N, V) tensor);
* :func:`compute_log_probs_at`: the student's log-probs at given ids per position (the teacher's
  top-k), ``(B, R, K)``, differentiable, through the chunked head of :mod:`rlpad.core.logprob`.

The teacher's log-probs of the sampled tokens are :func:`rlpad.core.forward.compute_log_probs` on the
teacher model, the reference model's path. Both functions here take the same hidden states as it
(:func:`rlpad.core.forward.scoring_hidden_states`: padded, packed, shared prompts, sequence
parallelism) and the same batch arguments. ``vocab_size``: score over the first ``vocab_size`` rows
of the head only (the tokenizer's ids, when the embedding is padded past them: Qwen's 152064 vs
151936), so a teacher and a student with different padding share one distribution's support.
"""

from __future__ import annotations

import torch
from torch import nn

from rlpad.core.forward import backbone_of, check_model_inputs, head_log_probs, scoring_hidden_states
from rlpad.core.logprob import chunked_log_probs_at
from rlpad.core.sequence_parallel import SequenceParallel, active
from rlpad.core.padding import pad_input
from rlpad.core.topk import check_topk, teacher_topk

__all__ = ["compute_log_probs_and_at", "compute_log_probs_at", "compute_teacher_topk", "head_rows"]


def head_rows(model: nn.Module, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight (V', H), bias (V',) | None)``: the LM head's first ``vocab_size`` rows (all if None)."""
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise NotImplementedError("models with logit soft-capping or logit scaling are not supported yet")
    head = model.get_output_embeddings()
    rows = head.weight.shape[0]
    if vocab_size is None:
        return head.weight, head.bias
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= rows:
        raise ValueError(f"vocab_size must be an int in [1, {rows}] (the LM head's rows), got {vocab_size!r}")
    bias = head.bias[:vocab_size] if head.bias is not None else None
    return head.weight[:vocab_size], bias


def _grid(values: torch.Tensor, response_idx: torch.Tensor, batch: int, response_length: int,
          sp: SequenceParallel | None) -> torch.Tensor:
    """``(N, K)`` values of the tokens at flat ``response_idx`` -> ``(batch, response_length, K)``, zero
    elsewhere; with ``sp`` every rank's (one nonzero contribution per token: the sum is exact)."""
    grid = pad_input(values, response_idx, batch, response_length)
    return grid if active(sp) is None else sp.gather_scored(grid)


def _hidden(model, input_ids, attention_mask, position_ids, response_length, check, kw):
    if check:
        check_model_inputs(model, input_ids, attention_mask, position_ids, response_length,
                           use_remove_padding=kw["use_remove_padding"], share_prompts=kw.get("share_prompts", False),
                           sp=kw.get("sp"), response_mask=kw.get("response_mask"),
                           multi_modal_inputs=kw.get("multi_modal_inputs"))  # fmt: skip
    return scoring_hidden_states(backbone_of(model), input_ids, attention_mask, position_ids, response_length, **kw)


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
    """``(ids (B, R, k) int64, log_probs (B, R, k))``: the teacher's ``topk`` most likely next tokens
    at each scored response position (zero elsewhere), largest first. ``scoring``: the batch keywords
    of :func:`rlpad.core.forward.compute_log_probs` (``use_remove_padding``, ``share_prompts``, ``sp``,
    ``host``, ``share_min_saved``, ``response_mask``). ``logits_chunk_size`` tokens (None: 1024) x
    ``vocab_chunk_size`` vocabulary rows per LM-head block."""
    weight, bias = head_rows(model, vocab_size)
    check_topk(topk, weight.shape[0])
    with torch.no_grad():
        hidden, response_idx = _hidden(model, input_ids, attention_mask, position_ids, response_length, check, scoring)
        ids, log_probs = teacher_topk(hidden, weight, topk, bias=bias, temperature=temperature,
                                      token_chunk=logits_chunk_size or 1024, vocab_chunk=vocab_chunk_size)
    batch, sp = input_ids.shape[0], scoring.get("sp")
    return _grid(ids, response_idx, batch, response_length, sp), _grid(log_probs, response_idx, batch, response_length, sp)


def compute_log_probs_at(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    ids: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    logits_chunk_size: int | None = None,
    check: bool = True,
    **scoring,
) -> torch.Tensor:
    """Log-probs ``(B, R, K)`` of ``ids (B, R, K)`` at each scored response position (zero elsewhere),
    differentiable, the softmax over the head's first ``vocab_size`` rows. ``scoring`` as
    :func:`compute_teacher_topk`; ``logits_chunk_size`` tokens per head chunk (None: all at once)."""
    batch = input_ids.shape[0]
    if ids.dim() != 3 or ids.shape[:2] != (batch, response_length):
        raise ValueError(f"ids must be (B, R, K) = ({batch}, {response_length}, K), got {tuple(ids.shape)}")
    weight, bias = head_rows(model, vocab_size)
    hidden, response_idx = _hidden(model, input_ids, attention_mask, position_ids, response_length, check, scoring)
    at = ids.reshape(batch * response_length, -1)[response_idx]
    log_probs = chunked_log_probs_at(hidden, weight, at, bias=bias, temperature=temperature,
                                     chunk_size=logits_chunk_size or max(hidden.shape[0], 1))
    return _grid(log_probs, response_idx, batch, response_length, scoring.get("sp"))


def compute_log_probs_and_at(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    at_ids: torch.Tensor,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    logits_chunk_size: int | None = None,
    check: bool = True,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The student's update forward for ``forward_kl_topk``: ``(log_probs (B, R), entropy (B, R) | None,
    log-probs at at_ids (B, R, K))`` from ONE forward of the decoder; the sampled tokens through the
    model's own head (as :func:`rlpad.core.forward.compute_log_probs`, so they equal the old log-probs),
    ``at_ids`` through the chunked head over the first ``vocab_size`` rows."""
    batch = input_ids.shape[0]
    if at_ids.dim() != 3 or at_ids.shape[:2] != (batch, response_length):
        raise ValueError(f"at_ids must be (B, R, K) = ({batch}, {response_length}, K), got {tuple(at_ids.shape)}")
    weight, bias = head_rows(model, vocab_size)
    hidden, response_idx = _hidden(model, input_ids, attention_mask, position_ids, response_length, check, scoring)
    sp = scoring.get("sp")
    labels = input_ids[:, -response_length:].reshape(-1)[response_idx]
    log_probs, entropy = head_log_probs(model, hidden, labels, temperature, calculate_entropy, logits_chunk_size)
    at = chunked_log_probs_at(hidden, weight, at_ids.reshape(batch * response_length, -1)[response_idx], bias=bias,
                              temperature=temperature, chunk_size=logits_chunk_size or max(hidden.shape[0], 1))
    grid = lambda x: _grid(x[:, None], response_idx, batch, response_length, sp)[..., 0]  # noqa: E731
    return grid(log_probs), grid(entropy) if calculate_entropy else None, _grid(at, response_idx, batch, response_length, sp)
