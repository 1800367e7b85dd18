"""The one optimizer step of the embedded warm starts (the text one, the VL one, the reward model's)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["optimizer_step"]


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, loss: torch.Tensor) -> float:
    """The gradients of ``loss``, clipped to norm 1, applied by ``opt``; the schedule advanced. Returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()
