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
  forward), the hidden state at packed slot ``cu_seqlens[i + 1] - 1`` for sequence i;
* shared prompts (on top of remove-padding, the rollout's own rows only: ``response_length`` known):
  each prompt group's prompt once, then its responses (:mod:`rlpad.core.shared_prompt`), a response
  attending to the prompt and causally to itself; the state at each response's last token
  (:func:`shared_last_slots`);
* sequence-parallel (``sp``, on top of either packed row): the row split over the group's ranks
  (:mod:`rlpad.core.sequence_parallel`); a row's last token lies on one rank's slice, that rank
  scores it, and the (B,) scores are summed over the group (one nonzero term each: exact).

Only B hidden states reach the head. Input: any (B, S) batch whose ``attention_mask`` has one run
of ones per row (the rollout layout, or whole left-padded conversations after re-tokenisation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, PretrainedConfig

from rlpad.core.attention import BOUNDS_KWARG, VARLEN_ATTENTION, PackedBounds, packed_row_mask
from rlpad.core.attn_choice import require_varlen_attention
from rlpad.core.forward import check_sequence_parallel, check_share_min_saved, check_share_prompts, groups_to_share
from rlpad.core.host_plan import HostBatch, to_device
from rlpad.core.layout import check_rollout_tensors, position_ids_from_mask
from rlpad.core.models import empty_pretrained, load_pretrained, model_config, model_source, require_folder
from rlpad.core.padding import validate_attention_mask
from rlpad.core.sequence_parallel import SequenceParallel, active, kv_repeats
from rlpad.core.shared_prompt import SEGMENTS_KWARG, SharedSegments, pack_shared_prompts
from rlpad.core.vision import padded_positions, run_backbone, with_images

__all__ = ["REWARD_HEADS", "check_reward_config", "check_reward_inputs", "compute_scores", "last_token_columns",
           "load_reward_model", "reward_head_kind", "score_head", "shared_last_slots"]

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
                        position_ids: torch.Tensor | None, *, use_remove_padding: bool,
                        response_length: int | None = None, share_prompts: bool = False,
                        sp: SequenceParallel | None = None) -> None:
    """Every check of a scoring call, before any compute: a one-output head, (B, S) integer ids in
    the vocabulary, a 0/1 mask with one run of ones per row, matching position ids, and a varlen
    attention for remove-padding. ``share_prompts`` needs remove-padding, ``response_length`` and the
    rollout layout (left-padded prompts, right-padded responses); sequence parallelism ``sp`` needs
    remove-padding, ``rlpad_varlen`` and query heads that split over its ranks."""
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ValueError(f"{type(model).__name__} has no one-output `score` head (a reward model is a "
                         f"*ForSequenceClassification or *ForTokenClassification with num_labels 1)")
    check_share_prompts(use_remove_padding, share_prompts)
    sp = active(sp)
    check_sequence_parallel(use_remove_padding, sp)
    if share_prompts and response_length is None:
        raise ValueError("share_prompts=True needs response_length (where each row's response starts): the "
                         "rows in the rollout layout, not whole left-padded ones")
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
    if share_prompts:  # the rollout layout: the shared prompt is the first S - R columns of each row
        check_rollout_tensors(vocab, input_ids, attention_mask, position_ids, response_length)
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}) (the reward model's vocabulary), found ids in [{lo}, {hi}]")
    if use_remove_padding:
        require_varlen_attention(model, share_prompts=share_prompts, sequence_parallel=sp is not None)
    if sp is not None:
        config = model.config
        kv_repeats(config.num_attention_heads, getattr(config, "num_key_value_heads", None)
                   or config.num_attention_heads, sp.size)  # fmt: skip


def last_token_columns(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64: the column of each row's last valid token (its last 1)."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (columns * attention_mask.long()).argmax(dim=1)


def shared_last_slots(segments: SharedSegments, groups: list[list[int]], response_lengths: list[int]) -> torch.Tensor:
    """(B,) int64: the slot of each row's last valid token in a shared-prompt row
    (:func:`rlpad.core.shared_prompt.pack_shared_prompts` of ``groups``): its response's last token,
    or its group's last prompt token when its response is empty."""
    slots = [0] * len(response_lengths)
    responses = iter(segments.responses)  # (start, length, group) in group order, rows ascending, non-empty only
    for g, rows in enumerate(groups):
        prompt_start, prompt_len = segments.prompts[g]
        for r in rows:
            if response_lengths[r]:
                start, length, _ = next(responses)
                slots[r] = start + length - 1
            else:
                slots[r] = prompt_start + prompt_len - 1
    return torch.tensor(slots, dtype=torch.long)


def _packed_row(host: HostBatch, pad_to: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """``(ids (T',), positions (T',), cu_seqlens (n + 1,) int32, max_seqlen, last slots (B,))`` of the
    plain packed row on the host; padded to a multiple of ``pad_to`` by a sequence of its own (token 0,
    positions 0, 1, ...), as :func:`rlpad.core.host_plan.packed_plan` pads it."""
    indices = host.attention_mask.reshape(-1).nonzero().flatten()
    ids, positions = host.input_ids.reshape(-1)[indices], host.gather_positions(indices)
    seqlens = host.attention_mask.sum(1)
    last = seqlens.cumsum(0) - 1
    pad = -indices.numel() % pad_to
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        positions = torch.cat([positions, torch.arange(pad).expand(*positions.shape[:-1], pad)], -1)
        seqlens = torch.cat([seqlens, seqlens.new_tensor([pad])])
    cu = torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32)
    return ids, positions, cu, int(seqlens.max()), last


def compute_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    use_remove_padding: bool = True,
    response_length: int | None = None,
    share_prompts: bool = False,
    share_min_saved: float = 0.0,
    sp: SequenceParallel | None = None,
    host: HostBatch | None = None,
    check: bool = True,
    multi_modal_inputs: Sequence[Mapping] | None = None,
) -> torch.Tensor:
    """Scores ``(B,)`` in fp32: the reward model's ``score`` head on the hidden state of each row's
    last valid token. ``position_ids`` None: the rollout rule (restart at 0 at the first valid token).
    ``use_remove_padding``: one packed (1, nnz) forward (needs a varlen attention); else the padded
    (B, S) forward. ``share_prompts`` (the rollout's own rows: ``response_length`` columns of right-padded
    response after a left-padded prompt): each group's prompt once, its responses after it, a response
    attending to the prompt and itself only (:mod:`rlpad.core.shared_prompt`), where that removes at
    least ``share_min_saved`` of the valid tokens. ``sp``: this rank's sequence-parallel group; it runs
    its slice of the row, scores the rows whose last token it holds, and every rank gets all B scores.
    ``host``: the batch's host copy where the caller has one. ``check=False`` skips
    :func:`check_reward_inputs` (the caller ran it). ``multi_modal_inputs``: the per-row images of a
    reward model with a VL backbone (:mod:`rlpad.core.vision`), on every path."""
    sp = active(sp)
    if check:
        check_reward_inputs(model, input_ids, attention_mask, position_ids, use_remove_padding=use_remove_padding,
                            response_length=response_length, share_prompts=share_prompts, sp=sp)
    check_share_min_saved(share_min_saved)
    device, batch = input_ids.device, input_ids.shape[0]
    backbone = getattr(model, model.base_model_prefix)
    if host is None:
        host = HostBatch.of(input_ids, attention_mask, position_ids)  # the one read of the batch (none on the CPU)
    host, images = with_images(backbone, host, multi_modal_inputs, sp)
    if not use_remove_padding:
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        if images is not None:
            position_ids = padded_positions(position_ids, host.rope_positions)
        hidden = run_backbone(backbone, input_ids, position_ids, attention_mask, host_ids=host.input_ids,
                              images=images, image_rows=range(batch))
        rows, cols = to_device([torch.arange(batch), last_token_columns(host.attention_mask)], device)
        return score_head(model, hidden[rows, cols])
    pad_to = sp.size if sp is not None else 1
    groups = groups_to_share(host, response_length, share_min_saved, multi_modal_inputs) if share_prompts else None
    image_rows = range(batch)  # the rows whose prompt (and images) the packed row holds
    if groups is not None:
        row = pack_shared_prompts(host.input_ids, host.attention_mask, host.position_ids, response_length,
                                  pad_to=pad_to, groups=groups, rope_positions=host.rope_positions)
        slots = shared_last_slots(row.segments, groups, host.attention_mask[:, -response_length:].sum(1).tolist())
        host_ids, row, image_rows = row.input_ids[0], row.to(device), [g[0] for g in groups]  # one copy
        ids, positions, attention = row.input_ids[0], row.position_ids.select(-2, 0), {SEGMENTS_KWARG: row.segments}
    else:
        ids, positions, cu_host, max_seqlen, slots = _packed_row(host, pad_to)
        host_ids, (ids, positions, cu_seqlens) = ids, to_device([ids, positions, cu_host], device)  # one copy
        attention = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen,
                         max_length_k=max_seqlen, **{BOUNDS_KWARG: PackedBounds(cu_host, ids.shape[0])})
    no_mask = packed_row_mask(device) if backbone.config._attn_implementation == VARLEN_ATTENTION else None
    if sp is None:
        hidden = run_backbone(backbone, ids.view(1, -1), positions.unsqueeze(-2), no_mask, host_ids=host_ids,
                              images=images, image_rows=image_rows, **attention)[0]
        return score_head(model, hidden.index_select(0, *to_device([slots], device)))
    shard = sp.shard(ids, positions, attention)
    hidden = backbone(attention_mask=no_mask, use_cache=False, **shard.forward_kwargs()).last_hidden_state[0]
    mine, local = shard.local(slots)  # on the host: the rows whose last token is on this rank's slice
    rows, local = to_device([mine.nonzero().flatten(), local], device)
    scores = torch.zeros(batch, dtype=torch.float32, device=device)
    scores = scores.index_copy(0, rows, score_head(model, hidden.index_select(0, local)))
    return sp.gather_scored(scores)  # one nonzero term per row: the sum is exact


def score_head(model: nn.Module, last: torch.Tensor) -> torch.Tensor:
    """(n, H) hidden states of last tokens -> (n,) fp32 scores: the one-output ``score`` head run in fp32
    whatever the model's dtype (a bf16 head would round every score to 8 bits: 3.170 and 3.178 both 3.171875)."""
    dropout = getattr(model, "dropout", None)  # *ForTokenClassification: identity in eval mode
    if isinstance(dropout, nn.Dropout):
        last = dropout(last)
    head = model.score
    bias = None if head.bias is None else head.bias.float()
    return nn.functional.linear(last.float(), head.weight.float(), bias).squeeze(-1)
