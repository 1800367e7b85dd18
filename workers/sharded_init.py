"""Sharded initialisation: rank 0 holds the full weights, every other rank only its shard.

The model is sharded with FSDP2 on every rank (rank 0 from the loaded model, the others from a
meta-device build, then ``to_empty``); :func:`fill_from_rank0` then has rank 0 send each rank
exactly its rows of every parameter (FSDP2 shards dim 0 in ``torch.chunk`` pieces), received
straight into the rank's local shard, so a rank that does not read the checkpoint never holds
more than its shards. Buffers (rotary tables and other non-persistent ones) are broadcast.

Why not ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True))``: it gives the same bits on gloo/CPU (torch 2.13) but broadcasts
each FULL tensor, so every rank also holds the model's largest tensor: for the 160M benchmark
model (``python -m rlpad.bench.sharded_init``) the non-reading rank grew by 0.77x the fp32 model
instead of 0.52x.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["fill_from_rank0"]


def _rows(rows: int, world: int, rank: int) -> slice:
    chunk = -(-rows // world)  # torch.chunk: ceil-sized pieces, the last ones shorter or empty
    return slice(min(rows, rank * chunk), min(rows, (rank + 1) * chunk))


@torch.no_grad()
def fill_from_rank0(root: nn.Module, full: dict[str, torch.Tensor] | None, *, rank: int, world_size: int,
                    device: torch.device) -> None:
    """Copy rank 0's ``full`` tensors (by parameter name; ``None`` elsewhere) into every rank's shards
    of ``root``'s parameters, then broadcast ``root``'s buffers from rank 0. A collective."""
    if rank == 0 and full is None:
        raise ValueError("rank 0 must hold the full parameters")
    for name, param in root.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        rows = int(param.shape[0])
        mine = _rows(rows, world_size, rank)
        if int(local.shape[0]) != mine.stop - mine.start:
            raise RuntimeError(f"shard of {name} has {local.shape[0]} rows, expected rank {rank}'s torch.chunk "
                               f"piece of {rows} rows over {world_size} ranks")
        if rank == 0:
            source = full[name].to(device=device, dtype=local.dtype)
            for r in range(1, world_size):
                piece = source[_rows(rows, world_size, r)]
                if piece.shape[0]:
                    dist.send(piece.contiguous(), dst=r)
            local.copy_(source[mine])
        elif local.shape[0]:
            target = local if local.is_contiguous() else torch.empty_like(local)
            dist.recv(target, src=0)
            if target is not local:
                local.copy_(target)
    for buffer in root.buffers():
        dist.broadcast(buffer, src=0)
