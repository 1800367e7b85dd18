"""The single-controller GRPO/PPO loop.

One step: prompts -> rollout (n per prompt) -> reward (with ``algorithm.filter_groups``: groups without
reward spread dropped, more prompts generated; then ``reward_model.overlong_buffer``, rlpad.training.dynamic_sampling)
-> old log-probs (actor) -> ref log-probs
-> values (PPO) -> advantages (rlpad.algorithms.advantages: GRPO, GAE) -> critic and actor updates -> weight sync ->
validation every ``test_freq`` steps -> metrics -> checkpoint every ``save_freq`` steps.
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

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch

from rlpad.algorithms.advantages import get_estimator
from rlpad.algorithms.losses import kl_penalty, masked_mean
from rlpad.training.async_schedule import RolloutAhead, in_flight_steps
from rlpad.batch import WORKER_SECONDS, Batch
from rlpad.training.checkpoint import CheckpointDir
from rlpad.config.schema import Config
from rlpad.data import PromptDataset, PromptLoader, val_batches
from rlpad.training.dynamic_sampling import ACC, SEQ_SCORE, collect_batch, shape_rewards
from rlpad.errors import WorkerFailed
from rlpad.training.metrics import MetricsLogger, plot_reward_curve
from rlpad.rewards.rules import score_batch
from rlpad.rollout.agent import AGENT_COUNTS, multi_turn_metrics
from rlpad.algorithms.rollout_correction import apply_rollout_correction, log_prob_mismatch

__all__ = ["GenerationPhases", "Trainer", "Workers", "fill_lr_horizons", "total_training_steps"]


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
    def compute_log_prob(self, batch: Batch, *, for_update: bool = True) -> Batch: ...
    def compute_ref_log_prob(self, batch: Batch) -> Batch: ...
    def compute_teacher(self, batch: Batch) -> Batch: ...  # distillation.enabled only
    def compute_values(self, batch: Batch) -> Batch: ...
    def update_actor(self, batch: Batch) -> dict[str, float]: ...
    def update_critic(self, batch: Batch) -> dict[str, float]: ...
    def sync_weights(self) -> float: ...  # the workers' own seconds (or anything; informational)
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...


class GenerationPhases(Protocol):
    """Optional hooks of a :class:`Workers`: called right before and right after each
    ``generate`` / ``generate_validation`` call; they return True when they did something (their
    time is then ``timing_s/switch``)."""

    def begin_generation(self) -> bool: ...
    def end_generation(self) -> bool: ...


@contextmanager
def _timed(timing: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _pop_worker_s(result: Batch | dict[str, Any], worker_s: dict[str, float], name: str) -> None:
    """Move the seconds a worker measured for itself (``WORKER_SECONDS``) out of a result into ``worker_s``."""
    store = result.meta if isinstance(result, Batch) else result
    seconds = store.pop(WORKER_SECONDS, None) if isinstance(store, dict) else None
    if seconds is not None:
        worker_s[name] = worker_s.get(name, 0.0) + float(seconds)


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
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.last_checkpoint: str | None = None
        self.ahead: RolloutAhead | None = None  # the asynchronous schedule (trainer.max_off_policy_steps >= 1)
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

    def _scored(self, batch: Batch, timing: dict[str, float]) -> Batch:
        """``batch`` with its raw rewards: ``token_level_scores`` (B, R), ``seq_score`` and ``acc`` (B,)."""
        with _timed(timing, "reward"):
            batch["token_level_scores"], batch[SEQ_SCORE], batch[ACC] = score_batch(batch, self.tokenizer,
                                                                                    self.reward_fn)
            _check_finite("reward", batch[SEQ_SCORE], self.step)
        return batch

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
            if self.val_dataset is not None and ((cfg.test_freq > 0 and self.step % cfg.test_freq == 0) or last):
                metrics.update(self.validate())
            self.history.append({"step": self.step, **metrics})
            logger.log(self.step, metrics)
            self._flush_warnings(logger)
            if cfg.save_freq > 0 and (self.step % cfg.save_freq == 0 or last):
                self.save_checkpoint()

    def train_step(self, prompts: Batch | None) -> dict[str, float]:
        """One GRPO/PPO step on a batch of prompts (None: the batch the asynchronous schedule generated
        for this step); returns its metrics.

        ``timing_s/<phase>`` is the driver's wall time of each phase, ``worker_s/<phase>`` the
        seconds the workers measured inside themselves for it (when they report them), and
        ``timing_s/overhead`` the step's wall time minus the workers' seconds: what the trainer
        itself costs (reward, advantages, moving batches through Ray, splitting and merging).
        """
        step_start = time.perf_counter()
        cfg, algo = self.config, self.config.algorithm
        estimator = get_estimator(algo.adv_estimator)
        timing: dict[str, float] = {}
        worker_s: dict[str, float] = {}

        def generate_scored(prompts: Batch, gen_batch: int) -> Batch:
            with self._generation(timing), _timed(timing, "gen"):
                batch = self.workers.generate(prompts, seed=self._seed(self.step, gen_batch))
            _pop_worker_s(batch, worker_s, "gen")
            return self._scored(batch, timing)

        async_metrics: dict[str, float] = {}
        if self.ahead is None:  # with algorithm.filter_groups: generation batches until enough groups have spread
            batch, metrics = collect_batch(cfg, prompts, self.train_loader.next_batch, generate_scored)
        else:  # generated while earlier steps trained: the step waits only for what is not done yet
            ahead, async_metrics = self.ahead.take(self.step)
            timing["wait_rollout"] = async_metrics.pop("timing_s/wait_rollout")
            batch, metrics = collect_batch(cfg, None, self.train_loader.next_batch,  # filter_groups: refused
                                           lambda _p, _j: self._scored(ahead, timing))
        seq_scores, shaping = shape_rewards(batch, cfg)  # reward_model.overlong_buffer, after the filter
        scores = batch["token_level_scores"]
        metrics.update(shaping)
        with _timed(timing, "old_log_prob"):
            out = self.workers.compute_log_prob(batch)
        _pop_worker_s(out, worker_s, "old_log_prob")
        batch.update(out)
        metrics.update(_mismatch_metrics(batch, "mismatch/"))
        if cfg.uses_ref:
            with _timed(timing, "ref"):
                out = self.workers.compute_ref_log_prob(batch)
            _pop_worker_s(out, worker_s, "ref")
            batch.update(out)
        if cfg.distillation.enabled:  # on-policy distillation: the teacher scores the batch (docs/distillation.md)
            with _timed(timing, "teacher"):
                out = self.workers.compute_teacher(batch)
            _pop_worker_s(out, worker_s, "teacher")
            batch.update(out)
        if estimator.uses_critic:
            with _timed(timing, "values"):
                out = self.workers.compute_values(batch)
            _pop_worker_s(out, worker_s, "values")
            batch.update(out)
        mask = batch["response_mask"].float()
        rewards = scores
        if algo.use_kl_in_reward:
            kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], algo.kl_penalty) * mask
            rewards = scores - algo.kl_coef * kl
            metrics["reward/kl_penalty"] = float(masked_mean(kl, mask))
        batch["token_level_rewards"] = rewards
        with _timed(timing, "adv"):
            batch["advantages"], batch["returns"] = estimator.compute(batch, cfg)
        if estimator.uses_critic:
            with _timed(timing, "update_critic"):
                critic_metrics = self.workers.update_critic(batch)
            _pop_worker_s(critic_metrics, worker_s, "update_critic")
            metrics.update(critic_metrics)
        actor_batch, corr_metrics = self._corrected(batch)
        metrics.update(corr_metrics)
        with _timed(timing, "update_actor"):
            actor_metrics = self.workers.update_actor(actor_batch)
        _pop_worker_s(actor_metrics, worker_s, "update_actor")
        metrics.update(actor_metrics)
        # The workers skip the optimizer step on a non-finite gradient norm; stop here so the
        # run ends with the weights of the last good step.
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
            if key in metrics:
                _check_finite(key, metrics[key], self.step)
        with _timed(timing, "sync"):
            if self.ahead is None:
                sync_s = self.workers.sync_weights()
            else:  # the last step's weights reach the engines only for the final validation
                sync_s = self.ahead.sync(self.step, load=self.step < self.total_steps or self.val_dataset is not None)
        if isinstance(sync_s, int | float):
            worker_s["sync"] = float(sync_s)
        metrics.update(self._batch_metrics(batch, seq_scores, timing))
        if async_metrics:
            metrics.update(async_metrics)
            if async_metrics["async/gen_s"] > 0:
                metrics["tokens_per_s/gen"] = float(batch["response_mask"].sum()) / async_metrics["async/gen_s"]
        wall = time.perf_counter() - step_start
        metrics["timing_s/step_wall"] = wall
        metrics.update({f"worker_s/{k}": v for k, v in worker_s.items()})
        if worker_s:
            metrics["timing_s/overhead"] = wall - sum(worker_s.values())
        return metrics

    @contextmanager
    def _generation(self, timing: dict[str, float] | None = None) -> Iterator[None]:
        """The workers' optional :class:`GenerationPhases` hooks around a generation; the seconds of
        hooks that report work done (return True) are ``timing_s/switch``."""
        timing = {} if timing is None else timing

        def run(name: str) -> None:
            hook = getattr(self.workers, name, None)
            start = time.perf_counter()
            if hook is not None and hook():
                timing["switch"] = timing.get("switch", 0.0) + time.perf_counter() - start

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
            off_policy=self.ahead is not None)
        out = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))
        out["response_mask"] = loss_mask
        if weights is not None:
            out["rollout_is_weights"] = weights
        return out, {f"rollout_corr/{k}": v for k, v in metrics.items()}

    def _batch_metrics(self, batch: Batch, seq_scores: torch.Tensor, timing: dict[str, float]) -> dict[str, float]:
        mask = batch["response_mask"].float()
        attention = batch["attention_mask"]
        valid, response_tokens = float(attention.sum()), float(mask.sum())
        epochs = self.config.actor_rollout_ref.actor.ppo_epochs
        out = {
            "reward/mean": float(seq_scores.mean()), "reward/std": float(seq_scores.std()) if len(seq_scores) > 1 else 0.0,
            "response_length/mean": float(mask.sum(1).mean()), "response_length/max": float(mask.sum(1).max()),
            "padding_ratio": 1.0 - valid / attention.numel(),
        }
        out.update(self._multi_turn_metrics(batch, "multi_turn/", f"step {self.step}"))
        out.update({f"timing_s/{k}": v for k, v in timing.items()})
        throughput = {"gen": response_tokens, "old_log_prob": valid, "ref": valid, "values": valid,
                      "update_actor": valid * epochs, "update_critic": valid * epochs}
        out.update({f"tokens_per_s/{k}": throughput[k] / t for k, t in timing.items() if k in throughput and t > 0})
        out["timing_s/step"] = sum(timing.values())
        return out

    def _multi_turn_metrics(self, batch: Batch, prefix: str, where: str) -> dict[str, float]:
        """``{prefix}*`` metrics of a multi-turn batch; a warning line queued when most tool calls failed."""
        metrics, failed = multi_turn_metrics(batch, prefix)
        if failed:
            self.warnings.append(f"rlpad: warning: {where}: {failed}")
        return metrics

    # ---- validation --------------------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Mean reward of the validation rollout (greedy unless ``rollout.val_kwargs`` says otherwise),
        and the rollout-vs-actor log-prob mismatch on it (``val/mismatch/*``)."""
        scores, parts, batches = [], [], []
        for index, prompts in enumerate(val_batches(self.val_dataset, self.config.data.val_batch_size)):
            with self._generation():
                batch = self.workers.generate_validation(prompts, seed=self._val_seed(index))
            if self.ahead is not None:
                self.ahead.check_latest(batch, "validation")
            scores.append(score_batch(batch, self.tokenizer, self.reward_fn)[1])
            if "tool_calls" in batch:
                batches.append(batch.select("tool_error", "response_mask", "attention_mask", *AGENT_COUNTS))
            if "rollout_log_probs" in batch:
                batch.update(self.workers.compute_log_prob(batch, for_update=False))
                parts.append(batch.select("old_log_probs", "rollout_log_probs", "response_mask"))
        all_scores = torch.cat(scores)
        out = {"val/reward": float(all_scores.mean()), "val/n": float(all_scores.numel())}
        if batches:
            out.update(self._multi_turn_metrics(Batch.concat(batches), "val/multi_turn/", f"validation at step {self.step}"))
        if parts:
            out.update(_mismatch_metrics(Batch.concat(parts), "val/mismatch/"))
        return out

    # ---- checkpoints -------------------------------------------------------------------------------

    def save_checkpoint(self) -> str:
        staging = self.checkpoints.staging(self.step)
        self.workers.save_checkpoint(staging)
        state = {"step": self.step, "loader": self.train_loader.state_dict(), "history": self.history}
        if self.ahead is not None:  # the batches generated for later steps are part of the state
            self.ahead.save(staging)
            state["max_off_policy_steps"] = self.ahead.k
        self.last_checkpoint = self.checkpoints.publish(self.step, state)
        return self.last_checkpoint

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
        if self.ahead is None:
            self.workers.sync_weights()  # the rollout engine starts from the initial weights
        else:  # the engines load the checkpoint's weights first, then the saved batches come back
            self.ahead.restore(path, self.step)
        self.last_checkpoint = path
        print(f"resumed from {path} at step {self.step}")


def _mismatch_metrics(batch: Batch, prefix: str) -> dict[str, float]:
    """:func:`rlpad.algorithms.rollout_correction.log_prob_mismatch` of the batch, keys prefixed (none without rollout log-probs)."""
    if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
        return {}
    stats = log_prob_mismatch(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
    return {f"{prefix}{k}": v for k, v in stats.items()}


def summarize(history: list[dict[str, Any]]) -> dict[str, float]:
    """Initial/final validation reward and mean per-phase throughput of a run."""
    val = [r["val/reward"] for r in history if "val/reward" in r]
    steps = [r for r in history if "reward/mean" in r]
    out: dict[str, float] = {}
    if val:
        out["val_reward_initial"], out["val_reward_final"] = val[0], val[-1]
    for key in sorted({k for r in steps for k in r if k.startswith("tokens_per_s/")}):
        values = [r[key] for r in steps if key in r and math.isfinite(r[key])]
        if values:
            out[key] = float(np.median(values))
    for key in ("mismatch/abs_diff_mean", "mismatch/abs_diff_max", "mismatch/k3_kl"):
        values = [r[key] for r in steps if key in r]
        if values:
            out[key] = float(np.median(values))
    val_mismatch = [r for r in history if "val/mismatch/abs_diff_mean" in r]
    if val_mismatch:
        out.update({k: v for k, v in val_mismatch[-1].items() if k.startswith("val/mismatch/")})
    if steps:
        out["padding_ratio"] = float(np.mean([r["padding_ratio"] for r in steps]))
        out["step_s"] = float(np.median([r["timing_s/step"] for r in steps]))
    return out
