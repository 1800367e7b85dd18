"""The streaming trainer loop (``async_training.enable``, docs/streaming.md): steps fed by groups as they finish.

:class:`StreamTrainer` is the :class:`~rlpad.training.trainer.Trainer` with another source of batches. The
engines (:class:`~rlpad.training.stream_rollout.StreamRollout` over the workers' engine clients) generate
continuously from the prompt stream (the train loader's prompts, one group of n per prompt); each group is
scored as it completes, in a reward thread of its own (one group at a time, in completion order, while the
event loop and the engines go on; rule rewards and the reward model's worker group alike), then enters the
buffer through DAPO's filter (``algorithm.filter_groups``: a group without a spread of its metric is not
buffered, counted in ``stream/filtered_groups``; the stream goes on until a step has its groups). Step t
(``t - 1`` updates applied) waits for ``data.train_batch_size`` fresh groups (timed:
``timing_s/wait_rollout``), then runs the trainer's stages on them in a thread (old log-probs, the critic's
values, the per-token correction, the advantage, the critic's and the actor's updates) while the event loop
keeps feeding the engines; every ``trigger_parameter_sync_step`` updates the actor's weights are staged (the
workers' :meth:`StreamWorkers.stage_weights`) and land in the engines mid-generation as policy version t
(:meth:`StreamRollout.load_weights`). A step's record adds the ``stream/*`` metrics
(rlpad.training.stream_metrics) over its span, from its wait to its weight load.

The critic (``adv_estimator=gae``) is not versioned: step t's values come from the critic as it is at step t
(t - 1 critic updates applied, whatever versions sampled the tokens), as in the synchronous loop; only the
actor's tokens carry versions (the per-token correction weighs the actor's loss, not the critic's).

Validation (``data.val_files``; ``trainer.test_freq``, a multiple of ``trigger_parameter_sync_step``, and the
last step): right after that step's weight load, on the same engines and the version just loaded (a load is
made at the last step for it), the training requests going on beside it; the next load waits until it is done.
Its metrics are the synchronous trainer's (:meth:`Trainer.validate`).

Seeds: the prompt with global index i of the stream is sampled with
:func:`rlpad.training.stream_rollout.request_seed` (``rollout.seed``, i, sample). The default schedule is not
deterministic (which tokens land before a load depends on timing). ``async_training.deterministic``: the engines run
:class:`~rlpad.training.stream_rounds.StreamRounds` (a logical clock of rounds; validation with no training request
beside it, each engine's requests one batch) and two runs are equal bit for bit but for wall-clock metrics; a
checkpoint (``trainer.save_freq``) then holds the stream's state at that step's weight load (``stream_state.json``:
the buffer, the in-flight partial responses, the loader position of the oldest prompt in it) and a resume continues
it exactly (the buffered groups rescored, the engines loading the checkpoint's version).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from rlpad.batch import Batch
from rlpad.rollout.base import eos_token_ids, pad_token_id, rollout_samplings
from rlpad.rollout.engine_client import EngineClient, RoundRequest
from rlpad.rollout.layout import build_rollout_batch, prompt_token_lists
from rlpad.rollout.seeds import sample_seed
from rlpad.training.dynamic_sampling import filter_metric
from rlpad.training.group_buffer import Group, GroupBuffer, group_batch_fields, spread_filter
from rlpad.training.metrics import MetricsLogger
from rlpad.training.stage_clock import StageClock
from rlpad.training.stream_metrics import staleness_metrics, time_shares
from rlpad.training.stream_rollout import StreamPrompt, StreamRollout
from rlpad.training.stream_rounds import StreamRounds
from rlpad.training.stream_staleness import StalenessRule
from rlpad.training.trainer import Trainer, Workers

__all__ = ["STREAM_STATE", "StreamTrainer", "StreamWorkers"]

STREAM_STATE = "stream_state.json"  # in a checkpoint of the deterministic stream: StreamRounds.state and the loader


class StreamWorkers(Workers, Protocol):
    """:class:`Workers` with asynchronous engines (workers/launcher.py in streaming mode)."""

    def engine_clients(self) -> list[EngineClient]: ...  # one per rollout replica, usable in the driver's event loop
    def stage_weights(self, version: int) -> Any: ...  # the actor's weights as ``version``, as the clients load them


class StreamTrainer(Trainer):
    """The streaming loop (the module docstring); checkpoints with ``async_training.deterministic`` only."""

    off_policy = True  # every batch may hold tokens of older versions: the correction's off-policy form

    def __init__(self, config: Any, workers: StreamWorkers, *args: Any, **kwargs: Any):
        super().__init__(config, workers, *args, **kwargs)
        missing = [m for m in ("engine_clients", "stage_weights") if not callable(getattr(workers, m, None))]
        if missing:
            raise ValueError(f"async_training.enable=true needs workers with asynchronous engines; "
                             f"{type(workers).__name__} has no {', '.join(missing)}")
        arr, a = config.actor_rollout_ref, config.async_training
        self.rule = StalenessRule.from_config(config)
        self.n = arr.rollout.n
        train, val = rollout_samplings(arr.rollout, config.data)
        self.sampling, self.val_sampling = replace(train, n=1), replace(val, n=1)  # one request per sample
        self.slots = a.concurrent_samples_per_replica or arr.rollout.max_num_seqs
        tokenizer = self.tokenizer
        self.pad_token_id = pad_token_id(tokenizer)
        self.eos = eos_token_ids(tokenizer.eos_token_id)
        self.scored: dict[str, Batch] = {}  # uid -> the group's scored rows, until a step takes it
        self.keep = spread_filter(lambda r: r.score) if config.algorithm.filter_groups.enable else None
        self.stream: StreamRollout | StreamRounds | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the stream's, for validation from a thread
        self._batch_starts: list[tuple[int, dict[str, Any]]] = []  # (first prompt index, the loader before it)
        self._resume_stream: dict[str, Any] | None = None  # stream_state.json of the checkpoint resumed from

    # ---- the prompt stream and the groups' rows

    def _prompts(self, index: int = 0) -> Iterator[StreamPrompt]:
        """The train loader's prompts one by one (epoch after epoch), numbered across the run from ``index`` (the
        number of the loader's next prompt)."""
        seed, data = self.config.actor_rollout_ref.rollout.seed, self.config.data
        while True:
            if self.config.async_training.deterministic:  # save_extra's loader positions
                self._batch_starts.append((index, self.train_loader.state_dict()))
            batch = self.train_loader.next_batch()
            ids = prompt_token_lists(batch["input_ids"], batch["attention_mask"],
                                     max_prompt_length=data.max_prompt_length, truncation=data.truncation)
            for i, prompt_ids in enumerate(ids):
                row = batch.index([i])
                yield StreamPrompt(str(row["uid"][0]), prompt_ids, seed, row=row, index=index)
                index += 1

    def group_rows(self, group: Group) -> Batch:
        """The n rollout rows of a finished group (the rollout layout, prompts left-padded to
        ``data.max_prompt_length``), with ``token_policy_version`` (n, R) and ``policy_version`` (n,)."""
        row, R = group.prompt, self.config.data.max_response_length
        prompt_ids = prompt_token_lists(row["input_ids"], row["attention_mask"],
                                        max_prompt_length=self.config.data.max_prompt_length,
                                        truncation=self.config.data.truncation)
        out = build_rollout_batch(row, prompt_ids, [r.tokens for r in group.responses],
                                  [r.log_probs for r in group.responses], n=self.n,
                                  prompt_width=self.config.data.max_prompt_length, response_length=R,
                                  pad_token_id=self.pad_token_id, eos_token_ids=self.eos)
        for key, value in group_batch_fields([group], R).items():
            out[key] = value
        out.meta.update(temperature=self.sampling.logprob_temperature)
        return out

    async def _score_group(self, group: Group, pool: ThreadPoolExecutor) -> None:
        """As a group completes: its rows scored by the reward in ``pool``'s thread (kept until a step takes the
        group); each response's ``score`` is ``algorithm.filter_groups.metric`` of its row (the buffer's filter)."""
        rows = await asyncio.get_running_loop().run_in_executor(
            pool, lambda: self._scored(self.group_rows(group), StageClock()))
        for response, value in zip(group.responses, filter_metric(rows, self.config.algorithm.filter_groups.metric)):
            response.score = float(value)
        self.scored[group.uid] = rows

    # ---- the loop

    def _loop(self, logger: MetricsLogger) -> None:
        asyncio.run(self._stream_loop(logger))

    def _loads_after(self, step: int) -> bool:
        """Step ``step``'s weights load into the engines: every trigger_parameter_sync_step steps but the last, and
        wherever a validation or (the deterministic stream's state) a checkpoint needs it."""
        if step > self.total_steps:
            return False
        every = step % self.config.async_training.trigger_parameter_sync_step == 0 and step < self.total_steps
        return every or self._validating(step) or self._saving(step)

    def _make_stream(self, pool: ThreadPoolExecutor) -> StreamRollout | StreamRounds:
        a, k = self.config.async_training, self.config.data.train_batch_size
        common = dict(n=self.n, sampling=self.sampling, rule=self.rule, buffer=GroupBuffer(self.n, self.keep),
                      slots_per_engine=self.slots, on_group=lambda group: self._score_group(group, pool))
        clients = self.workers.engine_clients()
        if not a.deterministic:
            return StreamRollout(clients, self._prompts(), **common)
        saved = self._resume_stream
        if saved is not None:  # the loader back at the batch of the oldest prompt the saved stream holds
            self.train_loader.load_state_dict(saved["loader"])
        prompts = self._prompts(saved["loader_index"] if saved is not None else 0)
        return StreamRounds(clients, prompts, **common, round_tokens=a.round_tokens,
                            seed=self.config.actor_rollout_ref.rollout.seed, k=k, loads_after=self._loads_after,
                            holds=self._validating)

    async def _stream_loop(self, logger: MetricsLogger) -> None:
        k = self.config.data.train_batch_size
        self._event_loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(1, thread_name_prefix="rlpad-stream-reward")  # one group at a time, in order
        stream = self.stream = self._make_stream(pool)
        t0, step_ends = time.perf_counter(), []
        try:
            if self.step == 0 and self.config.trainer.val_before_train and self.val_dataset is not None:  # version 0
                record = {"step": 0, **await asyncio.to_thread(self.validate)}
                self.history.append(record)
                logger.log(0, record)
            if isinstance(stream, StreamRounds):
                if self._resume_stream is not None:
                    weights = await asyncio.to_thread(self.workers.stage_weights, self.step)
                    stream.restore(self._resume_stream["stream"], weights)
                stream.start()
            while self.step < self.total_steps:
                start = time.perf_counter()
                groups = await stream.take(k, self.step)  # the update of step t runs with t - 1 applied
                if groups is None:
                    raise RuntimeError("the prompt stream ran out")  # the loader cycles epochs: not reached
                self.step += 1
                depth = len(stream.buffer) + len(groups)
                kept = stream.waiting_uids() | {g.uid for g in groups}
                for uid in [u for u in self.scored if u not in kept]:  # dropped (past the cap) or filtered out
                    del self.scored[uid]
                wait = stream.trainer_wait[-1][1] - stream.trainer_wait[-1][0]
                metrics = await asyncio.to_thread(self.train_groups, groups, wait)
                if self._loads_after(self.step):
                    sync = time.perf_counter()
                    weights = await asyncio.to_thread(self.workers.stage_weights, self.step)
                    metrics["timing_s/stream_pause"] = await stream.load_weights(weights, self.step)
                    metrics["timing_s/sync"] = time.perf_counter() - sync
                if self._validating(self.step):  # on the version just loaded; the next load waits for it
                    metrics.update(await asyncio.to_thread(self.validate))
                stream.release(self.step)
                end = time.perf_counter()
                metrics["timing_s/step_wall"] = end - start  # the whole step: its wait, stages and weight load
                metrics.update(staleness_metrics(groups, self.step - 1))
                metrics.update(stream.step_counts(depth))
                metrics.update(time_shares(stream.busy_intervals(end), stream.trainer_wait, start, end))
                step_ends.append(round(end - t0, 4))
                self.history.append({"step": self.step, **metrics})
                logger.log(self.step, metrics)
                self._flush_warnings(logger)
                if self._saving(self.step):
                    await asyncio.to_thread(self.save_checkpoint)
                if self.hf_folders.roles and self.step == self.total_steps:
                    await asyncio.to_thread(self.hf_folders.save, self.workers, self.step)
        finally:
            timeline = stream.timeline(t0) | {"step_ends": step_ends}
            await stream.close()
            pool.shutdown(wait=True, cancel_futures=True)
        os.makedirs(self.config.trainer.default_local_dir, exist_ok=True)  # for rlpad.bench.stream_timeline
        with open(os.path.join(self.config.trainer.default_local_dir, "stream_timeline.json"), "w") as f:
            json.dump(timeline, f)

    # ---- checkpoints of the deterministic stream

    def save_extra(self, staging: str) -> None:
        """``stream_state.json``: the rounds' state at this step's weight load and the loader at the batch of the
        oldest prompt in it."""
        if not isinstance(self.stream, StreamRounds):
            return
        state = self.stream.snapshots[self.step]
        index, loader = max((b for b in self._batch_starts if b[0] <= state["first_prompt"]), key=lambda b: b[0])
        self._batch_starts = [b for b in self._batch_starts if b[0] >= index]  # a later save never reaches further back
        with open(os.path.join(staging, STREAM_STATE), "w") as f:
            json.dump({"stream": state, "loader_index": index, "loader": loader}, f)

    def _maybe_resume(self) -> None:
        super()._maybe_resume()
        if self.last_checkpoint is None or self.step == 0:
            return
        path = os.path.join(self.last_checkpoint, STREAM_STATE)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {self.last_checkpoint} has no {STREAM_STATE} (the stream's buffer and "
                             "in-flight responses): a streaming run resumes from a checkpoint of "
                             "async_training.deterministic=true")
        if not self.config.async_training.deterministic:
            raise ValueError(f"checkpoint {self.last_checkpoint} holds a deterministic stream's state: resume it "
                             "with async_training.deterministic=true")
        with open(path) as f:
            self._resume_stream = json.load(f)

    def generate_validation(self, prompts: Batch, index: int) -> Batch:
        """The validation rollout on the streaming engines (called from a thread while the stream's event loop
        runs): ``rollout.val_kwargs`` sampling, prompt i's sample j seeded with ``sample_seed(seed, i, j)``, the
        requests spread over the engines; every token must carry the version the engines hold (the last loaded)."""
        future = asyncio.run_coroutine_threadsafe(self._engine_validation(prompts, self._val_seed(index)),
                                                  self._event_loop)
        return future.result()

    async def _engine_validation(self, prompts: Batch, seed: int) -> Batch:
        data, n = self.config.data, self.config.actor_rollout_ref.rollout.val_kwargs.n
        ids = prompt_token_lists(prompts["input_ids"], prompts["attention_mask"],
                                 max_prompt_length=data.max_prompt_length, truncation=data.truncation)
        clients = [e.client for e in self.stream.engines]
        if isinstance(self.stream, StreamRounds):  # each engine's share as one batch (no training request beside it)
            mine = [[(i, j) for i in range(len(ids)) for j in range(n) if (i * n + j) % len(clients) == c]
                    for c in range(len(clients))]
            rounds = await asyncio.gather(*[client.generate_round([
                RoundRequest(ids[i], self.val_sampling, sample_seed(seed, i, j), f"val-{self.step}-{seed}-{i}-{j}")
                for i, j in pairs]) for client, pairs in zip(clients, mine)])
            got = {pair: g for pairs, gens in zip(mine, rounds) for pair, g in zip(pairs, gens)}
            gens = [got[(i, j)] for i in range(len(ids)) for j in range(n)]
        else:
            gens = await asyncio.gather(*[
                clients[(i * n + j) % len(clients)].generate(p, self.val_sampling, sample_seed(seed, i, j),
                                                             request_id=f"val-{self.step}-{seed}-{i}-{j}")
                for i, p in enumerate(ids) for j in range(n)])
        versions = {v for g in gens for v in g.versions}
        if versions - {self.step}:
            raise RuntimeError(f"validation at step {self.step}: tokens of versions {sorted(versions)} (expected "
                               f"{self.step} only: the weights just loaded)")
        out = build_rollout_batch(prompts, ids, [g.token_ids for g in gens], [g.log_probs for g in gens], n=n,
                                  prompt_width=data.max_prompt_length, response_length=data.max_response_length,
                                  pad_token_id=self.pad_token_id, eos_token_ids=self.eos)
        out.meta.update(temperature=self.val_sampling.logprob_temperature)
        return out

    def train_groups(self, groups: list[Group], wait_s: float) -> dict[str, float]:
        """One update on ``groups`` (their scored rows, groups then samples): the trainer's stages from the old
        log-probs on; its metrics."""
        clock = StageClock()
        clock.add("wait_rollout", wait_s)
        batch = Batch.concat([self.scored.pop(g.uid) for g in groups])
        metrics: dict[str, float] = {}
        seq_scores = self.shape_rewards(batch, metrics)
        self.compute_old_log_prob(batch, clock, metrics)
        if self.config.uses_ref:
            self.compute_ref_log_prob(batch, clock)
        if self.estimator.uses_critic:
            self.compute_values(batch, clock)
        self.correct_rollout(batch, metrics)
        self.compute_advantage(batch, clock, metrics)
        if self.estimator.uses_critic:
            metrics.update(self.update_critic(batch, clock))
        metrics.update(self.update_actor(batch, clock))
        metrics.update(self._batch_metrics(batch, seq_scores, clock.wall))
        metrics.update(clock.metrics())
        return metrics
