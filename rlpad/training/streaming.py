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
:func:`rlpad.training.stream_rollout.request_seed` (``rollout.seed``, i, sample). The schedule is not
deterministic (which tokens land before a load depends on timing; item 5 of issue 60 is not built).
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
from rlpad.rollout.engine_client import EngineClient
from rlpad.rollout.layout import build_rollout_batch, prompt_token_lists
from rlpad.rollout.seeds import sample_seed
from rlpad.training.dynamic_sampling import filter_metric
from rlpad.training.group_buffer import Group, GroupBuffer, group_batch_fields, spread_filter
from rlpad.training.metrics import MetricsLogger
from rlpad.training.stage_clock import StageClock
from rlpad.training.stream_metrics import buffer_metrics, staleness_metrics, time_shares
from rlpad.training.stream_rollout import StreamPrompt, StreamRollout
from rlpad.training.stream_staleness import StalenessRule
from rlpad.training.trainer import Trainer, Workers

__all__ = ["StreamTrainer", "StreamWorkers"]


class StreamWorkers(Workers, Protocol):
    """:class:`Workers` with asynchronous engines (workers/launcher.py in streaming mode)."""

    def engine_clients(self) -> list[EngineClient]: ...  # one per rollout replica, usable in the driver's event loop
    def stage_weights(self, version: int) -> Any: ...  # the actor's weights as ``version``, as the clients load them


class StreamTrainer(Trainer):
    """The streaming loop (the module docstring); checkpoints are refused at config load."""

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
        self.stream: StreamRollout | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the stream's, for validation from a thread

    # ---- the prompt stream and the groups' rows

    def _prompts(self) -> Iterator[StreamPrompt]:
        """The train loader's prompts one by one (epoch after epoch), numbered across the run."""
        index, seed = 0, self.config.actor_rollout_ref.rollout.seed
        data = self.config.data
        while True:
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

    async def _stream_loop(self, logger: MetricsLogger) -> None:
        a, t = self.config.async_training, self.config.trainer
        k = self.config.data.train_batch_size
        self._event_loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(1, thread_name_prefix="rlpad-stream-reward")  # one group at a time, in order
        stream = self.stream = StreamRollout(
            self.workers.engine_clients(), self._prompts(), n=self.n, sampling=self.sampling, rule=self.rule,
            buffer=GroupBuffer(self.n, self.keep), slots_per_engine=self.slots,
            on_group=lambda group: self._score_group(group, pool))
        t0, step_ends = time.perf_counter(), []
        try:
            if self.step == 0 and t.val_before_train and self.val_dataset is not None:  # on version 0
                record = {"step": 0, **await asyncio.to_thread(self.validate)}
                self.history.append(record)
                logger.log(0, record)
            while self.step < self.total_steps:
                start = time.perf_counter()
                groups = await stream.take(k, self.step)  # the update of step t runs with t - 1 applied
                if groups is None:
                    raise RuntimeError("the prompt stream ran out")  # the loader cycles epochs: not reached
                self.step += 1
                depth = len(stream.buffer) + len(groups)
                kept = {g.uid for g in stream.buffer.ready} | {g.uid for g in groups}
                for uid in [u for u in self.scored if u not in kept]:  # dropped (past the cap) or filtered out
                    del self.scored[uid]
                wait = stream.trainer_wait[-1][1] - stream.trainer_wait[-1][0]
                metrics = await asyncio.to_thread(self.train_groups, groups, wait)
                last = self.step == self.total_steps
                validating = self.val_dataset is not None and ((t.test_freq > 0 and self.step % t.test_freq == 0)
                                                               or last)
                if validating or (self.step % a.trigger_parameter_sync_step == 0 and not last):
                    sync = time.perf_counter()
                    weights = await asyncio.to_thread(self.workers.stage_weights, self.step)
                    metrics["timing_s/stream_pause"] = await stream.load_weights(weights, self.step)
                    metrics["timing_s/sync"] = time.perf_counter() - sync
                if validating:  # on the version just loaded; the next load waits for it
                    metrics.update(await asyncio.to_thread(self.validate))
                end = time.perf_counter()
                metrics["timing_s/step_wall"] = end - start  # the whole step: its wait, stages and weight load
                metrics.update(staleness_metrics(groups, self.step - 1))
                metrics.update(buffer_metrics(stream.buffer, stream.regenerated, depth))
                metrics.update(time_shares(stream.busy_intervals(end), stream.trainer_wait, start, end))
                step_ends.append(round(end - t0, 4))
                self.history.append({"step": self.step, **metrics})
                logger.log(self.step, metrics)
                self._flush_warnings(logger)
                if self.hf_folders.roles and self.step == self.total_steps:
                    await asyncio.to_thread(self.hf_folders.save, self.workers, self.step)
        finally:
            timeline = stream.timeline(t0) | {"step_ends": step_ends}
            await stream.close()
            pool.shutdown(wait=True, cancel_futures=True)
        os.makedirs(self.config.trainer.default_local_dir, exist_ok=True)  # for rlpad.bench.stream_timeline
        with open(os.path.join(self.config.trainer.default_local_dir, "stream_timeline.json"), "w") as f:
            json.dump(timeline, f)

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
