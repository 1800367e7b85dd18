"""What a transformers user writes instead of rlpad: "transformers packed", the GPU benchmark's peers.

The valid tokens of a micro-batch in one (1, nnz) row (the same row and order as rlpad's
remove-padding, :func:`rlpad.core.host_plan.packed_plan`), position ids restarting at 0 for each
sequence, ``attention_mask=None`` and ``use_cache=False``: transformers finds the sequences in the
position ids and builds the packed mask itself (a block-diagonal causal mask for sdpa, a block
mask for flex_attention; ``packed_liger``: sdpa on a copy with liger-kernel's fused RMSNorm, SwiGLU and
rotary, :func:`liger_copy`, the strongest peer a verl user has). Then the full logits of all nnz tokens, an fp32 ``log_softmax`` over them
and the entropy from it; the scored tokens' values are gathered into the (B, R) grid.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlpad.core.host_plan import HostBatch, packed_plan

__all__ = ["PEER_ATTENTION", "liger_copy", "packed_peer_log_probs"]

PEER_ATTENTION = {"packed_sdpa": "sdpa", "packed_flex": "flex_attention",  # column -> attn_implementation
                  "packed_liger": "sdpa"}  # + liger-kernel's fused modules, on a copy of the model (liger_copy)


def packed_peer_log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)``, each (B, R) fp32, zero on padding, of a rollout batch (B, S) through
    ``model`` as it is (its attention implementation: sdpa or flex_attention) on the packed row."""
    batch = input_ids.shape[0]
    plan = packed_plan(HostBatch.of(input_ids, attention_mask, position_ids), response_length).to(input_ids.device)
    logits = model(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None], attention_mask=None,
                   use_cache=False).logits[0]  # (nnz, V)
    logp = logits.float().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)  # (nnz,)
    labels = input_ids[:, -response_length:].reshape(-1)[plan.response_idx]
    scored = logp.index_select(0, plan.score_slots).gather(1, labels[:, None])[:, 0]
    grid = logp.new_zeros(batch * response_length)
    lp = grid.index_copy(0, plan.response_idx, scored).view(batch, response_length)
    ent = grid.index_copy(0, plan.response_idx, entropy.index_select(0, plan.score_slots))
    return lp, ent.view(batch, response_length)


def liger_copy(model: nn.Module, device_type: str | None = None) -> nn.Module:
    """A copy of ``model`` with liger-kernel's fused modules through rlpad's hook
    (:func:`rlpad.core.fused_modules.apply_fused_modules`, sdpa attention), which keeps liger's rebinds
    of the transformers module to the copy's own decoder layers. ``device_type``: the model's (a test
    names cuda to build it on the CPU)."""
    from rlpad.core.fused_modules import apply_fused_modules

    fused = copy.deepcopy(model)
    fused.set_attn_implementation(PEER_ATTENTION["packed_liger"])
    apply_fused_modules(fused, "liger", key="rlpad bench logprob packed_liger",
                        device_type=device_type or next(model.parameters()).device.type)
    return fused
