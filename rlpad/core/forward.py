"""Per-token log-probs and entropies of the response tokens of a rollout batch.

Rollout layout (see docs/design.md): ``input_ids = cat(left-padded prompt, right-padded
response)`` of shape (B, S), the last ``response_length`` columns being the response. Response
token t (column S-R+t) is scored by the hidden state at column S-R+t-1.

One scoring core, :func:`scoring_hidden_states`: the hidden states that score the valid response
tokens, by one of two paths, equal per token:

* padded: one (B, S) forward with the padding mask;
* remove-padding: the valid tokens packed into one (1, nnz) row, position ids restarting at 0
  per sequence, ``cu_seqlens`` telling the varlen attention where sequences end.

* shared-prompt (``share_prompts``, on top of remove-padding): rows with an identical prompt
  form a group whose prompt is packed once, followed by each row's response
  (:mod:`rlpad.core.shared_prompt`); the attention reads the group structure from the forward
  keyword ``rlpad_shared_segments`` (:mod:`rlpad.core.shared_attention`).

Either way only the N hidden states that score a valid response token leave the core.
:func:`compute_log_probs` is core + LM head + :func:`rlpad.core.padding.pad_input` back to (B, R);
the critic (:mod:`rlpad.core.value`) is core + value head + the same scatter.
"""

from __future__ import annotations

import torch
from torch import nn

from rlpad.core.attention import BOUNDS_KWARG, PackedBounds
from rlpad.core.attn_choice import require_varlen_attention
from rlpad.core.layout import check_rollout_tensors, position_ids_from_mask
from rlpad.core.logprob import chunked_log_probs_and_entropy, log_probs_and_entropy
from rlpad.core.padding import index_first_axis, pad_input, unpad_input
from rlpad.core.shared_prompt import SEGMENTS_KWARG, pack_shared_prompts

__all__ = ["LogProbModel", "backbone_of", "check_model_inputs", "check_share_prompts", "compute_log_probs",
           "scoring_hidden_states"]


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``model.model`` for Llama-like models)."""
    return getattr(model, model.base_model_prefix)


def check_model_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    use_remove_padding: bool,
    share_prompts: bool = False,
) -> None:
    """All checks of a scoring call, before any compute: the rollout tensors (vocabulary of
    ``model``) and, for remove-padding, that the model runs a varlen attention (``rlpad_varlen``
    for ``share_prompts``, which needs remove-padding)."""
    check_share_prompts(use_remove_padding, share_prompts)
    check_rollout_tensors(model.get_input_embeddings().num_embeddings, input_ids, attention_mask, position_ids,
                          response_length)  # fmt: skip
    if use_remove_padding:
        require_varlen_attention(model, share_prompts=share_prompts)


def check_share_prompts(use_remove_padding: bool, share_prompts: bool) -> None:
    """ValueError when ``share_prompts`` is asked without ``use_remove_padding``."""
    if share_prompts and not use_remove_padding:
        raise ValueError("share_prompts=True needs use_remove_padding=True (the shared prompt lives in the packed row)")


def scoring_hidden_states(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    use_remove_padding: bool,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden (N, H), response_idx (N,))``: the states that score the N valid response tokens and
    their flat indices into ``(B, R)``. Inputs are assumed checked (:func:`check_model_inputs`).

    Valid response token (b, t) is scored by the hidden state of token (b, P + t - 1), a valid
    token of the same sequence (P = S - R): in the packed row that is its slot in the gather; with
    ``share_prompts`` token 0 of every row of a group reads the group's one last prompt token.
    """
    check_share_prompts(use_remove_padding, share_prompts)
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    batch, seqlen = input_ids.shape
    prompt_length = seqlen - response_length
    response_idx = attention_mask[:, prompt_length:].reshape(-1).nonzero().flatten()
    rows, cols = response_idx // response_length, response_idx % response_length
    if not use_remove_padding:
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return hidden[rows, prompt_length - 1 + cols], response_idx
    if share_prompts:
        row = pack_shared_prompts(input_ids, attention_mask, position_ids, response_length)
        hidden = backbone(
            input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=None, use_cache=False,
            **{SEGMENTS_KWARG: row.segments},
        ).last_hidden_state[0]
        return hidden.index_select(0, row.score_index), response_idx
    # The sequence bounds once per forward: cu_seqlens on the device and max_seqlen a Python int
    # for the varlen kernels, PackedBounds for the sdpa path (read from the device on first use).
    ids, indices, cu_seqlens, max_seqlen, _ = unpad_input(input_ids.unsqueeze(-1), attention_mask, validate=False)
    packed_positions = index_first_axis(position_ids.reshape(-1, 1), indices)
    hidden = backbone(
        input_ids=ids.view(1, -1), position_ids=packed_positions.view(1, -1), attention_mask=None, use_cache=False,
        cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen,
        **{BOUNDS_KWARG: PackedBounds(cu_seqlens, ids.shape[0])},
    ).last_hidden_state[0]
    packed_slot = torch.full((batch * seqlen,), -1, dtype=torch.long, device=ids.device)
    packed_slot[indices] = torch.arange(indices.numel(), device=ids.device)
    return hidden.index_select(0, packed_slot[rows * seqlen + prompt_length - 1 + cols]), response_idx


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
    share_prompts: bool = False,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    logits_chunk_size: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of the response tokens and, if asked, entropies (B, R); zero on padding.

    Differentiable. ``use_remove_padding`` picks the packed (1, nnz) forward, which needs the model
    to use a varlen attention (``rlpad_varlen`` or flash_attention_2, see :mod:`rlpad.core.attention`).
    ``share_prompts`` (with remove-padding) packs each distinct prompt once for all its responses
    (:mod:`rlpad.core.shared_prompt`); equal per token, needs the ``rlpad_varlen`` attention.
    ``logits_chunk_size`` runs the LM head that many tokens at a time (see :mod:`rlpad.core.logprob`).
    ``check=False`` skips the input checks for a caller that ran :func:`check_model_inputs` once on
    the whole batch (the workers do, where a batch enters them).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_chunk_size is not None and logits_chunk_size < 1:
        raise ValueError(f"logits_chunk_size must be >= 1 or None, got {logits_chunk_size}")
    check_share_prompts(use_remove_padding, share_prompts)
    if check:
        check_model_inputs(model, input_ids, attention_mask, position_ids, response_length,
                           use_remove_padding=use_remove_padding, share_prompts=share_prompts)  # fmt: skip
    batch = input_ids.shape[0]
    hidden, response_idx = scoring_hidden_states(
        backbone_of(model), input_ids, attention_mask, position_ids, response_length,
        use_remove_padding=use_remove_padding, share_prompts=share_prompts,
    )  # fmt: skip
    labels = input_ids[:, -response_length:].reshape(-1)[response_idx]
    log_probs, entropy = _head_log_probs(model, hidden, labels, temperature, calculate_entropy, logits_chunk_size)
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
