"""Small collectives over a worker's ranks: sums, maxima and an agreed ValueError.

A mixin of :class:`workers.fsdp.FSDPWorker` (it uses ``rank``, ``world_size``, ``device``, ``role``
and ``sp``, the worker's :class:`rlpad.core.sequence_parallel.SequenceParallel` or None). Values go
through the worker's device (gloo on CPU, nccl on CUDA) and come back on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["RankCollectives", "full_tensor"]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class RankCollectives:
    """Element-wise reductions over the ranks, and :meth:`_agree` (a ValueError on one rank is raised on all)."""

    def _group_sum(self, values: list[float] | torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the data-parallel groups, each counted once (the ranks of a
        sequence-parallel group hold the same rows: only its first rank contributes)."""
        t = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        return self._all_sum(t if self.sp is None or self.sp.rank == 0 else torch.zeros_like(t))

    def _all_sum(self, values: list[float] | torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks (float64, on CPU)."""
        t = torch.as_tensor(values, dtype=torch.float64).to(self.device).reshape(-1)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def _all_max_float(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the ranks (float64, on CPU)."""
        t = torch.as_tensor(values, dtype=torch.float64).to(self.device).reshape(-1)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu()

    def _all_max(self, values: list[int]) -> list[int]:
        """Element-wise max over the ranks (int64)."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def _agree(self, check: Callable[[], None]) -> None:
        """Run ``check`` here; if it raised ValueError on ANY rank, raise it on every rank.

        Every rank stops before the first collective of the work, so none is left waiting.
        """
        try:
            check()
            error = None
        except ValueError as e:
            error = str(e)
        if self.world_size > 1:
            errors: list[str | None] = [None] * self.world_size
            dist.all_gather_object(errors, error)
        else:
            errors = [error]
        for r, e in enumerate(errors):
            if e is not None:
                raise ValueError(e if r == self.rank else f"{self.role} rank {r}: {e}")
