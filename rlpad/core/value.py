"""The PPO value model: a causal LM's backbone plus a scalar head, scored on response tokens.

Values follow the log-prob alignment of :mod:`rlpad.core.forward`: the value of response token t
(column P+t) is read from the hidden state at column P+t-1, the state before t is produced.
Two paths, equal per token: padded (B, S) and remove-padding (1, nnz) with ``cu_seqlens``.
"""

from __future__ import annotations

import torch
from torch import nn

from rlpad.core.attention import VARLEN_IMPLEMENTATIONS
from rlpad.core.forward import position_ids_from_mask, validate_rollout_batch
from rlpad.core.padding import index_first_axis, pad_input, unpad_input

__all__ = ["ValueModel", "compute_values", "response_hidden_states"]


def response_hidden_states(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    use_remove_padding: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states ``(N, H)`` that score the valid response tokens, and their flat (B*R) indices."""
    validate_rollout_batch(backbone, input_ids, attention_mask, position_ids, response_length)
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
    impl = backbone.config._attn_implementation
    if impl not in VARLEN_IMPLEMENTATIONS:
        raise ValueError(
            f"use_remove_padding=True needs a varlen attention ({sorted(VARLEN_IMPLEMENTATIONS)}), the model uses {impl!r}"
        )
    ids, indices, cu_seqlens, max_seqlen, _ = unpad_input(input_ids.unsqueeze(-1), attention_mask)
    packed_positions = index_first_axis(position_ids.reshape(-1, 1), indices)
    hidden = backbone(
        input_ids=ids.view(1, -1), position_ids=packed_positions.view(1, -1), attention_mask=None, use_cache=False,
        cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen,
    ).last_hidden_state[0]
    packed_slot = torch.full((batch * seqlen,), -1, dtype=torch.long, device=ids.device)
    packed_slot[indices] = torch.arange(indices.numel(), device=ids.device)
    return hidden.index_select(0, packed_slot[rows * seqlen + prompt_length - 1 + cols]), response_idx


def compute_values(
    backbone: nn.Module,
    value_head: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    use_remove_padding: bool,
) -> torch.Tensor:
    """Values ``(B, R)`` in fp32 of the response tokens; zero on padding. Differentiable."""
    hidden, response_idx = response_hidden_states(
        backbone, input_ids, attention_mask, position_ids, response_length, use_remove_padding=use_remove_padding
    )
    values = value_head(hidden).float()  # (N, 1)
    return pad_input(values, response_idx, input_ids.shape[0], response_length).squeeze(-1)


class ValueModel(nn.Module):
    """Backbone of a causal LM + ``Linear(hidden, 1)``; forward is :func:`compute_values`.

    The head is initialised N(0, initializer_range) from ``seed`` so every rank builds the same model.
    """

    def __init__(self, causal_lm: nn.Module, seed: int = 0):
        super().__init__()
        self.backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        self.config = causal_lm.config
        head = nn.Linear(self.config.hidden_size, 1, bias=True)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.weight.normal_(0.0, getattr(self.config, "initializer_range", 0.02), generator=gen)
            head.bias.zero_()
        ref = next(self.backbone.parameters())
        self.value_head = head.to(dtype=ref.dtype, device=ref.device)

    def forward(self, input_ids, attention_mask, position_ids, response_length, *, use_remove_padding: bool = True):
        return compute_values(
            self.backbone, self.value_head, input_ids, attention_mask, position_ids, response_length,
            use_remove_padding=use_remove_padding,
        )
