"""Streaming rollouts, the engines' side: engines generate continuously from a prompt stream into the group buffer.

One event loop drives any number of :class:`rlpad.rollout.engine_client.EngineClient` (one request per sample).
A prompt's group (n requests, on the engine with the most free slots) starts while verl's staleness quota
allows (:class:`~rlpad.training.stream_staleness.Admission`) and an engine has n free slots; a finished
response is scored; a complete group is handed to ``on_group`` (the trainer's rewards, awaited off the event
loop) and then through the :class:`~rlpad.training.group_buffer.GroupBuffer`'s filter; finished responses
free their slots and the next group starts before the group is scored. :meth:`StreamRollout.take` is the
trainer's side (waits for k fresh groups; the wait is timed). :meth:`StreamRollout.load_weights` lands new
weights mid-generation: every engine pauses at a token boundary (its requests kept, KV dropped), the responses the rule says
to regenerate (all with ``partial_rollout=false``; those past the hard cap otherwise) are aborted, the
weights load, the engines resume: the kept responses continue from the tokens they had, later tokens
carrying the new version (the engine's own label), the aborted ones start again from the prompt
(counted). Engine busy intervals (>= 1 request in flight, not paused) give the idle share.

Ray-free (the Ray side wraps each engine: workers/engine_actor.py); the trainer loop that calls take / load_weights:
rlpad/training/streaming.py.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlpad.rollout.base import NamedTensors, Sampling
from rlpad.rollout.engine_client import EngineClient, Generation, continuation_seed
from rlpad.rollout.seeds import sample_seed
from rlpad.training.group_buffer import Group, GroupBuffer
from rlpad.training.stream_metrics import buffer_metrics
from rlpad.training.stream_response import Response
from rlpad.training.stream_staleness import Admission, StalenessRule

__all__ = ["StreamPrompt", "StreamRollout", "request_seed"]


@dataclass
class StreamPrompt:
    """A prompt of the stream: its group's ``uid``, token ids, the run's ``seed``, its ``index`` in the stream
    (global, as a step's prompt index) and whatever the loop keeps (``row``)."""

    uid: str
    prompt_ids: list[int]
    seed: int
    row: Any = None
    index: int = 0


def request_seed(prompt: StreamPrompt, response: Response) -> int:
    """The engine seed of a response: the project's rule (:func:`rlpad.rollout.seeds.sample_seed` of the seed, the
    prompt's index and the sample's), its k-th regeneration from the prompt seeded as a k-th continuation
    (:func:`rlpad.rollout.engine_client.continuation_seed`)."""
    seed = sample_seed(prompt.seed, prompt.index, response.index)
    return continuation_seed(seed, response.restarts) if response.restarts else seed


@dataclass
class _Request:
    response: Response
    engine: int
    request_id: str
    started_version: int  # the engine's version when (re)submitted: its oldest token is at least this new


@dataclass
class _Engine:
    client: EngineClient
    in_flight: int = 0
    busy: list[tuple[float, float]] = field(default_factory=list)
    busy_since: float | None = None


class StreamRollout:
    """See the module docstring. ``score(prompt, response) -> float`` sets each finished response's score (the
    group filter of ``buffer`` reads it); ``on_group(group)`` is awaited as each group completes, before the
    buffer's filter (the trainer's rewards, computed off the event loop while the engines go on; it may set the
    responses' scores the filter reads); ``slots_per_engine``: requests in flight per engine at most (>= n)."""

    def __init__(self, clients: Sequence[EngineClient], prompts: Iterator[StreamPrompt], *, n: int,
                 sampling: Sampling, rule: StalenessRule, buffer: GroupBuffer, slots_per_engine: int,
                 score: Callable[[StreamPrompt, Response], float] | None = None,
                 on_group: Callable[[Group], Awaitable[None]] | None = None):
        if slots_per_engine < n:
            raise ValueError(f"slots_per_engine={slots_per_engine} must be >= n={n}: a group runs on one engine")
        if not clients:
            raise ValueError("no engine")
        self.engines = [_Engine(c) for c in clients]
        self.prompts, self.n, self.sampling, self.rule, self.buffer = prompts, n, sampling, rule, buffer
        self.slots, self.score, self.on_group = slots_per_engine, score, on_group
        self.admission = Admission(rule)
        self.requests: dict[str, _Request] = {}
        self.tasks: set[asyncio.Task] = set()
        self.prompt_of: dict[str, StreamPrompt] = {}
        self.started_groups = self.taken_groups = self.regenerated = 0
        self.exhausted = False
        self.open = asyncio.Event()  # requests may be (re)submitted: set except while weights load
        self.open.set()
        self.changed = asyncio.Event()  # a response finished (or the stream ran dry)
        self.trainer_wait: list[tuple[float, float]] = []
        self.loads: list[tuple[float, float]] = []  # each weight load: engines paused .. resumed
        self.errors: list[BaseException] = []
        self._ids = itertools.count()

    # ---- the engines' side
    def fill(self) -> None:
        """Start groups while the quota allows and an engine has n free slots."""
        while not self.exhausted and self.admission.may_start():
            engine = max(range(len(self.engines)), key=lambda i: self.slots - self.engines[i].in_flight)
            if self.slots - self.engines[engine].in_flight < self.n:
                return
            prompt = next(self.prompts, None)
            if prompt is None:
                self.exhausted = True
                self.changed.set()
                return
            self.admission.started()
            self.started_groups += 1
            self.prompt_of[prompt.uid] = prompt
            for j in range(self.n):
                self._submit(prompt, Response(prompt.uid, j), engine)

    def _submit(self, prompt: StreamPrompt, response: Response, engine: int) -> None:
        e = self.engines[engine]
        rid = f"{prompt.uid}-{response.index}-{next(self._ids)}"
        self.requests[rid] = _Request(response, engine, rid, e.client.version)
        if e.in_flight == 0 and self.open.is_set():
            e.busy_since = time.perf_counter()
        e.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._sample(prompt, rid))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())
            self.changed.set()

    async def _sample(self, prompt: StreamPrompt, rid: str) -> None:
        req = self.requests[rid]
        response, e = req.response, self.engines[req.engine]
        await self.open.wait()
        seed = request_seed(prompt, response)
        gen = await e.client.generate(prompt.prompt_ids, self.sampling, seed, request_id=rid)
        del self.requests[rid]
        self._release(e)
        if gen.finish_reason == "abort":  # regenerate from the prompt (restarted by load_weights)
            self._submit(prompt, response, req.engine)
            return
        self.fill()  # the freed slots take new groups before this one is scored
        await self._finish(prompt, response, gen)

    def _release(self, e: _Engine) -> None:
        e.in_flight -= 1
        if e.in_flight == 0 and e.busy_since is not None:
            e.busy.append((e.busy_since, time.perf_counter()))
            e.busy_since = None

    async def _finish(self, prompt: StreamPrompt, response: Response, gen: Generation) -> None:
        for token, log_prob, version in zip(gen.token_ids, gen.log_probs, gen.versions):
            response.extend([token], [log_prob], version)
        response.done = True
        if self.score is not None:
            response.score = float(self.score(prompt, response))
        group = self.buffer.complete(response, prompt.row)
        if group is not None:
            if self.on_group is not None:
                await self.on_group(group)
            self.buffer.admit(group)  # no await since on_group: the trainer never sees a scored group not admitted
        self.changed.set()

    async def load_weights(self, named_tensors: NamedTensors, version: int) -> float:
        """New weights of policy ``version`` into every engine mid-generation (the module docstring); returns the
        seconds the engines were paused. Opens the staleness quota's next window."""
        start = time.perf_counter()
        self.open.clear()
        for e in self.engines:
            if e.busy_since is not None:
                e.busy.append((e.busy_since, start))
                e.busy_since = None
        # each phase on every engine at once (the engines are separate processes); the next phase after all of them
        await asyncio.gather(*[e.client.pause(clear_cache=True) for e in self.engines])
        restart = [r for r in self.requests.values()
                   if self.rule.must_restart(r.started_version, version)]
        for r in restart:
            r.response.restart()
            self.regenerated += 1
        await asyncio.gather(*[self.engines[r.engine].client.abort(r.request_id) for r in restart])
        await asyncio.gather(*[e.client.load_weights(named_tensors, version) for e in self.engines])
        await asyncio.gather(*[e.client.resume() for e in self.engines])
        now = time.perf_counter()
        self.loads.append((start, now))
        for e in self.engines:
            if e.in_flight:
                e.busy_since = now
        self.open.set()
        self.admission.on_weight_load(self.carried)
        self.fill()
        return now - start

    @property
    def carried(self) -> int:
        """Groups started and not yet trained, dropped or filtered out."""
        b = self.buffer
        return self.started_groups - self.taken_groups - b.dropped_groups - b.filtered_groups

    # ---- the trainer's side
    async def take(self, k: int, updates_applied: int) -> list[Group] | None:
        """``k`` fresh groups for an update with ``updates_applied`` updates applied; waits (timed) until the buffer
        holds them; None when the prompts ran out first."""
        self.fill()
        start = time.perf_counter()
        try:
            while True:
                if self.errors:
                    raise self.errors[0]
                dropped = self.buffer.dropped_groups
                groups = self.buffer.take(k, updates_applied, self.rule)
                if self.buffer.dropped_groups > dropped:  # carried groups past the cap: their quota freed
                    self.admission.on_dropped(self.buffer.dropped_groups - dropped)
                    self.fill()
                if groups is not None:
                    self.taken_groups += k
                    self.fill()
                    return groups
                if self.exhausted and not self.requests:
                    return None
                self.changed.clear()
                await self.changed.wait()
        finally:
            self.trainer_wait.append((start, time.perf_counter()))

    def step_counts(self, depth: int) -> dict[str, float]:
        """The run's ``stream/*`` counts now (rlpad.training.stream_metrics.buffer_metrics), ``depth`` the buffer's."""
        return buffer_metrics(self.buffer, self.regenerated, depth)

    def waiting_uids(self) -> set[str]:
        """Groups the trainer may still get (the buffer's)."""
        return {g.uid for g in self.buffer.ready}

    def release(self, version: int) -> None:
        """The trainer is done with the engines after a load (validation): nothing waits for it here."""

    def busy_intervals(self, now: float | None = None) -> list[list[tuple[float, float]]]:
        """Each engine's busy intervals so far (an open one closed at ``now``)."""
        now = time.perf_counter() if now is None else now
        return [e.busy + ([(e.busy_since, now)] if e.busy_since is not None else []) for e in self.engines]

    def timeline(self, t0: float, now: float | None = None) -> dict[str, Any]:
        """Seconds since ``t0``: each engine's busy intervals, the trainer's waits and the weight loads (a JSON-ready
        dict; rlpad.bench.stream_timeline draws it)."""
        def rel(spans: Sequence[tuple[float, float]]) -> list[list[float]]:
            return [[round(a - t0, 4), round(b - t0, 4)] for a, b in spans]

        return {"engines": [rel(b) for b in self.busy_intervals(now)], "trainer_wait": rel(self.trainer_wait),
                "loads": rel(self.loads)}

    async def close(self) -> None:
        """Abort what is in flight and wait for the requests' tasks (an engine that died: nothing to abort there)."""
        await asyncio.gather(*[self.engines[r.engine].client.abort(r.request_id) for r in list(self.requests.values())],
                             return_exceptions=True)
        self.exhausted = True
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
