"""The Ray side of the trainer: start the worker groups and the rollout actor for a config.

``launch_workers(config)`` returns :class:`RayWorkers`, which implements
:class:`rlpad.training.trainer.Workers`. Locally (no RAY_ADDRESS) it starts a Ray head on 127.0.0.1;
under ``ray job submit`` it joins the job's cluster.

Two layouts (``trainer.colocate``, rlpad.config.schema.colocated):

- separate: each group (actor, ref, critic) reserves its own bundles (a GPU each on CUDA) and the
  rollout replicas take GPUs of their own; actor rank 0 pushes the weights to every replica.
- colocated: ONE pool of ``nnodes x n_gpus_per_node`` bundles (one STRICT_PACK placement group
  per node, workers.placement). Bundle i hosts actor rank i, ref rank i, critic rank i and rollout
  replica i (tensor_model_parallel_size=1), each with a 1/k share of the bundle's GPU and CPU
  (k co-resident actors). The phases time-share the GPU: :meth:`RayWorkers.begin_generation` /
  :meth:`RayWorkers.end_generation` (hooks the trainer calls around each generation) and
  :meth:`RayWorkers.sync_weights` move memory as described there; actor rank i feeds replica i.

Asynchronous training (``trainer.max_off_policy_steps >= 1``, separate layout): :class:`RayWorkers`
also implements :class:`rlpad.training.async_schedule.AsyncWorkers`: the driver submits every call an engine
gets (generations, and the weight loads of the buckets actor rank 0 put in the object store), so
each engine runs them in the schedule's order (:meth:`RayWorkers.submit_weight_sync`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import ray

from rlpad.algorithms.advantages import uses_critic
from rlpad.batch import Batch
from rlpad.config.schema import Config
from rlpad.embedded.cache import cache_root
from rlpad.lora.rules import engine_lora_kwargs, lora_spec, syncs_adapter
from rlpad.rollout import backend_class
from rlpad.rewards.settings import reward_model_section
from rlpad.run_log import RunLog
from rlpad.topology import colocated, resolve_device, rollout_replicas
from workers.actor import ActorWorker
from rlpad.algorithms.distillation_rules import teacher_path
from workers.teacher import own_pool, student_section, teacher_group_kwargs, teacher_section, tokenizer_ids
from workers.critic import CriticWorker
from workers.engine_actor import RemoteEngineClient, StashWeights, start_engine_actor
from workers.reward_model import RewardModelWorker
from workers.group import WorkerGroup
from workers.judge import judge_engine_resources, judge_replicas
from workers.placement import check_cluster_room, engine_resources, plan_nodes, release, reserve
from workers.ray_logs import quiet_ray_logger, route_worker_output
from workers.rollout import PendingRollout, RolloutReplicas
from workers.staging import NodePaths, ship_dir
from workers.weight_stash import remote_stash

__all__ = ["RANK_INFO_FILE", "RayWorkers", "driver_built_paths", "init_local_ray", "launch_workers", "local_ray"]

RANK_INFO_FILE = "workers.json"  # written next to metrics.jsonl

# vLLM logs every engine step at INFO; keep the console for the progress bar and errors (a run's
# RunLog sets VLLM_LOGGING_LEVEL from trainer.log_level).
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def _cuda(config: Config) -> bool:
    return resolve_device(config) == "cuda"


def driver_built_paths(config: Config) -> list[str]:
    """Model / tokenizer folders the driver built under ``sft.cache_dir`` (rlpad.embedded.cache) (the embedded warm start):
    shipped to the workers through the object store (:mod:`workers.staging`)."""
    root = os.path.join(cache_root(config.sft), "")
    arr = config.actor_rollout_ref
    found = {p for p in (arr.model.path, arr.model.tokenizer_path, config.critic.model.path,
                         config.reward.reward_model.model_path if config.reward.reward_model.enable else None,
                         config.reward.judge.model_path if config.reward.judge.enable else None,
                         teacher_path(config))
             if p and os.path.isdir(p) and os.path.abspath(p).startswith(root)}  # isdir first: no getcwd for "tiny:..."
    return sorted(found)


class RayWorkers:
    """Actor (+ ref, + critic) FSDP groups and the rollout replicas; see rlpad.training.trainer.Workers."""

    def __init__(self, config: Config, *, owns_ray: bool = False):
        self.config, self._owns_ray = config, owns_ray
        self.stash: Any = None  # the weight stash of asynchronous training (made at its first weight sync)
        arr, t = config.actor_rollout_ref, config.trainer
        cuda = _cuda(config)
        gpus = 1 if cuda else 0
        self.colocated = colocated(config, cuda)
        critic = uses_critic(config)
        rm = config.reward.reward_model.enable
        teacher_pool = own_pool(config)  # on-policy distillation: the teacher's own pool, or None: in this one
        roles = (["actor"] + ["ref"] * config.builds_ref + ["critic"] * critic + ["reward_model"] * rm
                 + ["teacher"] * (config.distillation.enabled and teacher_pool is None))
        bundle = {"CPU": 1.0} | ({"GPU": 1.0} if gpus else {})
        # Every group's ranks of a node share that node: plan the nodes for all groups at once.
        per_node = {k: v * t.n_gpus_per_node * (1 if self.colocated else len(roles)) for k, v in bundle.items()}
        layout = "colocated pool: " if self.colocated else ""
        nodes = plan_nodes(t.nnodes, per_node, what=f"{layout}trainer.nnodes={t.nnodes} x n_gpus_per_node="
                                                     f"{t.n_gpus_per_node} ({'+'.join(roles)})")
        num_replicas = rollout_replicas(config, cuda)
        judge = config.reward.judge
        if not self.colocated:  # the engines go anywhere, after the groups: check the whole cluster first
            need = {k: per_node[k] * t.nnodes for k in per_node}
            for engines in (engine_resources(num_replicas, arr.rollout.tensor_model_parallel_size, gpus),
                            judge_engine_resources(config, gpus)):
                for k, v in engines.items():
                    need[k] = need.get(k, 0.0) + v
            parts = [f"{'+'.join(roles)} groups", f"{num_replicas} rollout engine(s)"]
            parts += [f"{judge.rollout.num_replicas} judge engine(s)"] if judge.enable else []
            check_cluster_room(need, what=", ".join(parts[:-1]) + " and " + parts[-1])
        paths = NodePaths({p: ship_dir(p) for p in driver_built_paths(config)})
        engine = dict(tokenizer_path=arr.model.tokenizer_path, trust_remote_code=arr.model.trust_remote_code,
                      resolve_path=paths, device="cuda" if gpus else "cpu", **engine_lora_kwargs(config))
        group = dict(nnodes=t.nnodes, ranks_per_node=t.n_gpus_per_node, nodes=nodes, resolve_path=paths, seed=t.seed)
        self.pool: list[Any] = []
        self.engines: list[Any] = []  # streaming (async_training.enable): workers.engine_actor.EngineActor each
        self.ref = self.critic = self.reward_model = self.teacher = self.judge = None
        vocab = tokenizer_ids(config) if config.distillation.enabled else None
        try:
            if self.colocated:
                # One rank of each group and one engine per bundle, each with a 1/k share of it.
                k = len(roles) + 1
                share = math.floor(10_000 / k) / 10_000  # Ray counts resources in units of 1e-4
                self.pool = reserve(nodes, t.n_gpus_per_node, bundle, what="colocated pool", timeout_s=300.0)
                per = t.n_gpus_per_node
                # The engines first (vLLM sizes its KV cache from the GPU memory free at start), then asleep.
                self.rollout = RolloutReplicas(
                    arr.model.path, arr.rollout, config.data, num_replicas=num_replicas, num_cpus=share,
                    num_gpus=share * gpus, placements=[(self.pool[r // per], r % per) for r in range(num_replicas)],
                    sleep_mode=bool(gpus), **engine)
                self.rollout.sleep()
                group |= dict(num_cpus_per_worker=share, num_gpus_per_worker=share * gpus, placement_groups=self.pool)
                if not (cuda and backend_class(arr.rollout.name).sleep_frees_memory):
                    why = "on CPU" if not cuda else f"the {arr.rollout.name} rollout backend has no sleep mode"
                    print(f"colocated layout ({why}): the engines' sleep / wake_up calls run each step and free "
                          "nothing", flush=True)
            else:
                group |= dict(num_gpus_per_worker=gpus)
            self.actor = WorkerGroup(ActorWorker, student_section(config, vocab), role="actor", **group)
            if config.builds_ref:
                self.ref = WorkerGroup(ActorWorker, arr, role="ref", **group)
            if config.distillation.enabled:
                self.teacher = WorkerGroup(ActorWorker, teacher_section(config, vocab), role="teacher",
                                           **teacher_group_kwargs(config, group, gpus=gpus))
            if critic:
                self.critic = WorkerGroup(CriticWorker, config.critic, role="critic", rollout_n=arr.rollout.n, **group)
            if rm:
                self.reward_model = WorkerGroup(RewardModelWorker, reward_model_section(config), role="reward_model",
                                                trust_remote_code=arr.model.trust_remote_code,
                                                share_min_saved=arr.model.share_prompts_min_saved_fraction, **group)
            if not self.colocated and config.async_training.enable:  # streaming: asynchronous engines
                self.engines = [start_engine_actor(
                    arr.model.path, arr.rollout, config.data, num_gpus=gpus * arr.rollout.tensor_model_parallel_size,
                    wait=False, tokenizer_path=arr.model.tokenizer_path, trust_remote_code=arr.model.trust_remote_code,
                    resolve_path=paths, name=f"engine {r}", deterministic=config.async_training.deterministic)
                    for r in range(num_replicas)]
                ray.get([e.ready.remote() for e in self.engines], timeout=600)
            elif not self.colocated:
                self.rollout = RolloutReplicas(
                    arr.model.path, arr.rollout, config.data, num_replicas=num_replicas,
                    num_gpus=gpus * arr.rollout.tensor_model_parallel_size, **engine)
            if judge.enable:  # the generative judge: vLLM engines of its own model (rlpad.rewards.judge)
                self.judge = judge_replicas(config, paths, gpus)
        except BaseException:
            self.shutdown()
            raise
        # Weight sync: colocated, the rank on replica r's bundle feeds it; separate, rank 0 feeds all.
        world = t.n_gpus_per_node * t.nnodes
        self._targets = [[rank] if rank < num_replicas else [] for rank in range(world)] if self.colocated else None
        self._write_rank_info(os.path.join(t.default_local_dir, RANK_INFO_FILE))

    def _write_rank_info(self, path: str) -> None:
        """``workers.json``: per group and rank, the node it ran on and the rendezvous it used."""
        info = {name: group.rank_info() for name, group in
                (("actor", self.actor), ("ref", self.ref), ("critic", self.critic),
                 ("reward_model", self.reward_model), ("teacher", self.teacher)) if group is not None}
        info["nodes"] = [{"node_id": n.node_id, "ip": n.ip} for n in self.actor.nodes]
        info["colocated"] = self.colocated
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(info, f, indent=1)

    def generate(self, batch: Batch, seed: int) -> Batch:
        return self.rollout.generate(batch, seed=seed)

    def generate_validation(self, batch: Batch, seed: int | None = None) -> Batch:
        return self.rollout.generate_validation(batch, seed=seed)

    def generate_greedy(self, batch: Batch, seed: int | None = None) -> Batch:
        """One greedy response per prompt row (remax's baseline), by the rollout replicas."""
        return self.rollout.generate_greedy(batch, seed=seed)

    def judge_generate(self, prompts: Batch) -> Batch:
        """The judge engines' greedy answer to each left-padded prompt row, split in whole slices between them."""
        if self.judge is None:
            raise ValueError("judge verdicts asked for, but reward.judge.enable is false")
        return self.judge.generate_validation(prompts)

    def submit_generate(self, batch: Batch, seed: int) -> PendingRollout:
        """:meth:`generate` without waiting (rlpad.training.async_schedule.AsyncWorkers)."""
        return self.rollout.submit_generate(batch, seed=seed)

    def submit_weight_sync(self, version: int) -> PendingRollout:
        """The actor's weights into every replica as policy ``version``, behind the calls already submitted.

        The actor ranks gather the full tensors in buckets and rank 0 streams them into the weight stash
        (workers.weight_stash; waited for: the actor's own work); the driver then submits each replica's
        load from the stash and returns (rlpad.training.async_schedule.AsyncWorkers). No weight passes through
        the driver, and the object store holds only the buckets in flight. With ``rollout.lora_sync=adapter`` only
        the adapter tensors go (KBs to MBs, gathered by rank 0 and put in the object store by the driver), each
        replica serving them when its queue reaches the load.
        """
        if syncs_adapter(self.config):  # the adapter only (small): through the object store, no stash
            adapters = self.actor.call("lora_adapters")[0]
            return self.rollout.submit_lora_adapter(adapters, lora_spec(self.config.actor_rollout_ref.model), version)
        bucket_bytes = int(self.config.actor_rollout_ref.rollout.weight_sync_bucket_mb * (1 << 20))
        if self.stash is None:
            self.stash = remote_stash(len(self.rollout))
        num_buckets = self.actor.call("export_weights", bucket_bytes, self.stash, version)[0]
        return self.rollout.submit_weights(self.stash, version, num_buckets)

    def engine_clients(self) -> list[RemoteEngineClient]:
        """Streaming: a driver-side client of each asynchronous engine (rlpad.training.streaming.StreamWorkers)."""
        return [RemoteEngineClient(e, name=f"rollout replica {i} of {len(self.engines)}")
                for i, e in enumerate(self.engines)]

    def stage_weights(self, version: int) -> StashWeights:
        """Streaming: the actor's weights as policy ``version`` in the weight stash (actor rank 0 streams the
        buckets there; no weight passes through the driver), for each engine's ``load_from_stash``."""
        if self.stash is None:
            self.stash = remote_stash(len(self.engines))
        bucket_bytes = int(self.config.actor_rollout_ref.rollout.weight_sync_bucket_mb * (1 << 20))
        return StashWeights(self.stash, self.actor.call("export_weights", bucket_bytes, self.stash, version)[0])

    def compute_log_prob(self, batch: Batch, *, for_update: bool = True) -> Batch:
        """Old log-probs. ``for_update`` with ``actor.old_log_prob_layout=update``: split over the ranks
        and into micro-batches exactly as :meth:`update_actor` will split the same batch."""
        if for_update and self.config.actor_rollout_ref.actor.old_log_probs_split_as_update:
            return self.actor.call_batch("compute_log_prob", batch, chunk_rows=self._mini_rows(), update_layout=True)
        return self.actor.call_batch("compute_log_prob", batch)

    def compute_teacher(self, batch: Batch) -> Batch:
        """On-policy distillation: the teacher group's numbers for the batch (ActorWorker.compute_teacher)."""
        if self.teacher is None:
            raise ValueError("teacher scores asked for, but distillation.enabled is false")
        return self.teacher.call_batch("compute_teacher", batch)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Reference log-probs: the reference model's, or with LoRA the actor's with its adapters disabled."""
        if self.config.ref_in_actor:
            return self.actor.call_batch("compute_ref_log_prob", batch)
        if self.ref is None:
            raise ValueError("ref log-probs asked for, but neither use_kl_loss nor use_kl_in_reward is set")
        return self.ref.call_batch("compute_ref_log_prob", batch)

    def compute_values(self, batch: Batch) -> Batch:
        return self.critic.call_batch("compute_values", batch)

    def compute_rm_scores(self, batch: Batch) -> Batch:
        """``rm_scores`` (B,): the reward-model group on the reward model's inputs, split and balanced over its ranks."""
        if self.reward_model is None:
            raise ValueError("reward-model scores asked for, but reward.reward_model.enable is false")
        return self.reward_model.call_batch("compute_rm_scores", batch)

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

        The driver only sends the replica handles and gets back the feeding ranks' stats: no weight
        passes through it (workers.actor.ActorWorker.push_weights). Separate layout: rank 0 feeds
        every replica. Colocated: the engines' weights wake up first (vLLM ``wake_up(["weights"])``;
        the KV cache stays freed until :meth:`begin_generation`) and actor rank i feeds replica i
        on its own bundle, so each bucket stays in its node's object store.
        """
        if self.engines:  # streaming, before the stream starts: the actor's weights as version 0
            weights = self.stage_weights(0)
            ray.get([e.pause.remote(True) for e in self.engines])
            seconds = ray.get([e.load_from_stash.remote(weights.stash, 0, weights.num_buckets) for e in self.engines])
            ray.get([e.resume.remote() for e in self.engines])
            return max(seconds)
        bucket_bytes = int(self.config.actor_rollout_ref.rollout.weight_sync_bucket_mb * (1 << 20))
        if self.colocated:
            self.rollout.wake_up(["weights"])
        if syncs_adapter(self.config):  # the adapter only, from rank 0 (KBs to MBs)
            stats = [s for s in self.actor.call("push_lora_adapter", self.rollout.actors) if s is not None]
        else:
            stats = [s for s in self.actor.call("push_weights", self.rollout.actors, bucket_bytes,
                                                targets=self._targets) if s is not None]
        self.last_sync = stats[0] | {"seconds": max(s["seconds"] for s in stats), "feeding_ranks": float(len(stats))}
        return self.last_sync["seconds"]

    def begin_generation(self) -> bool:
        """Colocated, before each generation: the engines' weights wake up (unless a sync already woke
        them), the actor's parameters / optimizer state go to host memory (``actor.fsdp_config.param_offload``
        / ``optimizer_offload``) and every group's cached CUDA blocks go back to the device, then the
        engines' KV cache wakes up. Separate layout: nothing. Returns whether it did anything."""
        self.last_offload_bytes = 0
        if self.colocated:
            self.rollout.wake_up(["weights"])
            self.last_offload_bytes = sum(self.actor.call("offload_state"))
            for group in (self.ref, self.critic, self.reward_model, self.teacher):  # parameters stay; cached activation blocks go
                if group is not None:
                    group.call("empty_device_cache")
            self.rollout.wake_up(["kv_cache"])
        return self.colocated

    def end_generation(self) -> bool:
        """Colocated, after each generation: the engines sleep (vLLM level 1: KV cache dropped, weights
        to host memory), then the actor's state comes back. Separate layout: nothing. Returns whether it
        did anything."""
        if self.colocated:
            self.rollout.sleep()
            self.actor.call("reload_state")
        return self.colocated

    def _groups(self) -> dict[str, WorkerGroup]:
        return {name: g for name, g in (("actor", self.actor), ("critic", self.critic)) if g is not None}

    def save_checkpoint(self, path: str) -> None:
        for name, group in self._groups().items():
            group.call("save_checkpoint", os.path.join(path, name))

    def load_checkpoint(self, path: str) -> None:
        for name, group in self._groups().items():
            group.call("load_checkpoint", os.path.join(path, name))

    def save_hf(self, path: str, role: str) -> None:
        """``role``'s Hugging Face folder at ``path``, streamed from its ranks' shards (rank 0 writes)."""
        self._groups()[role].call("save_hf", path)

    def shutdown(self) -> None:
        for group in (getattr(self, "actor", None), self.ref, self.critic, self.reward_model, self.teacher):
            if group is not None:
                group.shutdown()
        if hasattr(self, "rollout"):
            self.rollout.shutdown()
        for engine in getattr(self, "engines", []):
            with contextlib.suppress(Exception):
                ray.get(engine.shutdown.remote(), timeout=30)
            ray.kill(engine)
        if self.judge is not None:
            self.judge.shutdown()
        if getattr(self, "stash", None) is not None:
            ray.kill(self.stash)
            self.stash = None
        release(self.pool)
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


@contextlib.contextmanager
def local_ray(num_cpus: int, **kwargs: Any) -> Iterator[None]:
    """A local Ray (:func:`init_local_ray`) for the ``with`` block, unless one is running already;
    shut down at the end only if started here (the benchmarks' way to reach Ray). Inside an open
    :class:`RunLog` (``rlpad bench``) Ray's and the workers' output go through it, as in training."""
    started = not ray.is_initialized()
    run_log, undo = RunLog.active(), None
    if started:
        if run_log is not None:
            quiet_ray_logger(run_log)
            env = dict(kwargs.get("runtime_env") or {})
            env["env_vars"] = dict(env.get("env_vars") or {}) | run_log.worker_env()
            kwargs = kwargs | {"runtime_env": env}
        init_local_ray(num_cpus, **kwargs)
        if run_log is not None:
            undo = route_worker_output(run_log)
    try:
        yield
    finally:
        if undo is not None:
            undo()
        if started:
            ray.shutdown()


def object_store_bytes_used() -> int:
    """Bytes in the object store of this Ray's nodes (the raylets' own stats; the benchmarks)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return int(get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
               .store_stats.object_store_bytes_used)


def launch_workers(config: Config, run_log: RunLog | None = None) -> RayWorkers:
    """Join the Ray cluster (RAY_ADDRESS) or start a local head on 127.0.0.1, then the workers.
    With ``run_log``, Ray's and the workers' output go through it (workers/ray_logs.py)."""
    owns = False
    if not ray.is_initialized():
        if run_log is not None:
            quiet_ray_logger(run_log)
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            world = config.trainer.n_gpus_per_node * config.trainer.nnodes
            groups = 1 + config.builds_ref + uses_critic(config) + config.reward.reward_model.enable + config.distillation.enabled
            # Logical CPUs: one per worker process (each runs with one torch thread on CPU), or one
            # per bundle of the colocated pool (its processes share it).
            cpus = world if colocated(config, _cuda(config)) else groups * world + rollout_replicas(config, _cuda(config))
            cpus += int(judge_engine_resources(config, 0).get("CPU", 0))
            init_local_ray(cpus, runtime_env={"env_vars": QUIET_ENV | (run_log.worker_env() if run_log else {})})
            owns = True
    if run_log is not None:
        undo = route_worker_output(run_log)
        if undo is not None:
            run_log.on_close(undo)
    return RayWorkers(config, owns_ray=owns)
