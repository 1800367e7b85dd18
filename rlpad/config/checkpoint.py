"""verl's ``checkpoint`` section of the actor and the critic: what each checkpoint holds (docs/export.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["HF_MODEL", "SAVE_CONTENTS", "CheckpointConfig", "checkpoint_problems"]

HF_MODEL = "hf_model"
SAVE_CONTENTS = ("model", "optimizer", "extra", HF_MODEL)  # verl's names


@dataclass
class CheckpointConfig:
    """What a checkpoint of this role holds (verl's ``checkpoint.save_contents``)."""

    # model, optimizer, extra: rlpad always saves all three (a checkpoint resumes exactly); hf_model: also this
    # role's Hugging Face folder with every checkpoint and after the last step (<default_local_dir>/hf/step_<k>,
    # the critic's hf_critic/step_<k>), as trainer.save_hf does for the actor
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])


def checkpoint_problems(config: Any) -> list[str]:
    """The ``checkpoint.save_contents`` entries of the actor and the critic that are not verl's names."""
    problems = []
    for key, section in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor), ("critic", config.critic)):
        bad = [c for c in section.checkpoint.save_contents if c not in SAVE_CONTENTS]
        if bad:
            problems.append(f"{key}.checkpoint.save_contents has {bad[0]!r}; its entries are {', '.join(SAVE_CONTENTS)}")
    return problems
