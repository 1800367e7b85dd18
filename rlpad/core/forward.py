"""Per-token log-probs and entropies of the response tokens of a rollout batch.

Rollout layout (see docs/design.md): ``input_ids = cat(left-padded prompt, right-padded
response)`` of shape (B, S), the last ``response_length`` columns being the response. Response
token t (column S-R+t) is scored by the hidden state at column S-R+t-1.

Two paths, equal per token:

* padded: one (B, S) forward with the padding mask;
* remove-padding: the valid tokens packed into one (1, nnz) row, position ids restarting at 0
  per sequence, ``cu_seqlens`` telling the varlen attention where sequences end, and the LM
  head run only on the hidden states that score a valid response token; results are scattered
  back to (B, R) with :func:`rlpad.core.padding.pad_input`.
"""

from __future__ import annotations

import torch
from torch import nn

from rlpad.core.attention import VARLEN_IMPLEMENTATIONS
from rlpad.core.logprob import chunked_log_probs_and_entropy, log_probs_and_entropy
from rlpad.core.padding import index_first_axis, pad_input, unpad_input, validate_attention_mask

__all__ = ["LogProbModel", "compute_log_probs", "position_ids_from_mask", "validate_rollout_batch"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``clamp(cumsum(mask) - 1, min=0)``: positions restart at 0 at each row's first valid token."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def validate_rollout_batch(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
) -> None:
    """Raise ValueError/TypeError naming the problem with a rollout batch, before any compute."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D (batch, seq) tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"shapes disagree: attention_mask {tuple(getattr(attention_mask, 'shape', ()))} vs input_ids {tuple(input_ids.shape)}"
        )
    if position_ids is not None and tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(f"shapes disagree: position_ids {tuple(position_ids.shape)} vs input_ids {tuple(input_ids.shape)}")
    seqlen = input_ids.shape[1]
    if isinstance(response_length, bool) or not isinstance(response_length, int):
        raise TypeError(f"response_length must be an int, got {type(response_length).__name__}")
    if not 1 <= response_length < seqlen:
        raise ValueError(
            f"response_length={response_length} must be in [1, {seqlen - 1}]: the sequence has {seqlen} "
            "columns and at least one must be a prompt column"
        )
    validate_attention_mask(attention_mask)
    no_prompt = (attention_mask[:, seqlen - response_length - 1] == 0).nonzero().flatten()
    if no_prompt.numel():
        raise ValueError(
            f"row(s) {no_prompt.tolist()[:8]}: the last prompt column is padding; prompts must be "
            "left-padded and non-empty"
        )
    vocab = model.get_input_embeddings().num_embeddings
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        bad = ((input_ids < 0) | (input_ids >= vocab)).nonzero()[0].tolist()
        raise ValueError(
            f"token ids must be in [0, {vocab}) (the model's vocabulary); found {input_ids[bad[0], bad[1]].item()} "
            f"at row {bad[0]}, column {bad[1]}"
        )


def _backbone(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def _head_log_probs(model, hidden, labels, temperature, calculate_entropy, chunk_size):
    """Run the LM head on ``hidden (N, H)`` and score ``labels (N,)``."""
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise NotImplementedError("models with logit soft-capping or logit scaling are not supported yet")
    head = model.get_output_embeddings()
    if chunk_size is None:
        return log_probs_and_entropy(head(hidden), labels, temperature, calculate_entropy)
    return chunked_log_probs_and_entropy(
        hidden, head.weight, labels, bias=head.bias, temperature=temperature,
        chunk_size=chunk_size, calculate_entropy=calculate_entropy,
    )


def compute_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    use_remove_padding: bool,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    logits_chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of the response tokens and, if asked, entropies (B, R); zero on padding.

    Differentiable. ``use_remove_padding`` picks the packed (1, nnz) forward, which needs the model
    to use a varlen attention (``rlpad_varlen`` or flash_attention_2, see :mod:`rlpad.core.attention`).
    ``logits_chunk_size`` runs the LM head that many tokens at a time (see :mod:`rlpad.core.logprob`).
    """
    validate_rollout_batch(model, input_ids, attention_mask, position_ids, response_length)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_chunk_size is not None and logits_chunk_size < 1:
        raise ValueError(f"logits_chunk_size must be >= 1 or None, got {logits_chunk_size}")
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    batch, seqlen = input_ids.shape
    prompt_length = seqlen - response_length
    response_mask = attention_mask[:, prompt_length:].bool()
    score = dict(temperature=temperature, calculate_entropy=calculate_entropy, chunk_size=logits_chunk_size)

    if not use_remove_padding:
        hidden = _backbone(model)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        hidden = hidden[:, prompt_length - 1 : seqlen - 1].reshape(batch * response_length, -1)
        labels = input_ids[:, prompt_length:].reshape(-1)
        log_probs, entropy = _head_log_probs(model, hidden, labels, **score)
        keep = response_mask.reshape(-1)
        log_probs = torch.where(keep, log_probs, 0.0).view(batch, response_length)
        entropy = torch.where(keep, entropy, 0.0).view(batch, response_length) if calculate_entropy else None
        return log_probs, entropy

    impl = model.config._attn_implementation
    if impl not in VARLEN_IMPLEMENTATIONS:
        raise ValueError(
            f"use_remove_padding=True needs a varlen attention ({sorted(VARLEN_IMPLEMENTATIONS)}), the model uses "
            f"{impl!r}; load it with rlpad.core.models.load_causal_lm or call rlpad.core.attention.set_varlen_attention(model)"
        )
    ids, indices, cu_seqlens, max_seqlen, _ = unpad_input(input_ids.unsqueeze(-1), attention_mask)
    packed_positions = index_first_axis(position_ids.reshape(-1, 1), indices)
    hidden = _backbone(model)(
        input_ids=ids.view(1, -1),
        position_ids=packed_positions.view(1, -1),
        attention_mask=None,
        use_cache=False,
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=max_seqlen,
        max_length_k=max_seqlen,
    ).last_hidden_state[0]
    # Valid response token (b, t) is scored by the hidden state of token (b, prompt_length + t - 1),
    # a valid token of the same sequence; find its slot in the packed row.
    response_idx = response_mask.reshape(-1).nonzero().flatten()
    rows, cols = response_idx // response_length, response_idx % response_length
    packed_slot = torch.full((batch * seqlen,), -1, dtype=torch.long, device=ids.device)
    packed_slot[indices] = torch.arange(indices.numel(), device=ids.device)
    scoring = packed_slot[rows * seqlen + prompt_length - 1 + cols]
    labels = input_ids[rows, prompt_length + cols]
    log_probs, entropy = _head_log_probs(model, hidden.index_select(0, scoring), labels, **score)
    log_probs = pad_input(log_probs.unsqueeze(-1), response_idx, batch, response_length).squeeze(-1)
    if calculate_entropy:
        entropy = pad_input(entropy.unsqueeze(-1), response_idx, batch, response_length).squeeze(-1)
    return log_probs, entropy


class LogProbModel(nn.Module):
    """A module whose forward is :func:`compute_log_probs` on the wrapped causal LM.

    FSDP wraps this as its root so the root's parameters (embeddings, final norm, LM head) are
    gathered around the whole computation, the chunked LM head included.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, response_length, **kwargs):
        return compute_log_probs(self.model, input_ids, attention_mask, position_ids, response_length, **kwargs)
