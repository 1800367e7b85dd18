"""The run's Hugging Face folders: ``<out>/hf/step_<k>`` (the actor) and ``<out>/hf_critic/step_<k>`` (the critic),
each beside a ``latest`` link, written with every checkpoint and after the last step (docs/export.md).

Asked for by ``trainer.save_hf`` or verl's ``checkpoint.save_contents`` with ``hf_model`` (the actor's, the
critic's). The workers write into ``step_<k>.tmp`` (:meth:`Workers.save_hf`, streamed from the FSDP shards);
the folder is renamed when whole and ``latest`` then moved to it, so a crash leaves a ``.tmp`` folder, never
a half folder under a final name.
"""

from __future__ import annotations

import os
from typing import Any

from rlpad.algorithms.advantages import uses_critic
from rlpad.config.checkpoint import HF_MODEL
from rlpad.config.schema import Config
from rlpad.export.hf_folder import point_latest, staged

__all__ = ["HF_DIRS", "HFFolders", "hf_roles"]

HF_DIRS = {"actor": "hf", "critic": "hf_critic"}  # role -> its folder under trainer.default_local_dir


def hf_roles(config: Config) -> list[str]:
    """The roles whose HF folders the run writes."""
    roles = []
    if config.trainer.save_hf or HF_MODEL in config.actor_rollout_ref.actor.checkpoint.save_contents:
        roles.append("actor")
    if uses_critic(config) and HF_MODEL in config.critic.checkpoint.save_contents:
        roles.append("critic")
    return roles


class HFFolders:
    """Writes the HF folders of :func:`hf_roles` at a step."""

    def __init__(self, config: Config):
        self.root, self.roles = config.trainer.default_local_dir, hf_roles(config)

    def save(self, workers: Any, step: int) -> list[str]:
        """``<root>/<HF_DIRS[role]>/step_<step>`` of each role (the workers' ``save_hf``), then its ``latest``."""
        written = []
        for role in self.roles:
            parent = os.path.join(self.root, HF_DIRS[role])
            name = f"step_{step}"
            with staged(os.path.join(parent, name)) as tmp:
                workers.save_hf(tmp, role)
            point_latest(parent, name)
            written.append(os.path.join(parent, name))
        return written
