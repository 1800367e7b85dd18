"""The PPO value model: a causal LM's backbone plus a scalar head, scored on response tokens.

Values are read where log-probs are (:func:`rlpad.core.forward.scoring_hidden_states`): the value
of response token t (column P+t) comes from the hidden state at column P+t-1, the state before t
is produced; padded and remove-padding paths are the core's.
"""

from __future__ import annotations

import torch
from torch import nn

from rlpad.core.forward import check_model_inputs, scoring_hidden_states
from collections.abc import Mapping, Sequence

from rlpad.core.host_plan import HostBatch
from rlpad.core.sequence_parallel import SequenceParallel, active, response_grid

__all__ = ["ValueModel", "compute_values"]


def compute_values(
    backbone: nn.Module,
    value_head: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    *,
    use_remove_padding: bool,
    share_prompts: bool = False,
    check: bool = True,
    sp: SequenceParallel | None = None,
    share_min_saved: float = 0.0,
    response_mask: torch.Tensor | None = None,
    host: HostBatch | None = None,
    multi_modal_inputs: Sequence[Mapping] | None = None,
) -> torch.Tensor:
    """Values ``(B, R)`` in fp32 of the response tokens; zero on padding and, with ``response_mask``,
    on the tokens it marks 0 (tool output). Differentiable.

    ``share_prompts``: each distinct prompt once, where it saves at least ``share_min_saved`` of the
    valid tokens (see :func:`rlpad.core.forward.scoring_hidden_states`).
    ``check=False`` skips the input checks (the caller ran :func:`check_model_inputs` already).
    ``sp``: sequence parallelism; the value head runs on this rank's slice, every rank gets all values.
    ``host``: the batch's host copy where the caller has one (see :func:`rlpad.core.forward.scoring_hidden_states`).
    ``multi_modal_inputs``: a VL backbone's per-row images (:mod:`rlpad.core.vision`).
    """
    sp = active(sp)
    if check:
        check_model_inputs(backbone, input_ids, attention_mask, position_ids, response_length,
                           use_remove_padding=use_remove_padding, share_prompts=share_prompts, sp=sp,
                           response_mask=response_mask, multi_modal_inputs=multi_modal_inputs)  # fmt: skip
    hidden, response_idx = scoring_hidden_states(
        backbone, input_ids, attention_mask, position_ids, response_length, use_remove_padding=use_remove_padding,
        share_prompts=share_prompts, sp=sp, share_min_saved=share_min_saved, response_mask=response_mask, host=host,
        multi_modal_inputs=multi_modal_inputs,
    )
    values = value_head(hidden).float().squeeze(-1)  # (N,)
    return response_grid(values, response_idx, input_ids.shape[0], response_length, sp)


class ValueModel(nn.Module):
    """Backbone of a causal LM + ``Linear(hidden, 1)``; forward is :func:`compute_values`.

    The head is initialised N(0, initializer_range) from ``seed`` so every rank builds the same model.
    """

    def __init__(self, causal_lm: nn.Module, seed: int = 0):
        super().__init__()
        self.backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        self.config = causal_lm.config
        head = nn.Linear(self.config.get_text_config().hidden_size, 1, bias=True)  # a VL model: its text width
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.weight.normal_(0.0, getattr(self.config, "initializer_range", 0.02), generator=gen)
            head.bias.zero_()
        ref = next(self.backbone.parameters())
        self.value_head = head.to(dtype=ref.dtype, device=ref.device)

    def forward(self, input_ids, attention_mask, position_ids, response_length, *, use_remove_padding: bool = True,
                share_prompts: bool = False, check: bool = True, sp: SequenceParallel | None = None,
                share_min_saved: float = 0.0, response_mask: torch.Tensor | None = None,
                host: HostBatch | None = None, multi_modal_inputs: Sequence[Mapping] | None = None):
        return compute_values(
            self.backbone, self.value_head, input_ids, attention_mask, position_ids, response_length,
            use_remove_padding=use_remove_padding, share_prompts=share_prompts, check=check, sp=sp,
            share_min_saved=share_min_saved, response_mask=response_mask, host=host,
            multi_modal_inputs=multi_modal_inputs,
        )
