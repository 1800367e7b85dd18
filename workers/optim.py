"""AdamW and the constant-with-warm-up LR schedule used by the actor and critic workers.

The schedule advances once per update call, i.e. once per training step (verl's semantics), however
many mini-batches (optimizer steps) the call runs: warm-up lengths count training steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from rlpad.config.schema import OptimConfig

__all__ = ["build_lr_scheduler", "build_optimizer", "warmup_steps"]


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``cfg.lr``, ``cfg.betas`` and ``cfg.weight_decay``."""
    if not cfg.lr >= 0:
        raise ValueError(f"optim.lr must be >= 0, got {cfg.lr}")
    if len(cfg.betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers, got {cfg.betas}")
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)


def warmup_steps(cfg: OptimConfig) -> int:
    """Warm-up length in training steps: ``lr_warmup_steps`` when > 0, else
    ``floor(lr_warmup_steps_ratio * total_training_steps)`` (0 without a ratio).

    A ratio needs ``total_training_steps`` (:func:`rlpad.train.fit` fills it in from the run's
    steps); without it the ratio would silently do nothing, so that is a ValueError.
    """
    if cfg.lr_warmup_steps > 0:
        return int(cfg.lr_warmup_steps)
    if cfg.lr_warmup_steps_ratio > 0:
        if cfg.total_training_steps <= 0:
            raise ValueError(f"optim.lr_warmup_steps_ratio={cfg.lr_warmup_steps_ratio} needs "
                             f"optim.total_training_steps > 0 (got {cfg.total_training_steps}); rlpad.train fills "
                             "it in from the run's steps")
        return math.floor(cfg.lr_warmup_steps_ratio * cfg.total_training_steps + 1e-9)  # 0.29 * 100 is 29
    return 0


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to ``lr`` over :func:`warmup_steps` training steps, then constant.

    Training step ``k`` (0-based; the worker steps the scheduler once per update call) uses
    ``lr * min(1, (k + 1) / warmup)``, so the first step is not wasted.
    """
    warmup = warmup_steps(cfg)

    def factor(step: int) -> float:
        return 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
