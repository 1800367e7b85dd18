"""A discriminative reward model scored on the packed row: one score per sequence.

A reward model is a Hugging Face ``*ForSequenceClassification`` or ``*ForTokenClassification``
with ``num_labels == 1`` (how reward models ship on the Hub): a decoder backbone plus a
``score`` head ``Linear(hidden, 1)``. The score of a sequence is the head's output at the
sequence's LAST VALID token (what ``*ForSequenceClassification`` pools; for a token-classification
model the same token's logit).

Two paths, equal per sequence:

* padded: one (B, S) forward with the padding mask, the hidden state at each row's last 1 of
  ``attention_mask``;
* remove-padding: the valid tokens packed into one (1, nnz) row (positions restarting at 0 per
  sequence, ``cu_seqlens`` marking where each ends, the same varlen attention as the actor's
  forward), the hidden state at packed slot ``cu_seqlens[i + 1] - 1`` for sequence i.

Only B hidden states reach the head. Input: any (B, S) batch whose ``attention_mask`` has one run
of ones per row (the rollout layout, or whole left-padded conversations after re-tokenisation).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, PretrainedConfig

from rlpad.core.attention import BOUNDS_KWARG, VARLEN_ATTENTION, PackedBounds, packed_row_mask
from rlpad.core.attn_choice import require_varlen_attention
from rlpad.core.host_plan import to_device
from rlpad.core.layout import position_ids_from_mask
from rlpad.core.models import empty_pretrained, load_pretrained, model_config, model_source, require_folder
from rlpad.core.padding import validate_attention_mask

__all__ = ["REWARD_HEADS", "check_reward_config", "check_reward_inputs", "compute_scores", "last_token_columns",
           "load_reward_model", "reward_head_kind"]

# The class-name endings of a reward model and the Auto class that builds each.
REWARD_HEADS = {"ForSequenceClassification": AutoModelForSequenceClassification,
                "ForTokenClassification": AutoModelForTokenClassification}


def reward_head_kind(config: PretrainedConfig) -> str | None:
    """The :data:`REWARD_HEADS` ending of the config's first architecture, None for any other head."""
    for arch in getattr(config, "architectures", None) or []:
        for ending in REWARD_HEADS:
            if arch.endswith(ending):
                return ending
    return None


def check_reward_config(config: PretrainedConfig, path: str, key: str = "reward.reward_model.model_path") -> str:
    """The head kind of the reward model ``path`` (see :func:`reward_head_kind`); ValueError naming the
    head it has when that is not a one-output sequence- or token-classification head."""
    kind = reward_head_kind(config)
    heads = getattr(config, "architectures", None) or ["none recorded (config.json has no 'architectures')"]
    if kind is None:
        raise ValueError(f"{key}={path!r} is not a reward model: its head is {', '.join(heads)}; a reward model is a "
                         f"*ForSequenceClassification or *ForTokenClassification with num_labels 1")
    if config.num_labels != 1:
        raise ValueError(f"{key}={path!r} is a {heads[0]} with num_labels={config.num_labels}; a reward model "
                         f"has one output (num_labels 1)")
    return kind


def load_reward_model(
    path: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "auto",
    use_remove_padding: bool = True,
    trust_remote_code: bool = False,
    key: str = "reward.reward_model.model_path",
    empty: bool = False,
    attn_device: str | torch.device | None = None,
) -> nn.Module:
    """The reward model saved at the folder ``path`` (eval mode), with the attention rlpad's packed
    row needs (see :func:`rlpad.core.models.load_causal_lm`). ValueError before loading any weight
    when the folder holds another kind of model (``key`` names the config key in the message).
    ``empty``: built on the meta device from the config alone (no weight read); the attention is chosen
    for ``attn_device`` (default ``device``), where the model will run."""
    if model_source(path) is not None:
        raise ValueError(f"{key}={path!r} names a causal LM built in code, not a reward model; give the folder of "
                         f"a *ForSequenceClassification or *ForTokenClassification model (num_labels 1)")
    require_folder("reward model", path)
    config = model_config(path, trust_remote_code)
    kind = check_reward_config(config, path, key)
    if empty:
        return empty_pretrained(REWARD_HEADS[kind], path, dtype=dtype, attn_device=attn_device or device,
                                trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
                                use_remove_padding=use_remove_padding)
    return load_pretrained(REWARD_HEADS[kind], path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                           attn_implementation=attn_implementation, use_remove_padding=use_remove_padding,
                           attn_device=attn_device)


def check_reward_inputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor | None, *, use_remove_padding: bool) -> None:
    """Every check of a scoring call, before any compute: a one-output head, (B, S) integer ids in
    the vocabulary, a 0/1 mask with one run of ones per row, matching position ids, and a varlen
    attention for remove-padding."""
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ValueError(f"{type(model).__name__} has no one-output `score` head (a reward model is a "
                         f"*ForSequenceClassification or *ForTokenClassification with num_labels 1)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D (batch, seq) tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"shapes disagree: attention_mask {tuple(getattr(attention_mask, 'shape', ()))} "
                         f"vs input_ids {tuple(input_ids.shape)}")
    if position_ids is not None and position_ids.shape != input_ids.shape:
        raise ValueError(f"shapes disagree: position_ids {tuple(position_ids.shape)} vs input_ids {tuple(input_ids.shape)}")
    validate_attention_mask(attention_mask)
    vocab = model.get_input_embeddings().num_embeddings
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}) (the reward model's vocabulary), found ids in [{lo}, {hi}]")
    if use_remove_padding:
        require_varlen_attention(model)


def last_token_columns(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64: the column of each row's last valid token (its last 1)."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (columns * attention_mask.long()).argmax(dim=1)


def compute_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    use_remove_padding: bool = True,
    check: bool = True,
) -> torch.Tensor:
    """Scores ``(B,)`` in fp32: the reward model's ``score`` head on the hidden state of each row's
    last valid token. ``position_ids`` None: the rollout rule (restart at 0 at the first valid token).
    ``use_remove_padding``: one packed (1, nnz) forward (needs a varlen attention); else the padded
    (B, S) forward. ``check=False`` skips :func:`check_reward_inputs` (the caller ran it)."""
    if check:
        check_reward_inputs(model, input_ids, attention_mask, position_ids, use_remove_padding=use_remove_padding)
    device = input_ids.device
    backbone = getattr(model, model.base_model_prefix)
    mask = attention_mask.long().cpu()  # the one read of the batch (none on the CPU)
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    if not use_remove_padding:
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        rows, cols = to_device([torch.arange(mask.shape[0]), last_token_columns(mask)], device)
        last = hidden[rows, cols]
    else:
        indices = mask.reshape(-1).nonzero().flatten()
        cu_host = torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32)
        max_seqlen = int(mask.sum(1).max())
        indices, cu_seqlens, slots = to_device([indices, cu_host, cu_host[1:].long() - 1], device)
        ids = input_ids.reshape(-1).index_select(0, indices)
        positions = position_ids.reshape(-1).index_select(0, indices)
        no_mask = packed_row_mask(device) if backbone.config._attn_implementation == VARLEN_ATTENTION else None
        hidden = backbone(input_ids=ids.view(1, -1), position_ids=positions.view(1, -1), attention_mask=no_mask,
                          use_cache=False, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                          max_length_q=max_seqlen, max_length_k=max_seqlen,
                          **{BOUNDS_KWARG: PackedBounds(cu_host, ids.shape[0])}).last_hidden_state[0]
        last = hidden.index_select(0, slots)
    dropout = getattr(model, "dropout", None)  # *ForTokenClassification: identity in eval mode
    if isinstance(dropout, nn.Dropout):
        last = dropout(last)
    return model.score(last).float().squeeze(-1)
