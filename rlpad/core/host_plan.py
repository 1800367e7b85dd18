"""Where each token goes in one forward, worked out on the host and moved to the device in one copy.

A packed forward needs index tensors (which tokens to pack, where each sequence ends, which packed
slot scores each response token) that depend on the data, not only on shapes. Built on the device
they cost a host sync each (``nonzero``, ``.item()``, ``tolist``) and a launch each; built here
from a host copy of the batch (read once: one device-to-host copy, none when the batch is on the
CPU) they cost one pinned host-to-device copy that does not wait (:func:`to_device`).

    HostBatch.of(input_ids, attention_mask, position_ids)    (B, S) x 3 on the host
    packed_plan(host, response_length, pad_to)  -> PackedPlan  host tensors + Python ints
    plan.to(device)                              -> the same tensors on the device, one copy
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["HostBatch", "PackedPlan", "host_copies", "packed_plan", "response_positions", "to_device"]


def host_copies(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``tensors`` on the host, each with its own dtype and shape, in ONE device-to-host copy (one
    host sync; none when they are all on the CPU already). None stays None. The copy goes through
    fp64, which holds every bool, bf16 / fp16 / fp32 value and integer below 2^53 (token ids)
    exactly: what the checks and :meth:`HostBatch.of` read is what the device holds."""
    present = [t for t in tensors if t is not None]
    if all(t.device.type == "cpu" for t in present):
        return list(tensors)
    if len({t.device for t in present}) > 1:  # not one batch (the checks name the problem): one copy each
        return [None if t is None else t.cpu() for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in present]).cpu()
    parts = iter(p.view(t.shape).to(t.dtype) for p, t in zip(flat.split([t.numel() for t in present]), present))
    return [None if t is None else next(parts) for t in tensors]


@dataclass(frozen=True)
class HostBatch:
    """``input_ids``, ``attention_mask`` (0/1) and ``position_ids`` of a rollout batch, (B, S) int64 on the CPU,
    ``response_mask`` (B, R) (1 = a token the policy generated; None: every valid response token) and,
    for a VL model, ``rope_positions`` (3, B, S): the multimodal positions (:mod:`rlpad.core.mrope`)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None

    @staticmethod
    def of(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None,
           response_mask: torch.Tensor | None = None) -> HostBatch:
        """The host view of a batch: the tensors themselves on the CPU, else ONE device-to-host copy
        (:func:`host_copies`). ``position_ids`` None: ``clamp(cumsum(mask) - 1, 0)`` (the rollout
        layout's rule)."""
        ids, mask, pos, scored = (None if t is None else t.long()
                                  for t in host_copies(input_ids, attention_mask, position_ids, response_mask))
        if pos is None:
            pos = (mask.cumsum(1) - 1).clamp_(min=0)
        return HostBatch(ids, mask, pos, scored)

    def gather_positions(self, flat: torch.Tensor) -> torch.Tensor:
        """The position ids of the flat (B*S) slots ``flat``: (T,), or (4, T) with the multimodal rows
        under the text row (a VL batch)."""
        text = self.position_ids.reshape(-1)[flat]
        if self.rope_positions is None:
            return text
        return torch.cat([text[None], self.rope_positions.reshape(3, -1)[:, flat]])

    def scored_mask(self, response_length: int) -> torch.Tensor:
        """(B, R) 0/1: the response tokens the core scores (``response_mask``, else the valid ones)."""
        return self.attention_mask[:, -response_length:] if self.response_mask is None else self.response_mask


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int tensors -> the same on ``device``: one pinned buffer, one non-blocking copy (no
    host sync), split back into views (each keeps its dtype via one cast where it is not int64)."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1).long() for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=True).split([t.numel() for t in tensors])
    return [m.view(t.shape) if t.dtype == torch.long else m.view(t.shape).to(t.dtype) for m, t in zip(moved, tensors)]


def response_positions(host: HostBatch, response_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(response_idx, rows, cols)`` of the scored response tokens (:meth:`HostBatch.scored_mask`:
    the generated ones, never a tool token): flat indices into (B, R), row-major, and their rows
    and columns (host tensors)."""
    response_idx = host.scored_mask(response_length).reshape(-1).nonzero().flatten()
    return response_idx, response_idx // response_length, response_idx % response_length


@dataclass(frozen=True)
class PackedPlan:
    """One packed (1, T) row of a batch: ``input_ids`` (T,), ``position_ids`` (T,) or (4, T) (a VL batch,
    :meth:`HostBatch.gather_positions`), ``cu_seqlens`` (n + 1,)
    int32, ``max_seqlen`` (int), ``score_slots`` (N,): the packed slot whose hidden state scores each
    valid response token, and ``response_idx`` (N,): that token's flat index into (B, R). With
    ``pad_to`` > 1 the row ends in a padding sequence of its own (token 0, positions 0, 1, ...)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    score_slots: torch.Tensor
    response_idx: torch.Tensor
    max_seqlen: int

    def to(self, device: torch.device) -> PackedPlan:
        """The plan with its tensors on ``device``, in one copy."""
        names = [f.name for f in fields(self) if f.name != "max_seqlen"]
        moved = to_device([getattr(self, n) for n in names], device)
        return replace(self, **dict(zip(names, moved)))


def packed_plan(host: HostBatch, response_length: int, *, pad_to: int = 1) -> PackedPlan:
    """The plain remove-padding row of ``host`` (every valid token once, in row order)."""
    batch, seqlen = host.input_ids.shape
    prompt = seqlen - response_length
    mask = host.attention_mask.bool()
    indices = mask.reshape(-1).nonzero().flatten()
    seqlens = mask.sum(1)
    ids = host.input_ids.reshape(-1)[indices]
    positions = host.gather_positions(indices)
    slot = torch.full((batch * seqlen,), -1, dtype=torch.long)
    slot[indices] = torch.arange(indices.numel())
    response_idx, rows, cols = response_positions(host, response_length)
    score_slots = slot[rows * seqlen + prompt - 1 + cols]
    pad = -indices.numel() % pad_to
    if pad:  # a sequence of its own, so cu_seqlens ends at the padded length (the varlen kernels need it)
        ids = torch.cat([ids, ids.new_zeros(pad)])
        positions = torch.cat([positions, torch.arange(pad).expand(*positions.shape[:-1], pad)], -1)
        seqlens = torch.cat([seqlens, seqlens.new_tensor([pad])])
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32)
    return PackedPlan(ids, positions, cu_seqlens, score_slots, response_idx, int(seqlens.max()))
