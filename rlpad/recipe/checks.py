"""The config's semantic checks: every value against its choices and the others (batch arithmetic,
modes, layouts), each problem named by its dotted key; run by :mod:`rlpad.recipe.load` on every
loaded config. The rules of one feature live with it (``*_problems`` in rlpad.lora.rules, rlpad.parallel,
rlpad.algorithms.policy_loss, rlpad.rollout.tools, rlpad.topology) and are gathered here. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlpad.algorithms.advantages import ESTIMATORS, advantage_problems
from rlpad.config.code import code_problems
from rlpad.config.doc import format_value
from rlpad.config.choices import (
    ATTN_IMPLEMENTATIONS, BACKENDS, DEVICES, DTYPES, FILTER_METRICS, LOG_LEVELS, LOSS_AGG_MODES,
    OLD_LOG_PROB_LAYOUTS, ROLLOUT_CORRECTION_MODES, TRUNCATION_MODES, VLLM_MAX_TEMPERATURE, kl_kind,
)
from rlpad.config.checkpoint import checkpoint_problems
from rlpad.config.schema import Config
from rlpad.config.streaming import streaming_problems
from rlpad.config.verl_keys import NO_EFFECT_KEYS
from rlpad.lora.rules import lora_value_problems, syncs_adapter
from rlpad.training.metrics import LOGGERS
from rlpad.parallel import role_world, sequence_parallel_problems, sp_size
from rlpad.algorithms.policy_loss import policy_loss_problems
from rlpad.algorithms.distillation_rules import distillation_problems, task_advantages_used
from rlpad.rollout import BACKENDS as ROLLOUT_BACKENDS, backend_class
from rlpad.rewards.settings import reward_problems
from rlpad.rollout.agent_loops import agent_loop_problems
from rlpad.rollout.environments import environment_problems
from rlpad.rollout.stateful_tools import stateful_tool_problems
from rlpad.rollout.tools import multi_turn_problems
from rlpad.topology import layout_problems

__all__ = ["no_effect_notice", "registry_choices", "validate_config"]


def _dapo_problems(config: Config) -> list[str]:
    """algorithm.filter_groups, data.gen_batch_size and reward_model.overlong_buffer (rlpad/training/dynamic_sampling.py)."""
    fg, d, ob = config.algorithm.filter_groups, config.data, config.reward_model.overlong_buffer
    problems = []
    if fg.metric not in FILTER_METRICS:
        problems.append(f"algorithm.filter_groups.metric={fg.metric!r} is not valid; choose one of "
                        f"{', '.join(FILTER_METRICS)}")
    if d.gen_batch_size is not None and d.gen_batch_size < 1:
        problems.append(f"data.gen_batch_size={d.gen_batch_size} must be >= 1 (or null: data.train_batch_size)")
    elif not fg.enable and d.gen_batch_size not in (None, d.train_batch_size):
        problems.append(f"data.gen_batch_size={d.gen_batch_size} differs from data.train_batch_size="
                        f"{d.train_batch_size}: generation batches of another size need "
                        "algorithm.filter_groups.enable=true (dynamic sampling)")
    n = config.actor_rollout_ref.rollout.n
    if fg.enable and n == 1:
        problems.append("algorithm.filter_groups.enable=true needs actor_rollout_ref.rollout.n >= 2: it keeps the groups "
                        "whose responses differ in the metric, and a group of one response has no spread (it is kept, "
                        "as in verl), so the filter would keep every group")
    k = config.trainer.max_off_policy_steps
    if fg.enable and k >= 1:
        problems.append(f"algorithm.filter_groups.enable=true is not supported with trainer.max_off_policy_steps={k}: "
                        "dynamic sampling decides how many prompts a step generates only after scoring them, so "
                        "the batches cannot be generated ahead; set max_off_policy_steps=0")
    if ob.enable:
        if not 0 < ob.len <= d.max_response_length:
            problems.append(f"reward_model.overlong_buffer.len={ob.len} must be in [1, data.max_response_length="
                            f"{d.max_response_length}]")
        if ob.penalty_factor < 0:
            problems.append(f"reward_model.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")
    return problems


def _value(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def no_effect_notice(config: Config) -> str | None:
    """The one warning line naming the keys of :data:`rlpad.config.verl_keys.NO_EFFECT_KEYS` set to a value
    other than their default (verl's), each with why it changes nothing in rlpad; None when there are none."""
    default = Config()
    changed = [key for key in NO_EFFECT_KEYS if _value(config, key) != _value(default, key)]
    if not changed:
        return None
    reasons: dict[str, list[str]] = {}  # reason -> its keys, in table order
    for key in changed:
        reasons.setdefault(NO_EFFECT_KEYS[key], []).append(f"{key}={format_value(_value(config, key))}")
    return "warning: verl keys with no effect in rlpad: " + "; ".join(
        f"{', '.join(keys)} ({reason})" for reason, keys in reasons.items())


def _warmup_problems(config: Config, uses_critic: bool) -> list[str]:
    """trainer.critic_warmup (rlpad/training/warmup.py)."""
    w = config.trainer.critic_warmup
    if w < 0:
        return [f"trainer.critic_warmup={w} must be >= 0"]
    if w > 1 and not uses_critic:
        return [f"trainer.critic_warmup={w} holds the actor back while the critic trains, but "
                f"algorithm.adv_estimator={config.algorithm.adv_estimator} has no critic: nothing would train; set 0"]
    return []


def registry_choices() -> dict[str, tuple[str, ...]]:
    """Keys whose valid names a registry holds, with those names (`rlpad config` lists them)."""
    return {"algorithm.adv_estimator": tuple(ESTIMATORS)}


def validate_config(config: Config) -> Config:
    """Check values against each other; ValueError listing every problem by its dotted key."""
    problems: list[str] = []
    d, arr, alg = config.data, config.actor_rollout_ref, config.algorithm
    actor, rollout, ref, critic, trainer = arr.actor, arr.rollout, arr.ref, config.critic, config.trainer

    def one_of(key: str, value: Any, choices: Sequence[str]) -> None:
        if value not in choices:
            problems.append(f"{key}={value!r} is not valid; choose one of {', '.join(choices)}")

    def positive(key: str, value: float | None, optional: bool = False) -> None:
        if value is None and optional:
            return
        if value is None or value <= 0:
            problems.append(f"{key}={value!r} must be > 0")

    one_of("algorithm.adv_estimator", alg.adv_estimator, registry_choices()["algorithm.adv_estimator"])
    estimator = ESTIMATORS.get(alg.adv_estimator)
    uses_critic = estimator is not None and estimator.uses_critic
    one_of("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    one_of("critic.loss_agg_mode", critic.loss_agg_mode, LOSS_AGG_MODES)
    problems += advantage_problems(config)
    problems += policy_loss_problems(actor)
    problems += distillation_problems(config)
    problems += checkpoint_problems(config)
    for key, kind in (("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type),
                      ("algorithm.kl_penalty", alg.kl_penalty)):
        try:
            kl_kind(kind)
        except ValueError as e:
            problems.append(f"{key}={kind!r}: {e}")
    one_of("data.truncation", d.truncation, TRUNCATION_MODES)
    one_of("actor_rollout_ref.rollout.name", rollout.name, list(ROLLOUT_BACKENDS))
    one_of("actor_rollout_ref.rollout.mode", rollout.mode, ("sync", "async"))  # verl's values; no effect here
    for key, dt in (("actor_rollout_ref.model.dtype", arr.model.dtype), ("critic.model.dtype", critic.model.dtype),
                    ("actor_rollout_ref.rollout.dtype", rollout.dtype)):
        one_of(key, dt, list(DTYPES))
    for key, mcfg in (("actor_rollout_ref.model", arr.model), ("critic.model", critic.model)):
        if mcfg.share_prompts and not mcfg.use_remove_padding:
            problems.append(f"{key}.share_prompts=true needs {key}.use_remove_padding=true "
                            "(the shared prompt lives in the packed row)")
        if mcfg.use_liger and trainer.device != "cuda":
            problems.append(f"{key}.use_liger=true needs trainer.device=cuda (liger-kernel's kernels are Triton on "
                            f"CUDA), got trainer.device={trainer.device!r}")
        if mcfg.share_prompts_min_saved_fraction is not None and not 0 <= mcfg.share_prompts_min_saved_fraction <= 1:
            problems.append(f"{key}.share_prompts_min_saved_fraction={mcfg.share_prompts_min_saved_fraction!r} must be "
                            "a fraction in [0, 1] (of a micro-batch's valid tokens that sharing saves)")
    one_of("trainer.device", trainer.device, DEVICES)
    one_of("trainer.backend", trainer.backend, BACKENDS)
    one_of("trainer.log_level", trainer.log_level, LOG_LEVELS)
    models = [("actor_rollout_ref.model", arr.model)] + ([("critic.model", critic.model)] if uses_critic else [])
    for key, model in models:
        one_of(f"{key}.attn_implementation", model.attn_implementation, ATTN_IMPLEMENTATIONS)
        if model.attn_implementation == "sdpa" and model.use_remove_padding:
            problems.append(f"{key}.attn_implementation=sdpa runs the padded path only; set {key}.use_remove_padding=false "
                            "or choose auto / rlpad_varlen / flash_attention_2")
    one_of("algorithm.rollout_correction.mode", alg.rollout_correction.mode, ROLLOUT_CORRECTION_MODES)
    if not alg.rollout_correction.threshold > 1.0:
        problems.append(f"algorithm.rollout_correction.threshold={alg.rollout_correction.threshold!r} must be > 1 "
                        "(token_tis caps weights at it, seq_mask keeps geometric-mean ratios in [1/C, C])")
    k = trainer.max_off_policy_steps
    if k < 0:
        problems.append(f"trainer.max_off_policy_steps={k} must be >= 0 (0: synchronous training)")
    elif k >= 1 and alg.rollout_correction.mode == "none":
        problems.append(f"trainer.max_off_policy_steps={k} trains on batches up to {k} update(s) old: set "
                        "algorithm.rollout_correction.mode to token_tis or seq_mask to correct for the policy that "
                        "generated them (the behaviour policy, rollout_log_probs)")
    problems += _dapo_problems(config)
    problems += _warmup_problems(config, uses_critic)
    problems += streaming_problems(config, uses_critic)
    one_of("actor_rollout_ref.actor.old_log_prob_layout", actor.old_log_prob_layout, OLD_LOG_PROB_LAYOUTS)
    for name in trainer.logger:
        one_of("trainer.logger[]", name, LOGGERS)
    problems += reward_problems(config)
    problems += code_problems(config.reward.code)
    problems += multi_turn_problems(rollout.multi_turn)
    problems += stateful_tool_problems(rollout.multi_turn)
    problems += agent_loop_problems(rollout.agent, rollout.multi_turn.enable)
    problems += environment_problems(rollout.agent, rollout.multi_turn.interaction_config_path)

    # sizes
    if rollout.n < 1:
        problems.append(f"actor_rollout_ref.rollout.n={rollout.n} must be >= 1")
    elif estimator is not None and rollout.n < estimator.min_group_size and task_advantages_used(config):
        others = [name for name, e in ESTIMATORS.items() if e.min_group_size <= rollout.n]
        problems.append(f"actor_rollout_ref.rollout.n={rollout.n}: {estimator.needs} and needs "
                        f"n >= {estimator.min_group_size} (or use algorithm.adv_estimator={' | '.join(others)})")
    if rollout.val_kwargs.n < 1:
        problems.append(f"actor_rollout_ref.rollout.val_kwargs.n={rollout.val_kwargs.n} must be >= 1")
    positive("actor_rollout_ref.rollout.max_num_seqs", rollout.max_num_seqs)
    if rollout.max_num_seqs > 0 and rollout.max_num_batched_tokens < rollout.max_num_seqs:
        problems.append(f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} must be "
                        f">= actor_rollout_ref.rollout.max_num_seqs={rollout.max_num_seqs} (vLLM's step budget holds "
                        "at least one token per sequence)")
    if rollout.tensor_model_parallel_size < 1:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} "
                        "must be >= 1")
    problems += layout_problems(config)
    problems += lora_value_problems(config)
    if syncs_adapter(config) and rollout.name in ROLLOUT_BACKENDS and not backend_class(rollout.name).serves_lora:
        problems.append(f"actor_rollout_ref.rollout.lora_sync=adapter needs a rollout backend that serves LoRA "
                        f"adapters; actor_rollout_ref.rollout.name={rollout.name} does not (use lora_sync=merged)")
    positive("actor_rollout_ref.rollout.weight_sync_bucket_mb", rollout.weight_sync_bucket_mb)
    for key, value, optional in (
        ("data.train_batch_size", d.train_batch_size, False),
        ("data.val_batch_size", d.val_batch_size, True),
        ("data.max_prompt_length", d.max_prompt_length, False),
        ("data.max_response_length", d.max_response_length, False),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size, False),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu, True),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu, False),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs, False),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", rollout.log_prob_micro_batch_size_per_gpu, True),
        ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu, False),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", ref.log_prob_micro_batch_size_per_gpu, True),
        ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu, False),
        ("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size, False),
        ("critic.ppo_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu, True),
        ("critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu, False),
        ("critic.ppo_epochs", critic.ppo_epochs, False),
        ("trainer.total_training_steps", trainer.total_training_steps, True),
        ("trainer.total_epochs", trainer.total_epochs, False),
        ("trainer.n_gpus_per_node", trainer.n_gpus_per_node, False),
        ("trainer.nnodes", trainer.nnodes, False),
        ("actor_rollout_ref.rollout.temperature", rollout.temperature, False),
        ("actor_rollout_ref.actor.clip_ratio", actor.clip_ratio, False),
    ):
        positive(key, value, optional)
    if not 0 < rollout.top_p <= 1:
        problems.append(f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]")
    if rollout.name == "vllm":
        for key, value in (("temperature", rollout.temperature),
                           ("val_kwargs.temperature", rollout.val_kwargs.temperature)):
            if value > VLLM_MAX_TEMPERATURE:
                problems.append(f"actor_rollout_ref.rollout.{key}={value} must be <= {VLLM_MAX_TEMPERATURE} with "
                                "actor_rollout_ref.rollout.name=vllm (vLLM's SamplingParams bound)")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        problems.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} "
                        "must be in (0, 1]")
    if actor.optim.lr < 0 or critic.optim.lr < 0:
        problems.append("optim.lr must be >= 0")

    # batch arithmetic (verl semantics: mini-batch sizes count prompts, rollout.n responses each); a
    # mini-batch splits over the data-parallel groups (ranks / sequence-parallel size, rlpad.parallel)
    problems += sequence_parallel_problems(config)
    world = role_world(config)
    n = max(rollout.n, 1)
    sections = [("actor_rollout_ref.actor", arr, "actor")] + ([("critic", critic, "critic")] if uses_critic else [])
    for key, section, role in sections:
        mini = (actor if role == "actor" else critic).ppo_mini_batch_size
        sp = sp_size(section, role)
        dp = world // sp if sp >= 1 and world % sp == 0 else world
        if d.train_batch_size <= 0 or mini <= 0:
            continue
        if (d.train_batch_size * n) % (mini * n):
            problems.append(
                f"data.train_batch_size={d.train_batch_size} (x rollout.n={n} = {d.train_batch_size * n} responses) "
                f"must be divisible by {key}.ppo_mini_batch_size={mini} (x n = {mini * n})")
        elif (mini * n) % dp:
            groups = (f"{world} ranks / {key}.ulysses_sequence_parallel_size={sp}" if dp != world
                      else "trainer.n_gpus_per_node x trainer.nnodes")
            problems.append(f"{key}.ppo_mini_batch_size={mini} x rollout.n={n} = {mini * n} responses must split "
                            f"evenly over {dp} workers ({groups})")

    if problems:
        raise ValueError("invalid config:\n  " + "\n  ".join(problems))
    return config
