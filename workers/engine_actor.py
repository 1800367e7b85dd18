"""The asynchronous engine client as a Ray actor: requests in flight while the driver takes finished ones.

:class:`EngineActor` is an async actor (Ray runs its methods as coroutines of one event loop, up to
``max_concurrency`` at once) owning one :class:`rlpad.rollout.async_vllm.AsyncVLLMClient`. The driver
(streaming rollouts' trainer, or an agent-loop manager) sends requests with ``submit`` (many per call) and takes
the finished ones with ``collect`` (all that ended since its last call) while the engine goes on with the rest;
``generate`` is one request per call (``ray.wait`` on its ObjectRef); ``start`` + ``chunk`` stream one request in
pieces; ``pause`` / ``load_from_stash`` / ``resume`` put a policy version from the weight stash
(:mod:`workers.weight_stash`) into the paused engine, the requests in flight kept: their later tokens carry
the new version. Start it with :func:`start_engine_actor`. :class:`RemoteEngineClient` is the driver's
:class:`rlpad.rollout.engine_client.EngineClient` over one such actor (the streaming trainer's engines: the
generate()s of one event-loop turn go as one ``submit``, so a group is one Ray call, not n); its weights come from
the stash (:class:`StashWeights`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.errors import WorkerFailed
from rlpad.rollout.base import Sampling
from rlpad.rollout.engine_client import Delta, EngineClient, Generation, RoundRequest

__all__ = ["EngineActor", "RemoteEngineClient", "StashWeights", "Submitted", "start_engine_actor"]


@dataclass(frozen=True)
class Submitted:
    """One request of :meth:`EngineActor.submit` (the arguments of EngineClient.generate)."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    seed: int | None
    partial: Generation | None = None


Finished = tuple[str, Generation | str]  # a request id and its Generation, or why it failed


class _Inbox:
    """One caller's ended requests, taken by :meth:`EngineActor.collect`."""

    def __init__(self) -> None:
        self.items: list[Finished] = []
        self.event = asyncio.Event()

    def put(self, request_id: str, result: Generation | BaseException) -> None:
        why = result if isinstance(result, Generation) else f"{type(result).__name__}: {result}"
        self.items.append((request_id, why))
        self.event.set()

    def ended(self, request_id: str, task: asyncio.Task) -> None:
        """A submitted request's task is done: its Generation, or why not."""
        if task.cancelled():
            self.put(request_id, asyncio.CancelledError("cancelled"))
        else:
            self.put(request_id, task.exception() or task.result())

    async def take(self) -> list[Finished]:
        while not self.items:
            self.event.clear()
            await self.event.wait()
        out, self.items = self.items, []
        return out


class EngineActor:
    """One ``AsyncLLM`` engine behind async Ray methods (built by :meth:`ready`, in the actor's event loop)."""

    def __init__(self, model_path: str, rollout: RolloutConfig, data: DataConfig,
                 resolve_path: Callable[[str], str] | None = None, name: str = "engine", **client_kwargs: Any):
        if resolve_path is not None:  # driver path -> a path readable on this node (workers.staging)
            model_path = resolve_path(model_path)
        self._build = (model_path, rollout, data, client_kwargs)
        self.name, self.client = name, None
        self._streams: dict[str, asyncio.Queue[Delta | Exception]] = {}  # start()ed requests: their deltas not taken yet
        self._inboxes: dict[str, _Inbox] = {}  # per caller: its submit()ted requests that ended, not collected yet

    async def ready(self) -> bool:
        if self.client is None:
            from rlpad.rollout.async_vllm import AsyncVLLMClient

            model_path, rollout, data, kwargs = self._build
            self.client = AsyncVLLMClient(model_path, rollout, data, **kwargs)
        return True

    async def version(self) -> int:
        return self.client.version

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int | None,
                       request_id: str | None = None, partial: Generation | None = None) -> Generation:
        """One sample (EngineClient.generate); the ObjectRef is ready when it has finished or was aborted."""
        return await self.client.generate(prompt_ids, sampling, seed, request_id=request_id, partial=partial)

    async def submit(self, caller: str, requests: Sequence[Submitted]) -> None:
        """Add ``requests`` to the engine in order (each in it when this returns); each one's end goes to ``caller``'s
        :meth:`collect`. One Ray call for many requests (a group's n samples)."""
        inbox = self._inboxes.setdefault(caller, _Inbox())
        for r in requests:
            try:
                task = await self.client.submit(r.prompt_ids, r.sampling, r.seed, request_id=r.request_id,
                                                partial=r.partial)
            except Exception as e:  # refused before it reached the engine: the caller hears it by collect()
                inbox.put(r.request_id, e)
                continue
            task.add_done_callback(functools.partial(inbox.ended, r.request_id))

    async def collect(self, caller: str) -> list[Finished]:
        """``caller``'s submitted requests that ended since the last call (waits for at least one): (request id,
        its Generation or why it failed)."""
        return await self._inboxes.setdefault(caller, _Inbox()).take()

    async def generate_round(self, requests: Sequence[RoundRequest]) -> list[Generation]:
        """A round of the deterministic stream as one batch (EngineClient.generate_round): one Ray call per round."""
        return await self.client.generate_round(requests)

    async def start(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling, seed: int | None,
                    partial: Generation | None = None) -> str:
        """Start a request whose deltas :meth:`chunk` hands out; returns its id."""
        if request_id in self._streams:
            raise ValueError(f"{self.name}: request {request_id!r} is already streaming")
        queue: asyncio.Queue[Delta | Exception] = asyncio.Queue()
        self._streams[request_id] = queue

        async def pump() -> None:
            try:
                async for delta in self.client.stream(prompt_ids, sampling, seed, request_id=request_id,
                                                      partial=partial):
                    queue.put_nowait(delta)
            except Exception as e:  # handed to the next chunk() call
                queue.put_nowait(e)

        asyncio.ensure_future(pump())
        return request_id

    async def chunk(self, request_id: str) -> list[Delta]:
        """The deltas of a started request since the last call (waits for at least one); the last chunk ends
        with the delta that carries the Generation."""
        queue = self._streams[request_id]
        out = [await queue.get()]
        while not queue.empty():
            out.append(queue.get_nowait())
        failed = next((d for d in out if isinstance(d, Exception)), None)
        if failed is not None or out[-1].generation is not None:
            del self._streams[request_id]
        if failed is not None:
            raise RuntimeError(f"{self.name}: request {request_id!r} failed: {failed}") from failed
        return out

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def pause(self, clear_cache: bool = True) -> None:
        await self.client.pause(clear_cache=clear_cache)

    async def resume(self) -> None:
        await self.client.resume()

    async def load_from_stash(self, stash: Any, version: int, num_buckets: int) -> float:
        """Load policy ``version`` from a :class:`workers.weight_stash.WeightStash` (its ``num_buckets`` buckets)
        into the paused engine and release it there; returns the seconds of the load."""
        try:
            buckets = await asyncio.gather(*[stash.get.remote(version, i) for i in range(num_buckets)])
            return await self.client.load_weights([pair for bucket in buckets for pair in bucket], version)
        finally:
            stash.release.remote(version)

    async def shutdown(self) -> bool:
        if self.client is not None:
            await self.client.close()
            self.client = None
        return True


def start_engine_actor(model_path: str, rollout: RolloutConfig, data: DataConfig, *, num_cpus: float = 1,
                       num_gpus: float = 0, max_concurrency: int = 1024, ready_timeout_s: float = 300.0,
                       wait: bool = True, **kwargs: Any) -> Any:
    """An :class:`EngineActor` with its engine started (``max_concurrency``: requests in flight at once;
    ``wait=False``: the caller waits for ``actor.ready``)."""
    actor = ray.remote(EngineActor).options(num_cpus=num_cpus, num_gpus=num_gpus,
                                            max_concurrency=max_concurrency).remote(model_path, rollout, data, **kwargs)
    if wait:
        ray.get(actor.ready.remote(), timeout=ready_timeout_s)
    return actor


@dataclass(frozen=True)
class StashWeights:
    """A policy version's weights in a :class:`workers.weight_stash.WeightStash` (``num_buckets`` buckets)."""

    stash: Any
    num_buckets: int


class RemoteEngineClient(EngineClient):
    """The driver's client of an :class:`EngineActor` (awaited in the driver's event loop); ``version`` follows the
    loads made through it. ``load_weights`` takes :class:`StashWeights` (no weight passes through the driver). An
    actor that died (or cannot be reached) is a :class:`rlpad.errors.WorkerFailed` naming ``name`` (the replica)."""

    supports_pause = True

    def __init__(self, actor: Any, version: int = 0, name: str = "a rollout replica"):
        self.actor, self.version, self.name = actor, int(version), name
        self.eos_token_ids = frozenset()  # the engine ends responses at its own EOS ids
        self._key = uuid.uuid4().hex  # this client's share of the actor's finished requests
        self._ids = itertools.count()
        self._unsent: list[Submitted] = []  # generate()s of this event-loop turn, sent as one submit
        self._waiting: dict[str, asyncio.Future[Generation]] = {}  # submitted, not collected yet
        self._collector: asyncio.Task | None = None
        self._last_submit: asyncio.Task | None = None  # the latest submit call, done when its requests are in

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.actor, method).remote(*args)
        except RayActorError as e:
            raise self._error(e) from e

    async def generate(self, prompt_ids, sampling, seed, *, request_id=None, images=None, partial=None):
        """One sample; the generate()s of one event-loop turn go to the actor as one ``submit`` call and finished
        samples come back many per ``collect`` call (two Ray calls for a group, not one per sample)."""
        if images is not None:
            raise NotImplementedError("RemoteEngineClient: prompts with images are not streamed")
        rid = request_id or f"remote-{self._key[:8]}-{next(self._ids)}"
        if rid in self._waiting:
            raise ValueError(f"{self.name}: request {rid!r} is already in flight")
        loop = asyncio.get_running_loop()
        future = self._waiting[rid] = loop.create_future()
        if not self._unsent:
            loop.call_soon(self._send)
        self._unsent.append(Submitted(rid, list(prompt_ids), sampling, seed, partial))
        try:
            return await future
        finally:
            if self._waiting.get(rid) is future and future.done():
                del self._waiting[rid]

    def _send(self) -> None:
        """Submit the pending generate()s as one call; start the collector if none runs."""
        batch, self._unsent = self._unsent, []
        if not batch:
            return
        ref = self.actor.submit.remote(self._key, batch)
        self._last_submit = asyncio.ensure_future(self._submitted(ref, [r.request_id for r in batch]))
        if self._collector is None or self._collector.done():
            self._collector = asyncio.ensure_future(self._collect())

    async def _submitted(self, ref: Any, request_ids: list[str]) -> None:
        try:
            await ref
        except Exception as e:  # every request of the call fails with it
            self._fail(request_ids, self._error(e))

    async def _collect(self) -> None:
        """Hand each finished sample to its generate() while any is waiting."""
        while self._waiting:
            try:
                finished = await self.actor.collect.remote(self._key)
            except Exception as e:
                self._fail(list(self._waiting), self._error(e))
                return
            for rid, out in finished:
                future = self._waiting.pop(rid, None)
                if future is None or future.done():
                    continue
                if isinstance(out, Generation):
                    future.set_result(out)
                else:
                    future.set_exception(RuntimeError(f"{self.name}: request {rid!r} failed: {out}"))

    def _error(self, e: BaseException) -> BaseException:
        if isinstance(e, RayActorError):
            return WorkerFailed(f"{self.name} died or is unreachable: {e}")
        return e

    def _fail(self, request_ids: Sequence[str], error: BaseException) -> None:
        for rid in request_ids:
            future = self._waiting.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(error)

    async def generate_round(self, requests: Sequence[RoundRequest]) -> list[Generation]:
        return await self._call("generate_round", list(requests))

    async def abort(self, request_id: str) -> None:
        self._send()  # a generate() of this turn is in the engine before its abort is sent
        if self._last_submit is not None:
            await asyncio.wait([self._last_submit])
        await self._call("abort", request_id)

    async def pause(self, *, clear_cache: bool = True) -> None:
        await self._call("pause", clear_cache)

    async def resume(self) -> None:
        await self._call("resume")

    async def load_weights(self, named_tensors: StashWeights, version: int) -> float:
        if not isinstance(named_tensors, StashWeights):
            raise TypeError(f"RemoteEngineClient loads StashWeights, got {type(named_tensors).__name__}")
        seconds = await self._call("load_from_stash", named_tensors.stash, version, named_tensors.num_buckets)
        self.version = int(version)
        return seconds
