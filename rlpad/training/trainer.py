"""The single-controller GRPO/PPO loop: :meth:`Trainer.fit` runs steps, each a sequence of named stages.

One step (:meth:`Trainer.train_step`), each stage a method, timed by :class:`StageClock`:
``generate_and_reward`` (the rollout, n per prompt, scored; with ``algorithm.filter_groups`` groups
without reward spread dropped and more prompts generated) -> ``compute_reward_baselines`` (remax: each prompt's
greedy response scored) -> ``shape_rewards`` (``reward_model.overlong_buffer``)
-> ``compute_old_log_prob`` (actor; with ``sum_pi_squared`` when asked) -> ``compute_ref_log_prob`` -> ``compute_values``
(a critic) -> ``correct_rollout`` (``algorithm.rollout_correction``) -> ``compute_advantage``
(rlpad.algorithms.advantages) -> ``update_critic`` -> ``update_actor``
-> ``sync_weights``; then ``validate`` every ``test_freq`` steps, the metrics, ``save_checkpoint`` every
``save_freq`` steps, the HF folders (:mod:`rlpad.training.hf_out`) with each checkpoint and after the last step.
With ``trainer.max_off_policy_steps = k >= 1`` the batches come from :class:`rlpad.training.async_schedule.RolloutAhead`,
generated up to k steps ahead while the actor trains (the workers then also implement
:class:`rlpad.training.async_schedule.AsyncWorkers`); k = 0 is the synchronous loop.

The trainer talks to the workers only through :class:`Workers`; ``workers/launcher.py``
implements it with Ray actors, and anything else with the same methods (a test double, a
single-process stack) can drive the same loop. Workers that also have the optional
:class:`GenerationPhases` hooks get them called around every generation (the colocated layout
moves GPU memory between the engine and the actor there).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from rlpad.algorithms.advantages import get_estimator
from rlpad.algorithms.losses import kl_penalty, masked_mean
from rlpad.training.async_schedule import RolloutAhead, in_flight_steps
from rlpad.batch import Batch
from rlpad.training.checkpoint import CheckpointDir
from rlpad.config.schema import Config
from rlpad.data import PromptDataset, PromptLoader, val_batches
from rlpad.training.dynamic_sampling import ACC, SEQ_SCORE, collect_batch, shape_rewards
from rlpad.training.hf_out import HFFolders
from rlpad.training.initial_weights import sync_initial_weights
from rlpad.errors import WorkerFailed
from rlpad.training.metrics import MetricsLogger, plot_reward_curve
from rlpad.rewards.math_verifier import drain_fallbacks
from rlpad.training.stage_clock import StageClock
from rlpad.training.step_metrics import batch_metrics, mismatch_metrics, stage_metrics
from rlpad.training.warmup import actor_updates
from rlpad.rewards.combine import load_reward_state, part_metrics, parts_of, reward_state
from rlpad.rewards.stage import score_rewards, validation_scores
from rlpad.rewards.rules import REWARD_EXTRA_INFO
from rlpad.training.validation_metrics import ValidationRows
from rlpad.rollout.agent import AGENT_COUNTS, multi_turn_metrics
from rlpad.algorithms.rollout_correction import apply_rollout_correction
from rlpad.training.estimator_inputs import component_metrics, greedy_prompts, reward_components

__all__ = ["GenerationPhases", "Trainer", "Workers", "fill_lr_horizons", "total_training_steps"]

ACTOR_LOSS_MASK = "rollout_corr/loss_mask"  # batch key: the actor's response mask after seq_mask (correct_rollout)


def total_training_steps(config: Config, batches_per_epoch: int) -> int:
    """The run's length in steps: ``trainer.total_training_steps``, or every batch of ``total_epochs`` epochs."""
    return config.trainer.total_training_steps or batches_per_epoch * config.trainer.total_epochs


def fill_lr_horizons(config: Config, total_steps: int) -> None:
    """Set ``optim.total_training_steps`` of the actor and the critic to the run's ``total_steps`` where
    the recipe left it at -1 (verl's "filled by the trainer"): the horizon of ``lr_warmup_steps_ratio``.
    Call before the workers are built (they build their LR schedules at ``init_model``)."""
    for optim in (config.actor_rollout_ref.actor.optim, config.critic.optim):
        if optim.total_training_steps < 0:
            optim.total_training_steps = total_steps


class Workers(Protocol):
    """What the trainer needs from the worker side (see workers/launcher.py)."""

    def generate(self, batch: Batch, seed: int) -> Batch: ...
    def generate_validation(self, batch: Batch, seed: int) -> Batch: ...
    def generate_greedy(self, batch: Batch, seed: int) -> Batch: ...  # remax: one greedy response per prompt
    def compute_log_prob(self, batch: Batch, *, for_update: bool = True) -> Batch: ...
    def compute_ref_log_prob(self, batch: Batch) -> Batch: ...
    def compute_teacher(self, batch: Batch) -> Batch: ...  # distillation.enabled only
    def compute_values(self, batch: Batch) -> Batch: ...
    def update_actor(self, batch: Batch) -> dict[str, float]: ...
    def update_critic(self, batch: Batch) -> dict[str, float]: ...
    def sync_weights(self) -> float: ...  # the workers' own seconds (or anything; informational)
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...
    def save_hf(self, path: str, role: str) -> None: ...  # trainer.save_hf / hf_model (rlpad.training.hf_out)


class GenerationPhases(Protocol):
    """Optional hooks of a :class:`Workers`: called right before and right after each
    ``generate`` / ``generate_validation`` call; they return True when they did something (their
    time is then ``timing_s/switch``)."""

    def begin_generation(self) -> bool: ...
    def end_generation(self) -> bool: ...


def _check_finite(name: str, value: Any, step: int) -> None:
    tensor = torch.as_tensor(value, dtype=torch.float64)
    if not torch.isfinite(tensor).all():
        raise FloatingPointError(f"step {step}: {name} is not finite ({value}); stopping before it reaches the weights")


class Trainer:
    """Runs ``config.trainer.total_training_steps`` steps of GRPO or PPO over ``train_loader``."""

    def __init__(self, config: Config, workers: Workers, tokenizer: Any, train_loader: PromptLoader,
                 val_dataset: PromptDataset | None, reward_fn: Callable[..., Any] | None = None):
        self.config, self.workers, self.tokenizer = config, workers, tokenizer
        self.train_loader, self.val_dataset, self.reward_fn = train_loader, val_dataset, reward_fn
        self.warnings: list[str] = []  # lines for the console, printed after the step's metrics
        self.total_steps = total_training_steps(config, len(train_loader))
        self.checkpoints = CheckpointDir(config.trainer.default_local_dir)
        self.hf_folders = HFFolders(config)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.last_checkpoint: str | None = None
        self.ahead: RolloutAhead | None = None  # the asynchronous schedule (trainer.max_off_policy_steps >= 1)
        self.estimator = get_estimator(config.algorithm.adv_estimator)
        k = config.trainer.max_off_policy_steps
        if k:
            if not callable(getattr(workers, "submit_generate", None)):
                raise ValueError(f"trainer.max_off_policy_steps={k} needs workers that submit generations ahead "
                                 "(rlpad.training.async_schedule.AsyncWorkers: the Ray backend); "
                                 f"{type(workers).__name__} does not")
            self.ahead = RolloutAhead(workers, k, self.total_steps, train_loader.next_batch, self._seed)

    def _seed(self, step: int, gen_batch: int = 0) -> int:
        """The rollout's sampling seed of ``step`` and of its generation batch ``gen_batch`` (dynamic sampling;
        batch j >= 1 at + j * 10**6 + 500_000, apart from validation's + i * 10**6): a resumed run samples what
        an uninterrupted one did."""
        extra = gen_batch * 1_000_000 + 500_000 if gen_batch else 0
        return self.config.actor_rollout_ref.rollout.seed + step + extra

    def _scored(self, batch: Batch, clock: StageClock) -> Batch:
        """Stage ``reward``: ``batch`` with its raw rewards: ``token_level_scores`` (B, R), ``seq_score`` and ``acc`` (B,)."""
        with clock.stage("reward"):
            batch["token_level_scores"], batch[SEQ_SCORE], batch[ACC] = score_rewards(batch, self.tokenizer,
                                                                                      self.reward_fn)
            _check_finite("reward", batch[SEQ_SCORE], self.step)
            if self.estimator.reward_components:  # gdpo: algorithm.gdpo_reward_keys' values, (B, K)
                batch["reward_components"] = reward_components(batch, self.config)
        return batch

    @property
    def off_policy(self) -> bool:
        """The batches may hold tokens of older policy versions (the correction's off-policy form)."""
        return self.ahead is not None

    def _val_seed(self, index: int) -> int:
        """The validation rollout's seed at this step, for validation batch ``index`` (used when
        ``rollout.val_kwargs.do_sample``): apart from every training step's while steps < 10**6."""
        return self._seed(self.step) + (index + 1) * 1_000_000  # apart from the generation batches' + 500_000

    # ---- the loop -------------------------------------------------------------------------------

    def fit(self) -> list[dict[str, Any]]:
        """Train to ``total_steps``; returns the per-step metric records."""
        cfg = self.config.trainer
        logger = None
        try:
            self._maybe_resume()
            if self.last_checkpoint is None:  # a fresh start: the engines hold model.path's weights
                sync_initial_weights(self.config, self.workers, self.ahead)
            logger = MetricsLogger(cfg.default_local_dir, cfg.logger, total_steps=self.total_steps,
                                   project=cfg.project_name, run_name=cfg.experiment_name, start_step=self.step)
            self._loop(logger)
        except WorkerFailed as e:  # a worker died or holds weights it failed to load: where to resume from
            where = self.last_checkpoint or "none yet (set trainer.save_freq)"
            raise WorkerFailed(f"{e}\ntraining stopped at step {self.step}; "
                               f"last checkpoint to resume from: {where}") from e
        finally:
            if logger is not None:
                logger.close()
        plot_reward_curve(self.history, f"{cfg.default_local_dir}/reward_curve.png")
        return self.history

    def _flush_warnings(self, logger: MetricsLogger) -> None:
        for line in self.warnings:
            logger.warn(line)
        self.warnings.clear()

    def _loop(self, logger: MetricsLogger) -> None:
        cfg = self.config.trainer
        if self.step == 0 and cfg.val_before_train and self.val_dataset is not None:
            record = {"step": 0, **self.validate()}
            self.history.append(record)
            logger.log(0, record)
            self._flush_warnings(logger)
        while self.step < self.total_steps:
            self.step += 1
            if self.ahead is not None:
                self.ahead.submit_ahead(self.step)  # the generations of the next k steps, then batch t
            metrics = self.train_step(None if self.ahead is not None else self.train_loader.next_batch())
            last = self.step == self.total_steps
            if self._validating(self.step):
                metrics.update(self.validate())
            self.history.append({"step": self.step, **metrics})
            logger.log(self.step, metrics)
            self._flush_warnings(logger)
            checkpointed = self._saving(self.step)
            if checkpointed:
                self.save_checkpoint()
            if self.hf_folders.roles and (checkpointed or last):
                self.hf_folders.save(self.workers, self.step)

    def _validating(self, step: int) -> bool:
        """Step ``step`` validates: every ``trainer.test_freq`` steps and the last (with validation data)."""
        t = self.config.trainer
        return self.val_dataset is not None and ((t.test_freq > 0 and step % t.test_freq == 0) or step == self.total_steps)

    def _saving(self, step: int) -> bool:
        """Step ``step`` is checkpointed: every ``trainer.save_freq`` steps and the last (save_freq > 0)."""
        t = self.config.trainer
        return t.save_freq > 0 and (step % t.save_freq == 0 or step == self.total_steps)

    def train_step(self, prompts: Batch | None) -> dict[str, float]:
        """One GRPO/PPO step on a batch of prompts (None: the batch the asynchronous schedule generated
        for this step), stage by stage; returns its metrics (stage timings: :mod:`rlpad.training.stage_clock`)."""
        clock = StageClock()
        uses_critic = self.estimator.uses_critic
        batch, metrics, async_metrics = self.generate_and_reward(prompts, clock)
        if self.estimator.needs_greedy_baseline:
            self.compute_reward_baselines(batch, clock, metrics)
        seq_scores = self.shape_rewards(batch, metrics)
        self.compute_old_log_prob(batch, clock, metrics)
        if self.config.uses_ref:
            self.compute_ref_log_prob(batch, clock)
        if self.config.distillation.enabled:
            self.compute_teacher(batch, clock)
        if uses_critic:
            self.compute_values(batch, clock)
        self.correct_rollout(batch, metrics)
        self.compute_advantage(batch, clock, metrics)
        if uses_critic:
            metrics.update(self.update_critic(batch, clock))
        if actor_updates(self.config, self.step):  # trainer.critic_warmup: before it, the critic trains alone
            metrics.update(self.update_actor(batch, clock))
        self.sync_weights(clock)
        metrics.update(self._batch_metrics(batch, seq_scores, clock.wall))
        if async_metrics:
            metrics.update(async_metrics)
            if async_metrics["async/gen_s"] > 0:
                metrics["tokens_per_s/gen"] = float(batch["response_mask"].sum()) / async_metrics["async/gen_s"]
        metrics.update(clock.metrics())
        return metrics

    # ---- the stages of a step ----------------------------------------------------------------------

    def generate_and_reward(self, prompts: Batch | None, clock: StageClock
                            ) -> tuple[Batch, dict[str, float], dict[str, float]]:
        """Stages ``gen`` and ``reward``: the rollout of ``prompts`` scored by the reward function. With
        ``algorithm.filter_groups``, generation batches until enough groups have reward spread; with
        ``trainer.max_off_policy_steps`` the batch generated ahead for this step (stage ``wait_rollout``:
        what the step still waited for). Returns (batch, metrics, the asynchronous schedule's metrics)."""
        cfg = self.config

        def generate_scored(prompts: Batch, gen_batch: int) -> Batch:
            with self._generation(clock):
                batch = clock.call("gen", self.workers.generate, prompts, seed=self._seed(self.step, gen_batch))
            return self._scored(batch, clock)

        if self.ahead is None:
            batch, metrics = collect_batch(cfg, prompts, self.train_loader.next_batch, generate_scored)
            return batch, metrics, {}
        ahead, async_metrics = self.ahead.take(self.step)
        clock.add("wait_rollout", async_metrics.pop("timing_s/wait_rollout"))
        batch, metrics = collect_batch(cfg, None, self.train_loader.next_batch,  # filter_groups: refused
                                       lambda _p, _j: self._scored(ahead, clock))
        return batch, metrics, async_metrics

    def compute_reward_baselines(self, batch: Batch, clock: StageClock, metrics: dict[str, float]) -> None:
        """Stage ``gen_max`` (remax; verl's name): one greedy response per prompt of the batch (temperature 0,
        n = 1, verl's rule) by the same engines, scored in stage ``reward`` by the same reward (``reward.normalize``'s
        statistics not moved: the units of this step's rewards); each prompt's score on its rows is
        ``reward_baselines`` (B,). The overlong shaping (reward_model.overlong_buffer) is not applied to it."""
        prompts, group = greedy_prompts(batch)
        with self._generation(clock):
            greedy = clock.call("gen_max", self.workers.generate_greedy, prompts, seed=self._seed(self.step))
        with clock.stage("reward"):
            _, scores, _ = score_rewards(greedy, self.tokenizer, self.reward_fn, update_stats=False)
            _check_finite("reward_baselines", scores, self.step)
        batch["reward_baselines"] = scores.float()[group]
        metrics["reward/greedy_baseline/mean"] = float(scores.mean())

    def shape_rewards(self, batch: Batch, metrics: dict[str, float]) -> torch.Tensor:
        """``reward_model.overlong_buffer`` after the filter (rlpad.training.dynamic_sampling); the
        sequence scores the step reports."""
        seq_scores, shaping = shape_rewards(batch, self.config)
        metrics.update(shaping)
        return seq_scores

    def compute_old_log_prob(self, batch: Batch, clock: StageClock, metrics: dict[str, float]) -> None:
        """Stage ``old_log_prob``: the actor's log-probs (and entropies) of the sampled tokens, and
        their mismatch with the rollout's (``mismatch/*``)."""
        batch.update(clock.call("old_log_prob", self.workers.compute_log_prob, batch))
        metrics.update(mismatch_metrics(batch, "mismatch/"))

    def compute_ref_log_prob(self, batch: Batch, clock: StageClock) -> None:
        """Stage ``ref``: the reference policy's log-probs (KL loss or KL in reward)."""
        batch.update(clock.call("ref", self.workers.compute_ref_log_prob, batch))

    def compute_teacher(self, batch: Batch, clock: StageClock) -> None:
        """Stage ``teacher`` (on-policy distillation, docs/distillation.md): the teacher's numbers of the
        sampled tokens (its log-probs, or its top-k ids and log-probs)."""
        batch.update(clock.call("teacher", self.workers.compute_teacher, batch))

    def compute_values(self, batch: Batch, clock: StageClock) -> None:
        """Stage ``values``: the critic's values (estimators that use a critic: GAE)."""
        batch.update(clock.call("values", self.workers.compute_values, batch))

    def correct_rollout(self, batch: Batch, metrics: dict[str, float]) -> None:
        """``algorithm.rollout_correction`` before the advantage, where verl computes it (the optimal-token-baseline
        estimators read the weights): ``rollout_is_weights`` (B, R) into ``batch`` (token_tis; seq_mask at k >= 1),
        the actor's loss mask (seq_mask: without the dropped sequences) kept for :meth:`update_actor` alone, as
        before (verl also masks them out of the advantage: rlpad does not), and the correction's metrics."""
        corrected, correction = self._corrected(batch)
        if corrected is batch:
            return
        if "rollout_is_weights" in corrected:
            batch["rollout_is_weights"] = corrected["rollout_is_weights"]
        batch[ACTOR_LOSS_MASK] = corrected["response_mask"]
        metrics.update(correction)

    def compute_advantage(self, batch: Batch, clock: StageClock, metrics: dict[str, float]) -> None:
        """``token_level_rewards`` (the scores, less ``algorithm.kl_ctrl.kl_coef`` x KL with ``use_kl_in_reward``),
        then stage ``adv``: ``advantages`` and ``returns`` by ``algorithm.adv_estimator``."""
        algo = self.config.algorithm
        scores = batch["token_level_scores"]
        rewards = scores
        if algo.use_kl_in_reward:
            mask = batch["response_mask"].float()
            kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], algo.kl_penalty) * mask
            rewards = scores - algo.kl_ctrl.kl_coef * kl
            metrics["reward/kl_penalty"] = float(masked_mean(kl, mask))
        batch["token_level_rewards"] = rewards
        with clock.stage("adv"):
            batch["advantages"], batch["returns"] = self.estimator.compute(batch, self.config)

    def update_critic(self, batch: Batch, clock: StageClock) -> dict[str, float]:
        """Stage ``update_critic``: the critic's PPO epochs on the batch; its metrics."""
        metrics = clock.call("update_critic", self.workers.update_critic, batch)
        for key in ("critic/vf_loss", "critic/grad_norm"):
            if key in metrics:
                _check_finite(key, metrics[key], self.step)
        return metrics

    def update_actor(self, batch: Batch, clock: StageClock) -> dict[str, float]:
        """Stage ``update_actor``: the actor's PPO epochs on the batch (its loss mask :meth:`correct_rollout`'s);
        its metrics. A non-finite loss or gradient norm stops the run here: the
        workers skipped that optimizer step, so the weights are those of the last good step."""
        actor_batch = batch
        if ACTOR_LOSS_MASK in batch:
            actor_batch = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))
            actor_batch["response_mask"] = batch[ACTOR_LOSS_MASK]
        metrics = clock.call("update_actor", self.workers.update_actor, actor_batch)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            if key in metrics:
                _check_finite(key, metrics[key], self.step)
        return metrics

    def sync_weights(self, clock: StageClock) -> None:
        """Stage ``sync``: the actor's new weights into the rollout engines (asynchronously: into the
        stash the engines load from; the last step's reach the engines only for a final validation)."""
        with clock.stage("sync"):
            if self.ahead is None:
                sync_s = self.workers.sync_weights()
            else:
                sync_s = self.ahead.sync(self.step, load=self.step < self.total_steps or self.val_dataset is not None)
        if isinstance(sync_s, int | float):
            clock.worker["sync"] = float(sync_s)

    @contextmanager
    def _generation(self, clock: StageClock | None = None) -> Iterator[None]:
        """The workers' optional :class:`GenerationPhases` hooks around a generation; the seconds of
        hooks that report work done (return True) are ``timing_s/switch``."""
        clock = StageClock() if clock is None else clock

        def run(name: str) -> None:
            hook = getattr(self.workers, name, None)
            start = time.perf_counter()
            if hook is not None and hook():
                clock.add("switch", time.perf_counter() - start)

        run("begin_generation")
        yield
        run("end_generation")

    def _corrected(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The actor's batch with ``algorithm.rollout_correction`` applied (``rollout_is_weights`` for
        token_tis, a response mask without the dropped sequences for seq_mask, and with k >= 1 also
        the weights on the kept ones), and its metrics."""
        rc = self.config.algorithm.rollout_correction
        if rc.mode == "none":
            return batch, {}
        if "rollout_log_probs" not in batch:
            raise ValueError(f"algorithm.rollout_correction.mode={rc.mode} needs rollout_log_probs from the rollout")
        weights, loss_mask, metrics = apply_rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rc.mode, rc.threshold,
            off_policy=self.off_policy)
        out = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))
        out["response_mask"] = loss_mask
        if weights is not None:
            out["rollout_is_weights"] = weights
        return out, {f"rollout_corr/{k}": v for k, v in metrics.items()}

    def _batch_metrics(self, batch: Batch, seq_scores: torch.Tensor, timing: dict[str, float]) -> dict[str, float]:
        return (batch_metrics(batch, seq_scores) | self._multi_turn_metrics(batch, "multi_turn/", f"step {self.step}")
                | drain_fallbacks()  # reward/math_verify_fallbacks since the last step's record
                | part_metrics(batch)  # reward/<part>/mean (rlpad.rewards.combine)
                | component_metrics(batch, self.config)  # gdpo/<key>/* (rlpad.training.estimator_inputs)
                | stage_metrics(batch, timing, self.config.actor_rollout_ref.actor.ppo_epochs))

    def _multi_turn_metrics(self, batch: Batch, prefix: str, where: str) -> dict[str, float]:
        """``{prefix}*`` metrics of a multi-turn batch; a warning line queued when most tool calls failed."""
        metrics, failed = multi_turn_metrics(batch, prefix)
        if failed:
            self.warnings.append(f"rlpad: warning: {where}: {failed}")
        return metrics

    # ---- validation --------------------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Mean reward of the validation rollout (greedy unless ``rollout.val_kwargs`` says otherwise; its units:
        rlpad.rewards.stage.validation_scores), the per-source metrics (``val-core/*``, ``val-aux/*``:
        rlpad.training.validation_metrics) and the rollout-vs-actor log-prob mismatch on it (``val/mismatch/*``)."""
        trained, parts, batches, scored = [], [], [], []
        rows = ValidationRows()  # per source: mean@N, best@k, maj@k (rlpad.training.validation_metrics)
        for index, prompts in enumerate(val_batches(self.val_dataset, self.config.data.val_batch_size)):
            batch = self.generate_validation(prompts, index)
            if self.ahead is not None:
                self.ahead.check_latest(batch, "validation")
            task, normalized = validation_scores(batch, self.tokenizer, self.reward_fn)
            trained.append(normalized)
            scored.append(parts_of(batch))
            rows.add(batch["data_source"], batch["uid"], task, batch.non_tensors.get(REWARD_EXTRA_INFO))
            if "tool_calls" in batch:
                batches.append(batch.select("tool_error", "response_mask", "attention_mask", *AGENT_COUNTS))
            if "rollout_log_probs" in batch:
                batch.update(self.workers.compute_log_prob(batch, for_update=False))
                parts.append(batch.select("old_log_probs", "rollout_log_probs", "response_mask"))
        out = {"val/n": float(len(rows)), **rows.metrics()}  # val/reward: the table's mean@N (one computation)
        if trained[0] is not None:  # reward.normalize: the trained reward beside the task's units
            out["val/reward/normalized"] = float(torch.cat(trained).mean())
        out.update(part_metrics(scored, "val/reward/"))
        if batches:
            out.update(self._multi_turn_metrics(Batch.concat(batches), "val/multi_turn/", f"validation at step {self.step}"))
        if parts:
            out.update(mismatch_metrics(Batch.concat(parts), "val/mismatch/"))
        return out

    def generate_validation(self, prompts: Batch, index: int) -> Batch:
        """The validation rollout of validation batch ``index`` (the workers' rollout replicas)."""
        with self._generation():
            return self.workers.generate_validation(prompts, seed=self._val_seed(index))

    # ---- checkpoints -------------------------------------------------------------------------------

    def save_checkpoint(self) -> str:
        staging = self.checkpoints.staging(self.step)
        self.workers.save_checkpoint(staging)
        state = {"step": self.step, "loader": self.train_loader.state_dict(), "history": self.history,
                 "reward": reward_state(self.reward_fn)}  # reward.normalize's running statistics
        if self.ahead is not None:  # the batches generated for later steps are part of the state
            self.ahead.save(staging)
            state["max_off_policy_steps"] = self.ahead.k
        self.save_extra(staging)
        self.last_checkpoint = self.checkpoints.publish(self.step, state)
        return self.last_checkpoint

    def save_extra(self, staging: str) -> None:
        """A subclass's part of the checkpoint being written in ``staging`` (published with the rest)."""

    def _maybe_resume(self) -> None:
        mode = self.config.trainer.resume_mode
        if mode == "disable":
            return
        path = self.checkpoints.latest() if mode == "auto" else mode
        if path is None:
            return
        state = CheckpointDir.read_state(path)
        ahead = in_flight_steps(path) if self.ahead is None else []
        if ahead:
            raise ValueError(f"checkpoint {path} holds the batches of steps {ahead} generated ahead by an "
                             "asynchronous run; resume it with "
                             f"trainer.max_off_policy_steps={state.get('max_off_policy_steps')}")
        self.workers.load_checkpoint(path)
        self.train_loader.load_state_dict(state["loader"])
        self.step, self.history = int(state["step"]), list(state["history"])
        self.warnings += load_reward_state(self.reward_fn, state.get("reward"))
        if self.ahead is None:
            self.workers.sync_weights()  # the rollout engine starts from the initial weights
        else:  # the engines load the checkpoint's weights first, then the saved batches come back
            self.ahead.restore(path, self.step)
        self.last_checkpoint = path
        print(f"resumed from {path} at step {self.step}")
