"""The Ray side of the trainer: start the worker groups and the rollout actor for a config.

``launch_workers(config)`` returns :class:`RayWorkers`, which implements
:class:`rlpad.trainer.Workers`. Locally (no RAY_ADDRESS) it starts a Ray head on 127.0.0.1;
under ``ray job submit`` it joins the job's cluster.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import ray
from ray.exceptions import RayActorError

from rlpad.batch import Batch
from rlpad.config import Config
from workers.actor import ActorWorker
from workers.critic import CriticWorker
from workers.group import WorkerGroup
from workers.rollout import create_rollout_actor

__all__ = ["RayWorkers", "init_local_ray", "launch_workers"]

# vLLM logs every engine step at INFO; keep the console for the progress bar and errors.
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def _cuda(config: Config) -> bool:
    if config.trainer.device == "auto":
        import torch

        return torch.cuda.is_available()
    return config.trainer.device == "cuda"


class RayWorkers:
    """Actor (+ ref, + critic) FSDP groups and one rollout actor; see rlpad.trainer.Workers."""

    def __init__(self, config: Config, *, owns_ray: bool = False):
        self.config, self._owns_ray = config, owns_ray
        arr = config.actor_rollout_ref
        world = config.trainer.n_gpus_per_node * config.trainer.nnodes
        gpus = 1 if _cuda(config) else 0
        self.actor = WorkerGroup(ActorWorker, arr, role="actor", world_size=world, num_gpus_per_worker=gpus)
        self.ref = None
        if config.uses_ref:
            self.ref = WorkerGroup(ActorWorker, arr, role="ref", world_size=world, num_gpus_per_worker=gpus)
        self.critic = None
        if config.uses_critic:
            self.critic = WorkerGroup(CriticWorker, config.critic, role="critic", world_size=world,
                                      num_gpus_per_worker=gpus, rollout_n=arr.rollout.n)
        self.rollout = create_rollout_actor(
            arr.model.path, arr.rollout, config.data, num_gpus=gpus * arr.rollout.tensor_model_parallel_size,
            tokenizer_path=arr.model.tokenizer_path, trust_remote_code=arr.model.trust_remote_code,
        )

    def _rollout_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return ray.get(getattr(self.rollout, method).remote(*args, **kwargs))
        except RayActorError as e:
            raise RuntimeError(f"rollout worker died or is unreachable: {e}") from e

    def generate(self, batch: Batch, seed: int) -> Batch:
        return self._rollout_call("generate", batch, seed=seed)

    def generate_validation(self, batch: Batch) -> Batch:
        return self._rollout_call("generate_validation", batch)

    def compute_log_prob(self, batch: Batch, *, for_update: bool = True) -> Batch:
        """Old log-probs. ``for_update`` with ``actor.old_log_prob_layout=update``: split over the ranks
        and into micro-batches exactly as :meth:`update_actor` will split the same batch."""
        if for_update and self.config.actor_rollout_ref.actor.old_log_prob_layout == "update":
            return self.actor.call_batch("compute_log_prob", batch, chunk_rows=self._mini_rows(), update_layout=True)
        return self.actor.call_batch("compute_log_prob", batch)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.ref is None:
            raise ValueError("ref log-probs asked for, but neither use_kl_loss nor use_kl_in_reward is set")
        return self.ref.call_batch("compute_ref_log_prob", batch)

    def compute_values(self, batch: Batch) -> Batch:
        return self.critic.call_batch("compute_values", batch)

    def _mini_rows(self) -> int:
        arr = self.config.actor_rollout_ref
        return arr.actor.ppo_mini_batch_size * arr.rollout.n

    def update_actor(self, batch: Batch) -> dict[str, float]:
        return self.actor.call_batch("update_actor", batch, chunk_rows=self._mini_rows())

    def update_critic(self, batch: Batch) -> dict[str, float]:
        rows = self.config.critic.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
        return self.critic.call_batch("update_critic", batch, chunk_rows=rows)

    def sync_weights(self) -> float:
        """Actor full weights -> the live rollout engine; returns the engine's load seconds."""
        state = self.actor.call("full_state_dict")[0]
        return self._rollout_call("update_weights", state)

    def _groups(self) -> dict[str, WorkerGroup]:
        return {name: g for name, g in (("actor", self.actor), ("critic", self.critic)) if g is not None}

    def save_checkpoint(self, path: str) -> None:
        for name, group in self._groups().items():
            group.call("save_checkpoint", os.path.join(path, name))

    def load_checkpoint(self, path: str) -> None:
        for name, group in self._groups().items():
            group.call("load_checkpoint", os.path.join(path, name))

    def shutdown(self) -> None:
        for group in (self.actor, self.ref, self.critic):
            if group is not None:
                group.shutdown()
        try:
            ray.kill(self.rollout)
        except Exception:  # already gone
            pass
        if self._owns_ray:
            ray.shutdown()


def init_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """Start a single-node Ray for this process on 127.0.0.1, without the dashboard.

    Its servers listen on the loopback only when ``workers`` was imported before ``ray`` (see
    workers/__init__.py); otherwise Ray picks the machine's address and a warning says so.
    """
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
    ip = ray.util.get_node_ip_address()
    if ip != "127.0.0.1":
        warnings.warn(f"local Ray listens on {ip}, not 127.0.0.1 only: ray was imported before workers "
                      "(set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray)", stacklevel=2)


def launch_workers(config: Config) -> RayWorkers:
    """Join the Ray cluster (RAY_ADDRESS) or start a local head on 127.0.0.1, then the workers."""
    owns = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            world = config.trainer.n_gpus_per_node * config.trainer.nnodes
            groups = 1 + config.uses_ref + config.uses_critic
            # Logical CPUs: one per worker process (each runs with one torch thread on CPU).
            init_local_ray(groups * world + 1, runtime_env={"env_vars": QUIET_ENV})
            owns = True
    return RayWorkers(config, owns_ray=owns)
