"""N Ray actors of one role forming ONE torch.distributed group, driven from the trainer.

``WorkerGroup(ActorWorker, config, role="actor", nnodes=2, ranks_per_node=4)`` plans the nodes
(:mod:`workers.placement`: the first nodes in IP order with room, ``ValueError`` naming what each
node lacks otherwise), reserves one STRICT_PACK placement group per node (a bundle per rank,
pinned to that node), starts the actors node by node (ranks 0..3 on the first node, 4..7 on the
second), asks rank 0 for its node IP and a free port there (MASTER_ADDR / MASTER_PORT of every
rank) and calls ``init_model`` on all of them (gloo on CPU, nccl on CUDA; each rank picks the
network interface that reaches rank 0). ``world_size=N`` alone means one node with N ranks.
``placement_groups`` (one per node, a bundle per rank): start the ranks on placement groups
reserved by the caller (the colocated pool, shared with other groups, each rank taking a
fraction of its bundle) instead of reserving its own.

``call_batch`` splits a batch across the ranks with equal row counts and balanced token work
(rlpad.batching.balance), runs the method on every rank and merges the results back in the caller's row
order; with ``model.share_prompts`` (the reward model: its section's, for the policy's own rows)
whole prompt groups go to one rank when row counts allow. With sequence parallelism (sp ranks per
group, rlpad.parallel) the rows are split over the ``world / sp`` data-parallel groups of consecutive
ranks, every rank of a group gets the group's rows, and the results come from each group's first rank. A rank whose actor died raises ``rlpad.errors.WorkerFailed`` (a RuntimeError) naming role and rank.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlpad.batch import WORKER_SECONDS, Batch
from rlpad.errors import WorkerFailed
from rlpad.core.shared_prompt import prompt_groups
from rlpad.core.vision import MM_KEY
from rlpad.parallel import data_parallel_groups, dp_size
from rlpad.batching.balance import balance_across_ranks, balance_units_across_ranks, reverse_index, shared_units
from rlpad.batching.micro_batches import row_tokens, vision_patches
from workers.contract import contract_of
from workers.net import free_port
from workers.placement import Node, my_placement, plan_nodes, release, reserve

__all__ = ["WorkerGroup", "ray_rank_class"]


def ray_rank_class(worker_cls: type) -> Any:
    """``ray.remote`` of ``worker_cls`` plus what only a Ray actor can tell: its node and a port there."""

    class RayRank(worker_cls):  # type: ignore[misc, valid-type]
        def node(self) -> dict[str, str]:
            return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id()}

        def rendezvous_endpoint(self) -> tuple[str, int]:
            """This node's IP and a TCP port free on it (asked from rank 0: MASTER_ADDR / MASTER_PORT)."""
            ip = ray.util.get_node_ip_address()
            return ip, free_port(ip)

        def rank_info(self) -> dict[str, Any]:
            return super().rank_info() | self.node()

        def placement(self) -> dict[str, Any]:
            """Node, placement group and assigned resources, from Ray (workers.placement.my_placement)."""
            return my_placement()

    RayRank.__name__ = RayRank.__qualname__ = worker_cls.__name__  # what the Ray state API shows
    return ray.remote(RayRank)


class WorkerGroup:
    """Ray actors ``worker_cls(config, role=role, rank=r, world_size=N, ...)``, r = 0..N-1."""

    def __init__(
        self,
        worker_cls: type,
        config: Any,
        *,
        role: str,
        world_size: int | None = None,
        nnodes: int = 1,
        ranks_per_node: int | None = None,
        nodes: list[Node] | None = None,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float | None = None,
        init_model: bool = True,
        ready_timeout_s: float = 300.0,
        placement_groups: list[Any] | None = None,
        **worker_kwargs: Any,
    ):
        if ranks_per_node is None:
            if world_size is None or world_size % nnodes:
                raise ValueError(f"{role}: give ranks_per_node, or a world_size divisible by nnodes={nnodes}")
            ranks_per_node = world_size // nnodes
        if ranks_per_node < 1 or nnodes < 1:
            raise ValueError(f"{role}: nnodes ({nnodes}) and ranks_per_node ({ranks_per_node}) must be >= 1")
        if world_size is not None and world_size != nnodes * ranks_per_node:
            raise ValueError(f"{role}: world_size={world_size} != nnodes {nnodes} x ranks_per_node {ranks_per_node}")
        world_size = nnodes * ranks_per_node
        if num_gpus_per_worker is None:
            num_gpus_per_worker = 1 if ray.cluster_resources().get("GPU", 0) >= world_size else 0
        self.role, self.world_size = role, world_size
        self._worker_cls, self._config = worker_cls, config
        size_of = getattr(worker_cls, "sequence_parallel_size", None)
        self.sp_size = size_of(config, role) if size_of is not None else 1
        self.dp_size = dp_size(world_size, self.sp_size, role)
        bundle = {"CPU": num_cpus_per_worker} | ({"GPU": num_gpus_per_worker} if num_gpus_per_worker else {})
        if nodes is None:
            nodes = plan_nodes(nnodes, {k: v * ranks_per_node for k, v in bundle.items()}, what=f"{role} group")
        if len(nodes) != nnodes:
            raise ValueError(f"{role}: {len(nodes)} nodes given for nnodes={nnodes}")
        self.nodes = nodes
        self._owns_pgs = placement_groups is None
        if placement_groups is None:
            placement_groups = reserve(nodes, ranks_per_node, bundle, what=f"{role} group", timeout_s=ready_timeout_s)
        elif len(placement_groups) != nnodes or any(pg.bundle_count != ranks_per_node for pg in placement_groups):
            raise ValueError(f"{role}: need {nnodes} placement group(s) of {ranks_per_node} bundles, got "
                             f"{[pg.bundle_count for pg in placement_groups]}")
        self._pgs = placement_groups
        remote_cls = ray_rank_class(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=local),
            ).remote(config, role=role, rank=n * ranks_per_node + local, world_size=world_size, **worker_kwargs)
            for n, pg in enumerate(self._pgs)
            for local in range(ranks_per_node)
        ]
        self.master_addr, self.master_port = self._gather([self.workers[0].rendezvous_endpoint.remote()])[0]
        self.call("set_rendezvous", self.master_addr, self.master_port)
        if init_model:
            self.call("init_model")

    def rank_info(self) -> list[dict[str, Any]]:
        """Per rank: node IP / id, pid, and the MASTER_ADDR / port and socket interface it used."""
        return self.call("rank_info")

    def _gather(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Results per rank; the first failure is raised as soon as it arrives (others may be stuck
        in a collective waiting for the failed rank)."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as e:  # ActorDiedError / ActorUnavailableError included
                raise self._died(rank, e) from e
            except Exception as e:
                # A dead peer often shows first as a collective error on a survivor: name the dead rank.
                for ref in ray.wait(pending, num_returns=len(pending), timeout=5.0)[0] if pending else []:
                    try:
                        ray.get(ref)
                    except RayActorError as dead:
                        raise self._died(rank_of[ref], dead) from e
                    except Exception:
                        pass
                raise
        return results

    def _died(self, rank: int, error: Exception) -> WorkerFailed:
        return WorkerFailed(f"{self.role} worker rank {rank} of {self.world_size} died or is unreachable: {error}")

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank (same arguments); results by rank."""
        return self._gather([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def split(self, batch: Batch, chunk_rows: int | None = None) -> list[list[int]]:
        """Row indices per data-parallel group (per rank without sequence parallelism): equal counts,
        token work balanced; with ``chunk_rows`` each consecutive chunk (e.g. a mini-batch) is
        balanced on its own, so chunks stay whole per group."""
        if not isinstance(batch, Batch):
            raise ValueError(f"{self.role}: expected an rlpad.batch.Batch, got {type(batch).__name__}")
        batch.require("attention_mask", who=self.role)
        dp = self.dp_size
        if len(batch) < dp:
            groups = data_parallel_groups(dp, self.sp_size)
            raise ValueError(f"{self.role}: {len(batch)} rows cannot be split over {groups}")
        lengths = row_tokens(batch)  # valid tokens + a VL row's vision patches
        size = chunk_rows or len(batch)
        # model.share_prompts (actor, critic) or the section's own (reward model), for the policy's own rows
        section = getattr(self._config, "model", self._config)
        share = bool(getattr(section, "share_prompts", False)) and "responses" in batch
        parts: list[list[int]] = [[] for _ in range(dp)]
        for start in range(0, len(batch), size):
            chunk = lengths[start : start + size]
            split = self._split_groups(batch, start, len(chunk)) if share else None
            if split is None:
                split = balance_across_ranks(chunk, min(dp, len(chunk)))
            for group, idx in enumerate(split):
                parts[group].extend(start + i for i in idx)
        return parts

    def _split_groups(self, batch: Batch, start: int, rows: int) -> list[list[int]] | None:
        """With ``model.share_prompts``: whole prompt groups per rank (equal row counts), or None
        when the groups' sizes do not allow it (then rows are split as usual)."""
        batch.require("input_ids", "responses", who=self.role)
        sl = slice(start, start + rows)
        ids, mask = batch["input_ids"][sl], batch["attention_mask"][sl]
        pos = batch.tensors.get("position_ids")
        response_length = int(batch["responses"].shape[1])
        mm = batch.non_tensors.get(MM_KEY)
        groups = prompt_groups(ids, mask, pos[sl] if pos is not None else None, response_length,
                               mm[sl] if mm is not None else None)
        prompt_cols = mask.shape[1] - response_length
        prompts = [n + p for n, p in zip(mask[:, :prompt_cols].sum(-1).tolist(), vision_patches(batch)[sl])]  # images once
        units, tokens = shared_units(groups, prompts, mask[:, prompt_cols:].sum(-1).tolist())
        return balance_units_across_ranks(units, tokens, self.dp_size)

    def call_batch(self, method: str, batch: Batch, *, chunk_rows: int | None = None, **kwargs: Any) -> Any:
        """``method(shard, **kwargs)`` on every rank with its group's shard of ``batch`` (see :meth:`split`):
        the keys of the method's batch contract that ``batch`` holds (:mod:`workers.contract`).

        Batch results are merged in the caller's row order from each data-parallel group's first
        rank; any other result is returned from rank 0 (metrics are all-reduced by the workers, so
        every rank returns the same).
        """
        contract = contract_of(self._worker_cls, method, self._config)
        parts = self.split(batch, chunk_rows)
        batch = batch.select(*contract.present(batch))  # ship only what the method declares it reads
        shards = [batch.index(p) for p in parts]
        if self.sp_size > 1:  # the ranks of a group read one copy from the object store
            shards = [ray.put(shard) for shard in shards]
        refs = [getattr(w, method).remote(shards[rank // self.sp_size], **kwargs)
                for rank, w in enumerate(self.workers)]
        results = self._gather(refs)
        if all(isinstance(r, Batch) for r in results):
            merged = Batch.concat(results[:: self.sp_size]).index(reverse_index(parts))
            seconds = [r.meta[WORKER_SECONDS] for r in results if WORKER_SECONDS in r.meta]
            if seconds:  # the group is as fast as its slowest rank
                merged.meta[WORKER_SECONDS] = max(seconds)
            return merged
        if isinstance(results[0], dict) and all(isinstance(r, dict) and WORKER_SECONDS in r for r in results):
            return results[0] | {WORKER_SECONDS: max(r[WORKER_SECONDS] for r in results)}
        return results[0]

    def shutdown(self) -> None:
        """Kill the actors and release the placement groups it reserved (not the caller's)."""
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        self.workers = []
        if self._owns_pgs:
            release(self._pgs)
