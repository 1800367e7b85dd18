"""A worker's local state as plain tensors, to compare two runs of the same rank bit for bit."""

from __future__ import annotations

import torch

from workers.actor import ActorWorker

__all__ = ["snapshot"]


def snapshot(w: ActorWorker) -> dict[str, torch.Tensor]:
    """This rank's parameter shards (``p.NAME``) and optimizer state (``o.I.KEY``), cloned."""
    out = {f"p.{n}": p.detach().to_local().clone() for n, p in w.root.named_parameters()}
    for i, state in enumerate(w.optimizer.state.values()):
        for k, v in state.items():
            out[f"o.{i}.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out
