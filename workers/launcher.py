"""The Ray side of the trainer: start the worker groups and the rollout actor for a config.

``launch_workers(config)`` returns :class:`RayWorkers`, which implements
:class:`rlpad.trainer.Workers`. Locally (no RAY_ADDRESS) it starts a Ray head on 127.0.0.1;
under ``ray job submit`` it joins the job's cluster.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import ray

from rlpad.batch import Batch
from rlpad.config import Config, rollout_replicas
from workers.actor import ActorWorker
from workers.critic import CriticWorker
from workers.group import WorkerGroup
from workers.placement import plan_nodes
from workers.rollout import RolloutReplicas
from workers.staging import NodePaths, ship_dir

__all__ = ["RANK_INFO_FILE", "RayWorkers", "driver_built_paths", "init_local_ray", "launch_workers"]

RANK_INFO_FILE = "workers.json"  # written next to metrics.jsonl

# vLLM logs every engine step at INFO; keep the console for the progress bar and errors.
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def _cuda(config: Config) -> bool:
    if config.trainer.device == "auto":
        import torch

        return torch.cuda.is_available()
    return config.trainer.device == "cuda"


def driver_built_paths(config: Config) -> list[str]:
    """Model / tokenizer folders the driver built under ``sft.cache_dir`` (the embedded warm start):
    shipped to the workers through the object store (:mod:`workers.staging`)."""
    root = os.path.join(os.path.abspath(config.sft.cache_dir), "")
    arr = config.actor_rollout_ref
    found = {p for p in (arr.model.path, arr.model.tokenizer_path, config.critic.model.path)
             if p and os.path.abspath(p).startswith(root) and os.path.isdir(p)}
    return sorted(found)


class RayWorkers:
    """Actor (+ ref, + critic) FSDP groups and the rollout replicas; see rlpad.trainer.Workers."""

    def __init__(self, config: Config, *, owns_ray: bool = False):
        self.config, self._owns_ray = config, owns_ray
        arr, t = config.actor_rollout_ref, config.trainer
        gpus = 1 if _cuda(config) else 0
        roles = ["actor"] + ["ref"] * config.uses_ref + ["critic"] * config.uses_critic
        bundle = {"CPU": 1.0} | ({"GPU": 1.0} if gpus else {})
        # Every group's ranks of a node share that node: plan the nodes for all groups at once.
        nodes = plan_nodes(t.nnodes, {k: v * t.n_gpus_per_node * len(roles) for k, v in bundle.items()},
                           what=f"trainer.nnodes={t.nnodes} x n_gpus_per_node={t.n_gpus_per_node} ({'+'.join(roles)})")
        paths = NodePaths({p: ship_dir(p) for p in driver_built_paths(config)})
        group = dict(nnodes=t.nnodes, ranks_per_node=t.n_gpus_per_node, nodes=nodes, num_gpus_per_worker=gpus,
                     resolve_path=paths)
        self.actor = WorkerGroup(ActorWorker, arr, role="actor", **group)
        self.ref = WorkerGroup(ActorWorker, arr, role="ref", **group) if config.uses_ref else None
        self.critic = None
        if config.uses_critic:
            self.critic = WorkerGroup(CriticWorker, config.critic, role="critic", rollout_n=arr.rollout.n, **group)
        self.rollout = RolloutReplicas(
            arr.model.path, arr.rollout, config.data, num_replicas=rollout_replicas(config, bool(gpus)),
            num_gpus=gpus * arr.rollout.tensor_model_parallel_size,
            tokenizer_path=arr.model.tokenizer_path, trust_remote_code=arr.model.trust_remote_code,
            resolve_path=paths,
            **({"device": "cuda"} if gpus and arr.rollout.name == "hf" else {}),  # HF generate on its GPU
        )
        self._write_rank_info(os.path.join(t.default_local_dir, RANK_INFO_FILE))

    def _write_rank_info(self, path: str) -> None:
        """``workers.json``: per group and rank, the node it ran on and the rendezvous it used."""
        info = {name: group.rank_info() for name, group in
                (("actor", self.actor), ("ref", self.ref), ("critic", self.critic)) if group is not None}
        info["nodes"] = [{"node_id": n.node_id, "ip": n.ip} for n in self.actor.nodes]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(info, f, indent=1)

    def generate(self, batch: Batch, seed: int) -> Batch:
        return self.rollout.generate(batch, seed=seed)

    def generate_validation(self, batch: Batch) -> Batch:
        return self.rollout.generate_validation(batch)

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
        """Actor weights -> every rollout replica, bucket by bucket, actor-to-actor; returns the seconds.

        The driver only sends the replica handles and gets back rank 0's stats: no weight passes
        through it (workers.actor.ActorWorker.push_weights).
        """
        bucket_bytes = int(self.config.actor_rollout_ref.rollout.weight_sync_bucket_mb * (1 << 20))
        stats = self.actor.call("push_weights", self.rollout.actors, bucket_bytes)[0]
        self.last_sync = stats
        return stats["seconds"]

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
        self.rollout.shutdown()
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
            init_local_ray(groups * world + rollout_replicas(config, _cuda(config)),
                           runtime_env={"env_vars": QUIET_ENV})
            owns = True
    return RayWorkers(config, owns_ray=owns)
