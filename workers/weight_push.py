"""The weight push, sender side: an actor rank streams full-weight buckets (or a LoRA adapter) through
the object store into rollout replicas (:class:`workers.rollout.RolloutWorker`) or the weight stash.

:func:`push_weight_buckets` (see :meth:`workers.actor.ActorWorker.push_weights`) ``ray.put``s each
bucket of full tensors once and hands the object ref to every replica's ``update_weights_bucket``; at
most ``max_in_flight`` buckets are outstanding (:func:`stream_buckets`, which also feeds
:class:`workers.weight_stash.WeightStash`). :func:`push_lora_adapter` sends only the adapter tensors
(``rollout.lora_sync=adapter``). A replica that dies mid-push is a :class:`rlpad.errors.WorkerFailed`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from rlpad.errors import WorkerFailed

__all__ = ["push_lora_adapter", "push_weight_buckets", "stream_buckets"]


def _wait_replicas(refs: list[ray.ObjectRef]) -> None:
    """Wait for the replicas' calls; a dead or unreachable replica is a WorkerFailed."""
    try:
        ray.get(refs)
    except RayActorError as e:
        raise WorkerFailed(f"weight sync: a rollout replica died or is unreachable: {e}") from e


def stream_buckets(buckets: Iterable[list[tuple[str, Any]]], send: Callable[[ray.ObjectRef], list[ray.ObjectRef]],
                   max_in_flight: int = 2) -> tuple[int, int]:
    """Put each bucket once in the object store and ``send`` its ref (the calls that take it); at most
    ``max_in_flight`` buckets outstanding: before putting bucket k, the calls of bucket k - max_in_flight
    are waited for (and its object is released). Returns ``(bytes, buckets)``."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    in_flight: deque[list[ray.ObjectRef]] = deque()
    total, count = 0, 0

    def wait_oldest() -> None:
        try:
            ray.get(in_flight.popleft())
        except RayActorError as e:
            raise WorkerFailed(f"weight sync: a receiver died or is unreachable: {e}") from e

    for bucket in buckets:
        while len(in_flight) >= max_in_flight:
            wait_oldest()
        total += sum(t.numel() * t.element_size() for _, t in bucket)
        count += 1
        ref = ray.put(bucket)
        in_flight.append(send(ref))
        del ref, bucket  # the receivers' pending calls keep the object alive until they ran
    while in_flight:
        wait_oldest()
    return total, count


def push_weight_buckets(buckets: Iterable[list[tuple[str, Any]]], replicas: Sequence[Any], *,
                        max_in_flight: int = 2, partial: bool = True) -> dict[str, float]:
    """Send each bucket once to the object store and load it into every replica, then finish the sync.

    ``partial``: there are several buckets (each is then one of several for the engine).

    At most ``max_in_flight`` buckets are outstanding: before putting bucket k the caller waits
    until every replica has loaded bucket k - max_in_flight (and its object is released).
    Returns ``{"seconds", "bytes", "buckets"}``.
    """
    if not replicas:
        raise ValueError("push_weight_buckets: no replicas")
    start = time.perf_counter()
    total, count = stream_buckets(buckets, lambda ref: [r.update_weights_bucket.remote(ref, partial) for r in replicas],
                                  max_in_flight)
    _wait_replicas([r.finish_weight_sync.remote() for r in replicas])
    return {"seconds": time.perf_counter() - start, "bytes": float(total), "buckets": float(count)}


def push_lora_adapter(adapters: dict[str, tuple[Any, Any]], spec: Any, replicas: Sequence[Any]) -> dict[str, float]:
    """LoRA's sync (``rollout.lora_sync=adapter``): the adapter tensors put once in the object store, served
    by every replica as its next policy version, then the sync finished. Returns ``{"seconds", "bytes",
    "buckets"}`` as :func:`push_weight_buckets` does."""
    if not replicas:
        raise ValueError("push_lora_adapter: no replicas")
    start = time.perf_counter()
    total = sum(t.numel() * t.element_size() for pair in adapters.values() for t in pair)
    ref = ray.put(adapters)
    _wait_replicas([r.load_lora_adapter.remote(ref, spec) for r in replicas])
    _wait_replicas([r.finish_weight_sync.remote() for r in replicas])
    return {"seconds": time.perf_counter() - start, "bytes": float(total), "buckets": 1.0}
