"""Asynchronous training's policy versions on their way to the rollout replicas, outside the object store.

With k generations queued before each weight load, up to k versions wait for the engines at once. Put
in the Ray object store whole (one object per bucket), each version would stay pinned there until every
replica had loaded it. Instead one small CPU actor, :class:`WeightStash`, keeps them in its own memory,
and the object store only carries buckets in flight: actor rank 0 streams each bucket in
(:func:`workers.weight_push.stream_buckets`, at most ``max_in_flight`` outstanding) and each replica pulls
them back when its queue reaches the load (:meth:`workers.rollout.RolloutWorker.load_from_stash`, at most
``max_in_flight`` outstanding). A version is dropped once every replica has taken it; nothing is kept
for a version no engine will load (the last step's, without validation: rlpad.training.async_schedule).
"""

from __future__ import annotations

from typing import Any

import ray
import torch

__all__ = ["WeightStash"]

Bucket = list[tuple[str, torch.Tensor]]


class WeightStash:
    """Weight buckets by ``(version, index)``, held until ``replicas`` replicas have released the version."""

    def __init__(self, replicas: int):
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"WeightStash needs replicas >= 1, got {replicas!r}")
        self.replicas = replicas
        self.buckets: dict[int, dict[int, Bucket]] = {}
        self.released: dict[int, int] = {}

    def ready(self) -> bool:
        return True

    def put(self, version: int, index: int, bucket: Bucket) -> int:
        """Keep bucket ``index`` of ``version``; returns its bytes. The tensors arrive as views of the object
        store's copy: cloned, so the object is released as soon as the sender drops it."""
        self.buckets.setdefault(version, {})[index] = [(name, t.clone()) for name, t in bucket]
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def get(self, version: int, index: int) -> Bucket:
        if version not in self.buckets or index not in self.buckets[version]:
            raise KeyError(f"weight stash: no bucket {index} of policy version {version} (held: {self.held()})")
        return self.buckets[version][index]

    def release(self, version: int) -> None:
        """A replica has loaded ``version`` (or given up on it); the last one drops it."""
        self.released[version] = self.released.get(version, 0) + 1
        if self.released[version] >= self.replicas:
            self.buckets.pop(version, None)
            self.released.pop(version)

    def held(self) -> dict[int, int]:
        """Bytes held per version."""
        return {v: sum(t.numel() * t.element_size() for b in bs.values() for _, t in b)
                for v, bs in self.buckets.items()}

    def __repr__(self) -> str:  # in Ray's task errors
        return f"WeightStash(replicas={self.replicas}, versions={sorted(self.buckets)})"


def remote_stash(replicas: int) -> Any:
    """A :class:`WeightStash` actor (0 CPU: it only holds memory and answers quick calls)."""
    stash = ray.remote(WeightStash).options(num_cpus=0).remote(replicas)
    ray.get(stash.ready.remote())
    return stash
