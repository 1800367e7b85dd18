"""The asynchronous engine client that agent loops and streaming rollouts share: one request per sample.

Many coroutines may ``await client.generate(...)`` at once (agent loops keep dozens of trajectories in
flight). A :class:`Generation` holds a response's tokens, the behaviour log-prob of each token under the
weights that sampled it, the policy version of each token and why it ended. Two implementations:

- :class:`rlpad.rollout.async_vllm.AsyncVLLMClient` on vLLM's asynchronous engine: streaming, abort,
  pause / resume at a token boundary, weights loaded while paused (its module docstring);
- :class:`BatchingClient` over a synchronous backend (HF generate, the in-process ``vllm.LLM``): the
  requests pending while every coroutine of a :meth:`BatchingClient.gather` waits run as one
  ``_sample_each`` call, so a loop run through it samples what the same loop samples batched by hand.
  It has no abort, pause or stream (refused in one line).

Seeds: a request's ``seed`` is the engine seed of that one sample (the caller derives it, e.g. the tool
loop's :func:`rlpad.rollout.seeds.sample_seed`); a partial response resubmitted for the ``k``-th time
continues with :func:`continuation_seed` ``(seed, k)`` (the same seed would restart the random stream).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar


# rlpad.rollout.base.Sampling (n, temperature, top_p, top_k, max_tokens), NamedTensors and RolloutBackend: not
# imported (base imports the agent loops, which run on this client)
Sampling = NamedTensors = RolloutBackend = Any

__all__ = ["BatchingClient", "Delta", "EngineClient", "FINISH_REASONS", "Generation", "RoundRequest", "check_request",
           "continuation_seed"]

FINISH_REASONS = ("stop", "length", "abort")  # an EOS token ended it | the token budget | abort()


@dataclass
class Generation:
    """One response: ``token_ids`` (EOS included when one ended it), ``log_probs`` (the behaviour log-prob of
    each token, after temperature / top-k / top-p, as ``rollout_log_probs``), ``versions`` (the policy version
    that sampled each token), ``finish_reason`` (:data:`FINISH_REASONS`), ``resubmits`` (times it was
    resubmitted as prompt + partial)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    resubmits: int = 0


@dataclass
class Delta:
    """A piece of a stream: the tokens and log-probs new since the last delta; ``generation``: on the last
    delta only, the whole response (its versions included)."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    generation: Generation | None = None


@dataclass(frozen=True)
class RoundRequest:
    """One request of :meth:`EngineClient.generate_round`: ``prompt_ids`` (a partial response's tokens appended, if
    any), its ``sampling`` (``max_tokens``: this request's budget), engine ``seed`` and ``request_id``."""

    prompt_ids: list[int]
    sampling: Sampling
    seed: int | None
    request_id: str


def continuation_seed(seed: int, k: int) -> int:
    """The engine seed of the ``k``-th resubmission (k >= 1) of a partial response first sampled with ``seed``."""
    digest = hashlib.blake2b(f"rlpad-continue:{seed}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: torch.Generator and vLLM's int64 seeds take them


def check_request(prompt_ids: Sequence[int], sampling: Sampling, seed: int | None, partial: Generation | None,
                  who: str) -> None:
    """One-line ValueErrors for a request the engine would reject later (or sample wrongly)."""
    if not prompt_ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt_ids):
        raise ValueError(f"{who}: prompt_ids must be a non-empty list of token ids (ints >= 0)")
    if sampling.n != 1:
        raise ValueError(f"{who}: one request is one sample (sampling.n must be 1, got {sampling.n})")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"{who}: seed must be an int or None, got {seed!r}")
    if partial is not None and partial.finish_reason != "abort":
        raise ValueError(f"{who}: only an aborted response can be continued (finish_reason "
                         f"{partial.finish_reason!r})")


class EngineClient(ABC):
    """``generate`` / ``stream`` one sample per request; ``version``: the policy version of the loaded weights."""

    supports_pause: ClassVar[bool] = False  # stream, abort, pause / resume, load_weights while paused
    version: int
    eos_token_ids: frozenset[int]

    @abstractmethod
    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int | None, *,
                       request_id: str | None = None, images: Any = None,
                       partial: Generation | None = None) -> Generation:
        """One sample from ``prompt_ids`` (``sampling.n`` is 1). ``partial``: an aborted response of this prompt,
        continued (prompt + its tokens resubmitted, the budget less its length, seed :func:`continuation_seed`);
        the result holds the partial's tokens, log-probs and versions first."""

    async def generate_round(self, requests: Sequence[RoundRequest]) -> list[Generation]:
        """Every request of ``requests`` as one batch, in order (the deterministic stream's round: the engine sees the
        same batch whatever the timing); their Generations in order. Here: :meth:`generate` of each, gathered."""
        return list(await asyncio.gather(*[self.generate(r.prompt_ids, r.sampling, r.seed, request_id=r.request_id)
                                           for r in requests]))

    def stream(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int | None, *,
               request_id: str | None = None, images: Any = None,
               partial: Generation | None = None) -> AsyncIterator[Delta]:
        """:meth:`generate` as an async iterator of :class:`Delta` (the last one carries the Generation)."""
        raise NotImplementedError(self._no_pause("stream"))

    async def abort(self, request_id: str) -> None:
        """End a request now: its generate returns (its stream ends) with finish_reason "abort"."""
        raise NotImplementedError(self._no_pause("abort"))

    async def pause(self, *, clear_cache: bool = True) -> None:
        """Stop sampling at a token boundary, keeping every request (``clear_cache``: drop their KV, recomputed
        on :meth:`resume` with the weights loaded meanwhile)."""
        raise NotImplementedError(self._no_pause("pause"))

    async def resume(self) -> None:
        raise NotImplementedError(self._no_pause("resume"))

    @abstractmethod
    async def load_weights(self, named_tensors: NamedTensors, version: int) -> float:
        """Load full weights (HF names) as policy ``version``; tokens sampled afterwards carry it. Returns seconds."""

    async def close(self) -> None:
        """Stop the engine (the client is unusable afterwards)."""

    def _no_pause(self, what: str) -> str:
        return (f"{type(self).__name__} runs a synchronous backend: no {what} (streaming, abort and pause need "
                "the asynchronous vLLM engine, actor_rollout_ref.rollout.name=vllm)")


_ORDER: contextvars.ContextVar[int | None] = contextvars.ContextVar("rlpad_batch_order", default=None)


@dataclass
class _Pending:
    order: tuple[int, int]  # (the coroutine's index in gather, submission count)
    prompt_ids: list[int]
    sampling: Sampling
    seed: int | None
    images: Any
    request_id: str
    future: asyncio.Future


class BatchingClient(EngineClient):
    """A synchronous :class:`RolloutBackend` behind the client interface (no abort / pause / stream).

    Run the coroutines that call :meth:`generate` with :meth:`gather`: when every one of them still running
    waits on a generate, the pending requests run as ``backend._sample_each`` calls in the coroutines' order
    (one call per distinct sampling, its budget the largest ``max_tokens`` asked, each response cut at its own).
    A generate outside gather runs alone at once.
    """

    def __init__(self, backend: RolloutBackend, version: int = 0):
        self.backend, self.version = backend, version
        self.eos_token_ids = frozenset(backend.eos_token_ids)
        self._pending: list[_Pending] = []
        self._calls: list[tuple[tuple[int, int], Any, list[Any], asyncio.Future]] = []  # call_batched's
        self._live = 0  # coroutines of gather() still running
        self._ids = itertools.count()
        self._flush_scheduled = False
        self.calls = 0  # _sample_each calls made (tests, metrics)

    async def gather(self, coros: Sequence[Awaitable[Any]]) -> list[Any]:
        """Run ``coros`` concurrently, batching their generate calls; their results in order."""
        loop = asyncio.get_running_loop()

        async def run(i: int, coro: Awaitable[Any]) -> Any:
            _ORDER.set(i)
            try:
                return await coro
            finally:
                self._live -= 1
                self._maybe_flush(loop)

        self._live += len(coros)
        tasks = [asyncio.ensure_future(run(i, c)) for i, c in enumerate(coros)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    async def generate(self, prompt_ids, sampling, seed, *, request_id=None, images=None, partial=None):
        check_request(prompt_ids, sampling, seed, partial, type(self).__name__)
        if partial is not None:
            raise NotImplementedError(self._no_pause("continuation of an aborted response"))
        loop = asyncio.get_running_loop()
        order = _ORDER.get()
        count = next(self._ids)
        pending = _Pending((order if order is not None else -1, count), list(prompt_ids), sampling, seed, images,
                           request_id or f"batch-{count}", loop.create_future())
        self._pending.append(pending)
        if order is None:  # not inside gather: run it alone now
            self._flush()
        else:
            self._maybe_flush(loop)
        return await pending.future

    async def call_batched(self, fn: Any, items: Sequence[Any]) -> list[Any]:
        """``fn(items)`` batched like generate: the items of every coroutine calling with this ``fn`` while all
        wait go to one ``fn`` call (in the coroutines' order), each caller gets its own results back (the tool
        loop runs every trajectory's tool calls of a turn at once this way)."""
        loop = asyncio.get_running_loop()
        order = _ORDER.get()
        future = loop.create_future()
        self._calls.append(((order if order is not None else -1, next(self._ids)), fn, list(items), future))
        if order is None:
            self._flush()
        else:
            self._maybe_flush(loop)
        return await future

    def _maybe_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        waiting = len(self._pending) + len(self._calls)
        if waiting and waiting >= self._live and not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Run every pending request (the caller made sure no running coroutine can add one)."""
        self._flush_scheduled = False
        calls, self._calls = sorted(self._calls, key=lambda c: c[0]), []
        by_fn: dict[Any, list[Any]] = {}
        for call in calls:
            by_fn.setdefault(call[1], []).append(call)
        for group in by_fn.values():
            try:
                results = group[0][1]([item for c in group for item in c[2]])
            except BaseException as e:
                for c in group:
                    if not c[3].done():
                        c[3].set_exception(e)
                continue
            it = iter(results)
            for c in group:
                mine = [next(it) for _ in c[2]]
                if not c[3].done():  # its coroutine was cancelled meanwhile
                    c[3].set_result(mine)
        batch, self._pending = sorted(self._pending, key=lambda p: p.order), []
        groups: dict[Sampling, list[_Pending]] = {}
        for p in batch:
            groups.setdefault(replace(p.sampling, max_tokens=0), []).append(p)
        for group in groups.values():
            try:
                results = self._run(group)
            except BaseException as e:  # every waiting request gets the error
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, g in zip(group, results):
                if not p.future.done():
                    p.future.set_result(g)

    def _run(self, group: list[_Pending]) -> list[Generation]:
        seeds = [p.seed for p in group]
        if any(s is None for s in seeds) and not all(s is None for s in seeds):
            raise ValueError(f"{type(self).__name__}: seeded and unseeded requests in one batch")
        budget = max(p.sampling.max_tokens for p in group)
        images = [p.images for p in group]
        extra = {} if all(i is None for i in images) else {"images": images}
        outs, lps = self.backend._sample_each([p.prompt_ids for p in group], replace(group[0].sampling,
                                              max_tokens=budget), None if seeds[0] is None else seeds, **extra)
        self.calls += 1
        results = []
        for p, toks, lp in zip(group, outs, lps):
            toks, lp = list(toks)[: p.sampling.max_tokens], list(lp)[: p.sampling.max_tokens]
            stop = next((i for i, t in enumerate(toks) if t in self.eos_token_ids), None)
            if stop is not None:
                toks, lp = toks[: stop + 1], lp[: stop + 1]
            # vLLM's reasons: "stop" for an EOS or a stop string (the backend ended the row before the request's
            # budget), "length" for the budget
            ended = stop is not None or len(toks) < p.sampling.max_tokens
            results.append(Generation(p.request_id, toks, lp, [self.version] * len(toks), "stop" if ended else "length"))
        return results

    async def load_weights(self, named_tensors: NamedTensors, version: int) -> float:
        """Between batches (no request runs while a coroutine awaits this): the backend's update_weights."""
        seconds = self.backend.update_weights(named_tensors)
        self.version = int(version)
        return seconds

