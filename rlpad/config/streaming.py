"""The ``async_training.*`` section (verl's fully_async policy names): streaming rollouts, and its config rules.

docs/streaming.md. The rules here are the ones a recipe can break before any compute: ranges, the
incompatible modes, and every rlpad feature streaming does not serve yet (each refused naming why).
Torch-free; imports nothing of rlpad but the config floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

Config = Any  # rlpad.config.schema.Config (which imports this section: not imported back)

__all__ = ["AsyncTrainingConfig", "STREAMING_BACKENDS", "streaming_problems", "window_groups"]

# Rollout backends with an asynchronous engine (streaming requests, pause at a token boundary, abort).
STREAMING_BACKENDS = ("vllm",)
LOOP_BUILT = True  # the driver's streaming loop (rlpad/training/streaming.py) exists; False: enable=true is refused


@dataclass
class AsyncTrainingConfig:
    """Streaming rollouts (verl's ``async_training.*``, docs/streaming.md): the engines generate continuously, a
    prompt's group enters a buffer when its n responses are done, the trainer takes batches of groups from it and
    new weights land mid-generation. A step takes data.train_batch_size groups (= require_batches x
    actor.ppo_mini_batch_size); a token's policy version counts the actor updates applied to the weights that
    sampled it."""

    enable: bool = False  # rlpad: run the streaming loop (verl: its fully_async_main entry point)
    # verl: between two weight loads the engines start at most floor((1 + staleness_threshold) x W) groups less those
    # started earlier and not yet trained (W = trigger_parameter_sync_step x data.train_batch_size groups); 0: the
    # engines never run ahead of the window; >= 0
    staleness_threshold: float = 0.1
    trigger_parameter_sync_step: int = 1  # verl: actor updates (steps) between two weight loads into the engines
    require_batches: int = 1  # verl: ppo mini-batches one step takes from the buffer (x actor.ppo_mini_batch_size groups)
    # verl: at a weight load pause the responses in flight at a token boundary and continue them on the new weights
    # (their tokens keep the versions that sampled them); false: abort them and regenerate from the prompt (counted)
    partial_rollout: bool = True
    concurrent_samples_per_replica: int | None = None  # responses in flight per engine at most (>= rollout.n); null: rollout.max_num_seqs
    # rlpad: the hard cap: a group whose oldest token is more than this many updates behind the update that would
    # train it is dropped (counted in stream/dropped_*), never trained; >= trigger_parameter_sync_step - 1
    max_staleness: int = 2
    # rlpad: a logical clock of rounds instead of wall time (docs/streaming.md): two runs of one command are equal bit
    # for bit (weight loads land at seeded token counts per engine) and checkpoints (trainer.save_freq) hold the buffer
    # and every in-flight partial response; costs engine time (each round re-prefills prompt + partial, no prefix cache)
    deterministic: bool = False
    # rlpad, with deterministic=true: the most tokens a response advances in one round (each round's budget is drawn in
    # [ceil(round_tokens / 2), round_tokens] from actor_rollout_ref.rollout.seed and the round's index); >= 1
    round_tokens: int = 16


def window_groups(config: Config) -> int:
    """W: the groups the trainer takes between two weight loads (trigger_parameter_sync_step x train_batch_size)."""
    return config.async_training.trigger_parameter_sync_step * config.data.train_batch_size


def _unsupported(config: Config, uses_critic: bool) -> list[tuple[str, str]]:
    """(key=value, why) of every rlpad feature the streaming loop does not serve yet."""
    arr, rw = config.actor_rollout_ref, config.reward
    t, a = config.trainer, config.async_training
    found: list[tuple[bool, str, str]] = [
        (arr.model.lora_rank > 0, f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank}",
         "LoRA adapter loads into a paused engine are not built"),
        (uses_critic and t.critic_warmup > 1, f"trainer.critic_warmup={t.critic_warmup}",
         "a step without an actor update would load unchanged weights as a new policy version (set 0)"),
        (rw.judge.enable, "reward.judge.enable=true",
         "the judge's engines are not tested under the reward thread of streaming mode yet"),
        (arr.rollout.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable=true",
         "multi-turn tool rollouts are not streamed yet (a turn boundary would be the pause point)"),
        (arr.rollout.agent.agent_loop_config_path is not None,
         f"actor_rollout_ref.rollout.agent.agent_loop_config_path={arr.rollout.agent.agent_loop_config_path}",
         "agent loops are not streamed yet (the streaming rollout sends single-turn requests)"),
        (arr.rollout.agent.default_agent_loop not in (None, "single_turn_agent"),
         f"actor_rollout_ref.rollout.agent.default_agent_loop={arr.rollout.agent.default_agent_loop}",
         "agent loops are not streamed yet (the streaming rollout sends single-turn requests)"),
        (config.distillation.enabled, "distillation.enabled=true", "the teacher is not served in streaming mode"),
        (bool(config.data.val_files) and t.test_freq > 0 and t.test_freq % a.trigger_parameter_sync_step != 0,
         f"trainer.test_freq={t.test_freq}", "validation runs on the weights a load just put in the engines: it must "
         f"be a multiple of async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step}"),
        (t.save_freq > 0 and not a.deterministic, f"trainer.save_freq={t.save_freq}",
         "a checkpoint of the buffer and the in-flight partial responses needs the round schedule: set "
         "async_training.deterministic=true (or save_freq=-1)"),
        (t.save_freq > 0 and a.deterministic and t.save_freq % a.trigger_parameter_sync_step != 0,
         f"trainer.save_freq={t.save_freq}", "the stream's state is saved at a weight load: it must be a multiple of "
         f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step}"),
        (t.save_freq > 0 and bool(config.reward.normalize), f"reward.normalize={list(config.reward.normalize)}",
         "a resume rescores the buffered groups, which would move the running statistics twice (with "
         "trainer.save_freq > 0)"),
    ]
    return [(key, why) for bad, key, why in found if bad]


def streaming_problems(config: Config, uses_critic: bool) -> list[str]:
    """Every problem of ``async_training.*`` and of the rest of the config under streaming, one line each."""
    a, t = config.async_training, config.trainer
    problems: list[str] = []
    if not (isinstance(a.staleness_threshold, int | float) and math.isfinite(a.staleness_threshold)
            and a.staleness_threshold >= 0):
        problems.append(f"async_training.staleness_threshold={a.staleness_threshold!r} must be a finite number >= 0")
    for key, value in (("trigger_parameter_sync_step", a.trigger_parameter_sync_step),
                       ("require_batches", a.require_batches), ("round_tokens", a.round_tokens)):
        if value < 1:
            problems.append(f"async_training.{key}={value} must be >= 1")
    n = config.actor_rollout_ref.rollout.n
    if a.concurrent_samples_per_replica is not None and a.concurrent_samples_per_replica < n:
        problems.append(f"async_training.concurrent_samples_per_replica={a.concurrent_samples_per_replica} must be "
                        f">= actor_rollout_ref.rollout.n={n}: a group's responses run on one engine (or null: "
                        "actor_rollout_ref.rollout.max_num_seqs)")
    if a.max_staleness < max(a.trigger_parameter_sync_step - 1, 0):
        problems.append(f"async_training.max_staleness={a.max_staleness} must be >= trigger_parameter_sync_step - 1 = "
                        f"{a.trigger_parameter_sync_step - 1}: the last step between two weight loads trains groups "
                        "that many updates old, so every such group would be dropped")
    if not a.enable:
        return problems
    if not LOOP_BUILT:
        problems.append("async_training.enable=true: the streaming loop on the engines is not built yet (the config, "
                        "the group buffer, the staleness rule and the per-token correction are; docs/streaming.md)")
    step_groups = a.require_batches * config.actor_rollout_ref.actor.ppo_mini_batch_size
    if config.data.train_batch_size != step_groups:
        problems.append(f"data.train_batch_size={config.data.train_batch_size} must equal async_training.require_batches"
                        f" x actor_rollout_ref.actor.ppo_mini_batch_size = {step_groups} with async_training.enable=true "
                        "(the groups one step takes from the buffer)")
    if t.max_off_policy_steps >= 1:
        problems.append(f"trainer.max_off_policy_steps={t.max_off_policy_steps} and async_training.enable=true are two "
                        "asynchronous modes; choose one (set max_off_policy_steps=0 for streaming)")
    if config.algorithm.rollout_correction.mode == "none":
        problems.append("async_training.enable=true trains on tokens sampled by older policy versions: set "
                        "algorithm.rollout_correction.mode to token_tis or seq_mask (each token weighted by its own "
                        "behaviour log-prob)")
    if t.colocate is not False:
        problems.append(f"async_training.enable=true needs the separate layout (engines generate while the actor "
                        f"trains): set trainer.colocate=false, got {t.colocate}")
    if t.backend != "ray":
        problems.append(f"async_training.enable=true needs trainer.backend=ray (engines in processes of their own), "
                        f"got {t.backend}")
    name = config.actor_rollout_ref.rollout.name
    if name not in STREAMING_BACKENDS:
        problems.append(f"actor_rollout_ref.rollout.name={name} has no asynchronous engine (pause at a token boundary, "
                        f"abort); async_training.enable=true needs one of {', '.join(STREAMING_BACKENDS)}")
    problems += [f"{key} is not supported with async_training.enable=true: {why}"
                 for key, why in _unsupported(config, uses_critic)]
    return problems
