"""``trainer.critic_warmup``: the steps on which the actor is updated (PPO with a critic)."""

from __future__ import annotations

from rlpad.config.schema import Config

__all__ = ["actor_updates"]


def actor_updates(config: Config, step: int) -> bool:
    """Whether training step ``step`` (counted from 1) updates the actor: from step ``critic_warmup`` on,
    verl's rule (``critic_warmup <= global_steps``), so the first ``critic_warmup - 1`` steps train
    the critic alone."""
    return config.trainer.critic_warmup <= step
