"""The deterministic stream (``async_training.deterministic``): the engines' side on a logical clock of rounds.

:class:`StreamRounds` has :class:`~rlpad.training.stream_rollout.StreamRollout`'s interface for the trainer (``take``,
``load_weights``, ``close``, ``timeline``) but no wall time decides anything. Round r, over all engines at once:

1. groups start as :meth:`StreamRollout.fill` starts them (the staleness quota; the engine with the most free slots,
   ties to the lowest index), in prompt order;
2. every engine gets ONE :meth:`~rlpad.rollout.engine_client.EngineClient.generate_round` call with all its unfinished
   responses (submission order), each resubmitted as prompt + its tokens with budget min(b_r, R - its length),
   b_r = :func:`round_budget` (``rollout.seed``, r, ``round_tokens``), seeded :func:`request_seed` for its first chunk
   and :func:`~rlpad.rollout.engine_client.continuation_seed` (that, k) for its k-th;
3. in engine order then submission order: a response that hit EOS or R tokens is done; a group completed is scored
   (``on_group``, awaited) and goes through the buffer's filter; then step s = (steps taken) + 1 takes its k groups
   (the buffer's FIFO take with s - 1 updates applied, drops counted) as soon as the buffer holds them: r_s = r.
   When step s is followed by a weight load (``loads_after(s)``), version s loads at the end of round r_s + 1 on
   every engine (waiting for the trainer to stage it); the responses in flight continue or restart by
   :meth:`StalenessRule.must_restart`. With ``holds(s)`` the next round waits for :meth:`release` (validation).

At each load the state is captured (:meth:`state`, JSON-ready: every in-flight response with its chunk count, the
pending partial groups, the ready and the taken-not-trained groups, the counters, the quota, the round and the next
prompt index); :meth:`restore` rebuilds it from the prompt stream replayed. Pure Python (no Ray, no torch).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlpad.rollout.base import NamedTensors, Sampling
from rlpad.rollout.engine_client import EngineClient, RoundRequest, continuation_seed
from rlpad.training.group_buffer import Group, GroupBuffer
from rlpad.training.stream_metrics import buffer_metrics
from rlpad.training.stream_response import Response
from rlpad.training.stream_rollout import StreamPrompt, request_seed
from rlpad.training.stream_staleness import Admission, StalenessRule

__all__ = ["StreamRounds", "round_budget"]


def round_budget(seed: int, round_index: int, round_tokens: int) -> int:
    """The most tokens a response advances in round ``round_index``: uniform in [ceil(round_tokens / 2), round_tokens]
    by a hash of (``seed``, the round), so weight loads land at seeded token counts."""
    if round_tokens < 1:
        raise ValueError(f"async_training.round_tokens={round_tokens} must be >= 1")
    low = (round_tokens + 1) // 2
    digest = hashlib.blake2b(f"rlpad-round:{seed}:{round_index}".encode(), digest_size=8).digest()
    return low + int.from_bytes(digest, "little") % (round_tokens - low + 1)


@dataclass
class _Live:
    prompt: StreamPrompt
    response: Response
    chunks: int = 0  # chunks sampled since its (re)start


@dataclass
class _Engine:
    client: EngineClient
    live: list[_Live] = field(default_factory=list)
    busy: list[tuple[float, float]] = field(default_factory=list)


class StreamRounds:
    """See the module docstring. ``k``: groups per step; ``loads_after(s)``: step s is followed by a weight load;
    ``holds(s)``: after that load the rounds wait for :meth:`release` (s)."""

    def __init__(self, clients: Sequence[EngineClient], prompts: Iterator[StreamPrompt], *, n: int, sampling: Sampling,
                 rule: StalenessRule, buffer: GroupBuffer, slots_per_engine: int, round_tokens: int, seed: int, k: int,
                 loads_after: Callable[[int], bool], holds: Callable[[int], bool] = lambda s: False,
                 on_group: Callable[[Group], Awaitable[None]] | None = None):
        if slots_per_engine < n:
            raise ValueError(f"slots_per_engine={slots_per_engine} must be >= n={n}: a group runs on one engine")
        if not clients:
            raise ValueError("no engine")
        round_budget(seed, 0, round_tokens)  # checks round_tokens
        self.engines = [_Engine(c) for c in clients]
        self.prompts, self.n, self.sampling, self.rule, self.buffer = prompts, n, sampling, rule, buffer
        self.slots, self.round_tokens, self.seed, self.k = slots_per_engine, round_tokens, seed, k
        self.loads_after, self.holds, self.on_group = loads_after, holds, on_group
        self.admission = Admission(rule)
        self.prompt_of: dict[str, StreamPrompt] = {}  # groups started and not yet handed to the trainer
        self.started_groups = self.taken_groups = self.regenerated = 0
        self.round = self.steps_taken = self.next_index = 0
        self.exhausted = False
        self.assigned: dict[int, tuple[list[Group], dict[str, float]]] = {}  # step -> its groups, counts at the take
        self.load_round: dict[int, int] = {}  # step -> the round at whose end its version loads
        self.staged: dict[int, NamedTensors] = {}
        self.loaded: dict[int, float] = {}  # version -> seconds the engines were paused for it
        self.released: set[int] = set()
        self.snapshots: dict[int, dict[str, Any]] = {}  # version -> state() at its load
        self.trainer_wait: list[tuple[float, float]] = []
        self.loads: list[tuple[float, float]] = []
        self.errors: list[BaseException] = []
        self.changed = asyncio.Event()  # the rounds moved (the trainer's waits)
        self.poked = asyncio.Event()  # the trainer staged or released something (the rounds' waits)
        self.task: asyncio.Task | None = None
        self._round_future: asyncio.Future | None = None
        self._last_counts: dict[str, float] = {}
        self._restore: tuple[dict[str, Any], NamedTensors] | None = None

    # ---- the rounds
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            if self._restore is not None:  # the loads left of the saved round, then the next round
                await self._restored(*self._restore)
                await self._due_loads()
                self.round += 1
            while True:
                self.fill()
                if any(e.live for e in self.engines):
                    self._round_future = asyncio.ensure_future(self._generate())
                    await asyncio.shield(self._round_future)  # close() waits for it: nothing left on the engines
                    await self._bookkeeping(self._round_future.result())
                elif not [s for s in self.load_round if s not in self.loaded]:
                    if self.exhausted:
                        return
                    raise RuntimeError(f"the deterministic stream stalled at round {self.round}: nothing in flight, "
                                       f"no group may start (staleness quota) and no weight load is due")
                self._take_steps()
                await self._due_loads()
                self.round += 1
                self.changed.set()
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                self.errors.append(e)
            self.changed.set()
            raise

    def fill(self) -> None:
        """Start groups while the quota allows and an engine has n free slots (StreamRollout.fill's rule)."""
        while not self.exhausted and self.admission.may_start():
            engine = max(range(len(self.engines)), key=lambda i: self.slots - len(self.engines[i].live))
            if self.slots - len(self.engines[engine].live) < self.n:
                return
            prompt = next(self.prompts, None)
            if prompt is None:
                self.exhausted = True
                return
            self.next_index = prompt.index + 1
            self.admission.started()
            self.started_groups += 1
            self.prompt_of[prompt.uid] = prompt
            self.engines[engine].live += [_Live(prompt, Response(prompt.uid, j)) for j in range(self.n)]

    async def _generate(self) -> list[list[Any]]:
        budget = round_budget(self.seed, self.round, self.round_tokens)
        R = self.sampling.max_tokens

        def request(item: _Live) -> RoundRequest:
            r = item.response
            seed = request_seed(item.prompt, r)
            seed = continuation_seed(seed, item.chunks) if item.chunks else seed
            return RoundRequest(list(item.prompt.prompt_ids) + r.tokens,
                                replace(self.sampling, max_tokens=min(budget, R - len(r.tokens))), seed,
                                f"{r.uid}-{r.index}-{r.restarts}-r{self.round}")

        async def one(e: _Engine) -> list[Any]:
            if not e.live:
                return []
            start = time.perf_counter()
            try:
                return await e.client.generate_round([request(item) for item in e.live])
            finally:
                e.busy.append((start, time.perf_counter()))

        return list(await asyncio.gather(*[one(e) for e in self.engines]))

    async def _bookkeeping(self, results: list[list[Any]]) -> None:
        R = self.sampling.max_tokens
        finished: list[_Live] = []
        for e, gens in zip(self.engines, results):
            kept = []
            for item, gen in zip(e.live, gens):
                r = item.response
                for token, log_prob, version in zip(gen.token_ids, gen.log_probs, gen.versions):
                    r.extend([token], [log_prob], version)
                item.chunks += 1
                if gen.finish_reason == "stop" or len(r.tokens) >= R:
                    r.done = True
                    finished.append(item)
                else:
                    kept.append(item)
            e.live = kept
        for item in finished:  # engine order, then submission order
            group = self.buffer.complete(item.response, item.prompt.row)
            if group is not None:
                if self.on_group is not None:
                    await self.on_group(group)
                if not self.buffer.admit(group):
                    del self.prompt_of[group.uid]

    def _take_steps(self) -> None:
        """Every step whose k groups the buffer holds now takes them (the trainer gets them with :meth:`take`)."""
        while True:
            step = self.steps_taken + 1
            dropped = self.buffer.dropped_groups
            before = {g.uid for g in self.buffer.ready}
            groups = self.buffer.take(self.k, step - 1, self.rule)
            for uid in before - {g.uid for g in self.buffer.ready} - {g.uid for g in groups or []}:
                del self.prompt_of[uid]  # dropped past the cap
            if self.buffer.dropped_groups > dropped:
                self.admission.on_dropped(self.buffer.dropped_groups - dropped)
            if groups is None:
                return
            self.steps_taken, self.taken_groups = step, self.taken_groups + self.k
            self.assigned[step] = (groups, buffer_metrics(self.buffer, self.regenerated, len(self.buffer) + self.k))
            if self.loads_after(step):
                self.load_round[step] = self.round + 1

    async def _due_loads(self) -> None:
        for step in sorted(s for s, r in self.load_round.items() if r == self.round and s not in self.loaded):
            await self._load(step)

    async def _load(self, version: int) -> None:
        """Version ``version`` into every engine between two rounds (waits for the trainer to stage it)."""
        await self._wait_poke(lambda: version in self.staged)
        start = time.perf_counter()
        for e in self.engines:
            restart = [item for item in e.live if self.rule.must_restart(
                item.response.oldest_version if item.response.versions else None, version)]
            for item in restart:
                item.response.restart()
                item.chunks = 0
                self.regenerated += 1
        await self._load_engines(self.staged.pop(version), version)
        self.admission.on_weight_load(self.carried)
        self.snapshots = {v: s for v, s in self.snapshots.items() if v >= version - 1} | {version: self.state(version)}
        self.loads.append((start, time.perf_counter()))
        self.loaded[version] = self.loads[-1][1] - start
        self.changed.set()
        if self.holds(version):
            await self._wait_poke(lambda: version in self.released)

    async def _load_engines(self, weights: NamedTensors, version: int) -> None:
        await asyncio.gather(*[e.client.pause(clear_cache=True) for e in self.engines])
        await asyncio.gather(*[e.client.load_weights(weights, version) for e in self.engines])
        await asyncio.gather(*[e.client.resume() for e in self.engines])

    async def _wait_poke(self, ready: Callable[[], bool]) -> None:
        while not ready():
            self.poked.clear()
            await self.poked.wait()

    @property
    def carried(self) -> int:
        """Groups started and not yet taken, dropped or filtered out."""
        b = self.buffer
        return self.started_groups - self.taken_groups - b.dropped_groups - b.filtered_groups

    # ---- the trainer's side
    async def _wait_change(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self.errors:
                raise self.errors[0]
            if self.task is not None and self.task.done():
                raise RuntimeError("the deterministic stream ended")
            self.changed.clear()
            await self.changed.wait()

    async def take(self, k: int, updates_applied: int) -> list[Group] | None:
        """Step ``updates_applied + 1``'s groups (taken by the rounds); waits (timed). None when the prompts ran out."""
        if k != self.k:
            raise ValueError(f"the rounds take {self.k} groups a step, asked for {k}")
        step = updates_applied + 1
        start = time.perf_counter()
        try:
            await self._wait_change(lambda: step in self.assigned or (self.exhausted and self.task.done()))
        finally:
            self.trainer_wait.append((start, time.perf_counter()))
        if step not in self.assigned:
            return None
        groups, self._last_counts = self.assigned.pop(step)
        for g in groups:
            self.prompt_of.pop(g.uid, None)
        return groups

    def step_counts(self, depth: int) -> dict[str, float]:
        """The last taken step's ``stream/*`` counts, as they were when the rounds took its groups (``depth`` unused:
        the buffer's depth then)."""
        return dict(self._last_counts)

    def waiting_uids(self) -> set[str]:
        """Groups the trainer may still get (buffered or taken for a later step)."""
        return {g.uid for g in self.buffer.ready} | {g.uid for groups, _ in self.assigned.values() for g in groups}

    async def load_weights(self, named_tensors: NamedTensors, version: int) -> float:
        """Hand ``version`` to the rounds; returns once it is loaded (at its round) the seconds the engines paused."""
        self.staged[version] = named_tensors
        self.poked.set()
        await self._wait_change(lambda: version in self.loaded)
        return self.loaded[version]

    def release(self, version: int) -> None:
        """The trainer is done with the engines after loading ``version`` (its validation): the rounds go on."""
        self.released.add(version)
        self.poked.set()

    def busy_intervals(self, now: float | None = None) -> list[list[tuple[float, float]]]:
        return [list(e.busy) for e in self.engines]

    def timeline(self, t0: float, now: float | None = None) -> dict[str, Any]:
        """As :meth:`StreamRollout.timeline` (seconds since ``t0``)."""
        def rel(spans: Sequence[tuple[float, float]]) -> list[list[float]]:
            return [[round(a - t0, 4), round(b - t0, 4)] for a, b in spans]

        return {"engines": [rel(e.busy) for e in self.engines], "trainer_wait": rel(self.trainer_wait),
                "loads": rel(self.loads)}

    async def close(self) -> None:
        """Stop the rounds; a round in flight on the engines is waited for (the engines are left idle)."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self._round_future is not None:
            await asyncio.gather(self._round_future, return_exceptions=True)
        self.exhausted = True

    # ---- checkpoints
    def state(self, version: int) -> dict[str, Any]:
        """The stream at version ``version``'s load (JSON-ready); ``first_prompt``: the oldest prompt index in it."""
        def group(g: Group) -> dict[str, Any]:
            return {"prompt": self.prompt_of[g.uid].index, "responses": [r.state() for r in g.responses]}

        pending = [[r.state() for r in members.values()] for members in self.buffer.pending.values()]
        a, b = self.admission, self.buffer
        out = {
            "version": version, "round": self.round, "next_index": self.next_index, "exhausted": self.exhausted,
            "started_groups": self.started_groups, "taken_groups": self.taken_groups, "regenerated": self.regenerated,
            "steps_taken": self.steps_taken, "admission": [a.carried, a.limit, a.started_in_window],
            "buffer": [b.filtered_groups, b.dropped_groups, b.dropped_samples],
            "live": [[{"prompt": i.prompt.index, "chunks": i.chunks, "response": i.response.state()} for i in e.live]
                     for e in self.engines],
            "pending": [{"prompt": self.prompt_of[m[0]["uid"]].index, "responses": m} for m in pending],
            "ready": [group(g) for g in b.ready],
            "assigned": {str(s): {"groups": [group(g) for g in gs], "counts": c}
                         for s, (gs, c) in sorted(self.assigned.items()) if s > version},
            "load_round": {str(s): r for s, r in self.load_round.items() if s > version},
            "first_prompt": min([p.index for p in self.prompt_of.values()], default=self.next_index),
        }
        return json.loads(json.dumps(out))  # a copy: the responses go on growing

    def restore(self, state: dict[str, Any], weights: NamedTensors) -> None:
        """Before :meth:`start`: continue from ``state`` (:meth:`state`), ``self.prompts`` replayed from the prompt
        ``state["first_prompt"]`` on; the engines load ``weights`` as the state's version first."""
        self._restore = (state, weights)

    async def _restored(self, state: dict[str, Any], weights: NamedTensors) -> None:
        if len(state["live"]) != len(self.engines):
            raise ValueError(f"the checkpoint's stream ran on {len(state['live'])} engines, this run has "
                             f"{len(self.engines)} (actor_rollout_ref.rollout.num_replicas)")
        by_index: dict[int, StreamPrompt] = {}
        index = -1
        while index < state["next_index"] - 1:  # the prompts started before the state, again
            prompt = next(self.prompts)
            if index == -1 and prompt.index > state["first_prompt"]:
                raise ValueError(f"the prompt stream replays from {prompt.index}, the state needs "
                                 f"{state['first_prompt']}")
            index = prompt.index
            if index >= state["first_prompt"]:
                by_index[index] = prompt
        version = int(state["version"])
        await self._load_engines(weights, version)

        def group(saved: dict[str, Any]) -> Group:
            prompt = by_index[saved["prompt"]]
            self.prompt_of[prompt.uid] = prompt
            return Group(prompt.uid, [Response.from_state(r) for r in saved["responses"]], prompt.row)

        assigned = {int(s): ([group(g) for g in saved["groups"]], saved["counts"])
                    for s, saved in sorted(state["assigned"].items(), key=lambda kv: int(kv[0]))}
        ready = [group(saved) for saved in state["ready"]]
        for g in [g for gs, _ in assigned.values() for g in gs] + ready:
            if self.on_group is not None:  # rescored (rewards are deterministic) before the trainer may take them
                await self.on_group(g)
        self.assigned.update(assigned)
        self.buffer.ready.extend(ready)
        for saved in state["pending"]:
            prompt = by_index[saved["prompt"]]
            self.prompt_of[prompt.uid] = prompt
            self.buffer.pending[prompt.uid] = {r["index"]: Response.from_state(r) for r in saved["responses"]}
        for e, items in zip(self.engines, state["live"]):
            for saved in items:
                prompt = by_index[saved["prompt"]]
                self.prompt_of[prompt.uid] = prompt
                e.live.append(_Live(prompt, Response.from_state(saved["response"]), saved["chunks"]))
        self.round, self.next_index, self.exhausted = state["round"], state["next_index"], state["exhausted"]
        self.started_groups, self.taken_groups = state["started_groups"], state["taken_groups"]
        self.regenerated, self.steps_taken = state["regenerated"], state["steps_taken"]
        self.admission.carried, self.admission.limit, self.admission.started_in_window = state["admission"]
        self.buffer.filtered_groups, self.buffer.dropped_groups, self.buffer.dropped_samples = state["buffer"]
        self.load_round = {int(s): r for s, r in state["load_round"].items()}
        self.loaded = {s: 0.0 for s in range(1, version + 1)}
