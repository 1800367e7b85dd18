"""Ulysses sequence parallelism on the packed row: sp ranks share one (1, T) row, 1/sp of it each.

::

    packed row (1, T), padded to T' = ceil(T / sp) * sp; rank j holds tokens [j T'/sp, (j+1) T'/sp)
    q, k, v (1, H, T'/sp, D) --all-to-all--> (1, H/sp, T', D): the whole row, a slice of the heads
    the attention of the whole row (its bounds), exactly as without sp
    out (1, T', H/sp, D)     --all-to-all--> (1, T'/sp, H, D); MLP, norms, heads on the slice
    scored values of the slice, zero elsewhere in (B, R) --sum over the group--> (B, R)

The padding is a sequence of its own in the row's bounds (``cu_seqlens`` ends at T': torch's
varlen kernels give NaN gradients for tokens past ``cu_seqlens[-1]``); no real token attends to it
and nothing scores it. Rotary positions are the global position ids of each rank's slice. Key /
value heads fewer than sp (or not a multiple of it) are repeated until every rank gets whole
ones, keeping query head i on key/value head i // (H / H_kv).

:class:`SequenceParallel` is a rank's group; :class:`RowShard` is one forward's row as this rank
sees it. The forward passes the shard to the attention as the keyword ``rlpad_sequence_shard``
(:data:`SHARD_KWARG`), next to the row's bounds; ``rlpad_varlen`` exchanges around its kernel.
Both exchanges are differentiable (their backward is the opposite exchange).

Gradients: :meth:`SequenceParallel.gather_scored` sums the ranks' (B, R) scores in forward and
passes the gradient straight back to this rank's own entries, which is exact when every rank of
the group computes the same loss from the gathered tensor (the workers do): each token's gradient
reaches the one rank that scored it, and the ranks' parameter gradients SUM to the gradient of
that loss.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlpad.core.padding import pad_input

__all__ = ["SHARD_KWARG", "RowShard", "SequenceParallel", "active", "all_to_all", "kv_repeats", "response_grid"]

# The forward keyword transformers passes on to the attention function.
SHARD_KWARG = "rlpad_sequence_shard"


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # block r goes to rank r
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # block r came from rank r


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """``x`` cut into group-size blocks along ``scatter_dim`` (block r to rank r); the blocks received
    joined along ``gather_dim`` in rank order. Differentiable: backward is the opposite exchange."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _SumScored(torch.autograd.Function):
    """Sum over the group in forward; backward returns the gradient to this rank's own input.

    ASSUMPTION: every rank of the group computes the SAME loss from the summed tensor (the workers
    do: their losses read only gathered (B, R) tensors and group-wide normalisers). Then each
    token's gradient reaches the one rank that scored it and the ranks' gradients sum to the
    loss's. A rank-local term (an auxiliary loss on this rank's hidden states, an MoE router loss)
    breaks it silently: its gradient would not be the one of any loss. tests/test_sequence_parallel.py
    checks the ranks' losses are bitwise equal; a new loss term must keep that or change this rule."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def kv_repeats(q_heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated so that sp ranks get whole ones: the least e
    with ``kv_heads * e`` a multiple of sp (it divides ``q_heads`` when sp and kv_heads do)."""
    if q_heads % sp or q_heads % kv_heads:
        raise ValueError(f"sequence parallel size {sp} needs query heads ({q_heads}) divisible by it and by the "
                         f"key/value heads ({kv_heads})")
    return sp // math.gcd(kv_heads, sp)


class SequenceParallel:
    """This rank's sequence-parallel group: ``size`` ranks sharing one packed row; ``rank`` is its
    index in the group (``group`` None only for size 1)."""

    def __init__(self, group, size: int | None = None, rank: int | None = None):
        self.group = group
        self.size = dist.get_world_size(group) if size is None else size
        self.rank = dist.get_rank(group) if rank is None else rank
        if not 0 <= self.rank < self.size:
            raise ValueError(f"sequence-parallel rank {self.rank} must be in [0, {self.size})")

    def padded_length(self, total: int) -> int:
        """T' = ``total`` rounded up to a multiple of the group size."""
        return -(-total // self.size) * self.size

    def shard(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_kwargs: dict) -> RowShard:
        """This rank's :class:`RowShard` of a padded (T',) row whose bounds are ``attention_kwargs``."""
        return RowShard(self, input_ids, position_ids, attention_kwargs)

    def gather_scored(self, x: torch.Tensor) -> torch.Tensor:
        """(B, R) scores of this rank's tokens (zero elsewhere) -> every rank's scores; each token
        has exactly one nonzero contribution, so the sum is exact (see the module docstring)."""
        return _SumScored.apply(x, self.group)


class RowShard:
    """One forward's padded (T',) row as this rank sees it: tokens ``[start, end)``, the row's
    attention bounds (``attention_kwargs``: cu_seqlens of all T' tokens, or the shared-prompt
    segments), and the head exchanges around the attention."""

    def __init__(self, sp: SequenceParallel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_kwargs: dict):
        total = input_ids.shape[0]
        if total % sp.size:
            raise ValueError(f"a sequence-parallel row of {total} tokens does not split over {sp.size} ranks")
        self.sp, self.total = sp, total
        n = total // sp.size
        self.start, self.end = sp.rank * n, (sp.rank + 1) * n
        self.input_ids = input_ids[self.start : self.end].view(1, -1)
        self.position_ids = position_ids[self.start : self.end].view(1, -1)
        self.attention_kwargs = attention_kwargs

    def forward_kwargs(self) -> dict:
        """The backbone's keywords: this rank's tokens and positions, the row's bounds, the shard."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, **self.attention_kwargs,
                    **{SHARD_KWARG: self})

    def local(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mine, local)``: which of the row ``slots`` this rank holds (bool), and their local indices."""
        mine = (slots >= self.start) & (slots < self.end)
        return mine, slots[mine] - self.start

    def to_heads(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """(1, H, T'/sp, D) each -> (1, H/sp, T', D): the whole row for this rank's heads. Key/value
        heads are repeated first where they do not split (:func:`kv_repeats`)."""
        sp, group = self.sp.size, self.sp.group
        repeats = kv_repeats(query.shape[1], key.shape[1], sp)
        if repeats > 1:
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        return tuple(all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (query, key, value))

    def to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output (1, T', H/sp, D) -> (1, T'/sp, H, D): this rank's tokens, all heads."""
        return all_to_all(out, self.sp.group, scatter_dim=1, gather_dim=2)


def active(sp: SequenceParallel | None) -> SequenceParallel | None:
    """``sp``, or None when there is no group to share the row with (None or size 1)."""
    return sp if sp is not None and sp.size > 1 else None


def response_grid(scores: torch.Tensor, response_idx: torch.Tensor, batch: int, response_length: int,
                  sp: SequenceParallel | None = None) -> torch.Tensor:
    """Scores ``(N,)`` of the tokens at flat ``response_idx`` -> ``(batch, response_length)``, zero
    elsewhere; with ``sp``, every rank's scores (:meth:`SequenceParallel.gather_scored`)."""
    grid = pad_input(scores.unsqueeze(-1), response_idx, batch, response_length).squeeze(-1)
    return grid if active(sp) is None else sp.gather_scored(grid)
