"""Trainer checkpoints on disk: one directory per step, published atomically.

Layout under ``trainer.default_local_dir``::

    checkpoints/global_step_<k>/{actor,critic}/   worker shards (torch.distributed.checkpoint)
    checkpoints/global_step_<k>/trainer_state.json step, dataloader position, metric history
    checkpoints/global_step_<k>/stream_state.json  the deterministic stream's state (rlpad/training/streaming.py)
    checkpoints/latest                             the name of the newest complete step

A step is written into ``global_step_<k>.tmp`` and renamed when every part is saved; ``latest``
is replaced with ``os.replace``. A crash mid-write leaves at most a ``.tmp`` directory, which
is never loaded, so ``latest`` always names a checkpoint that loads.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

__all__ = ["CheckpointDir"]


class CheckpointDir:
    """Atomic per-step checkpoint directories under ``root/checkpoints``."""

    def __init__(self, root: str):
        self.dir = os.path.join(root, "checkpoints")

    def staging(self, step: int) -> str:
        """A fresh ``.tmp`` directory for step ``step`` (any leftover from a crash is removed)."""
        path = os.path.join(self.dir, f"global_step_{step}.tmp")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def publish(self, step: int, trainer_state: dict[str, Any]) -> str:
        """Write the trainer state, rename the staging directory, then point ``latest`` at it."""
        staging = os.path.join(self.dir, f"global_step_{step}.tmp")
        with open(os.path.join(staging, "trainer_state.json"), "w") as f:
            json.dump(trainer_state, f)
        final = os.path.join(self.dir, f"global_step_{step}")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        tmp = os.path.join(self.dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(final))
        os.replace(tmp, os.path.join(self.dir, "latest"))
        return final

    def latest(self) -> str | None:
        """The newest complete checkpoint directory, or None."""
        try:
            with open(os.path.join(self.dir, "latest")) as f:
                name = f.read().strip()
        except FileNotFoundError:
            return None
        path = os.path.join(self.dir, name)
        return path if os.path.isfile(os.path.join(path, "trainer_state.json")) else None

    @staticmethod
    def read_state(path: str) -> dict[str, Any]:
        """The trainer state of checkpoint ``path``; ValueError if it is not a complete checkpoint."""
        state_file = os.path.join(path, "trainer_state.json")
        if not os.path.isfile(state_file):
            raise ValueError(f"{path!r} is not a complete rlpad checkpoint (no trainer_state.json)")
        with open(state_file) as f:
            return json.load(f)
