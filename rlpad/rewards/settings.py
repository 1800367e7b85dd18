"""The reward section's rules, torch-free (the config checks import them): the names of the reward
parts and :func:`reward_problems`, every check of ``reward.*`` and its verl names, one line each."""

from __future__ import annotations

import dataclasses

from rlpad.config.choices import ATTN_IMPLEMENTATIONS, DTYPES, REWARD_MANAGERS
from rlpad.config.rewards import RewardConfig, RewardModelScoringConfig
from rlpad.config.schema import Config
from rlpad.rewards.judge_rules import judge_problems

__all__ = ["JUDGE", "MODEL", "RULE", "part_names", "reward_model_section", "reward_problems"]

RULE = "rule"  # the part scored by the reward function (reward.fn / reward.custom_reward_function)
MODEL = "reward_model"  # the part scored by reward.reward_model
JUDGE = "judge"  # the part scored by reward.judge (a generative judge: rlpad.rewards.judge)


def part_names(reward: RewardConfig) -> list[str]:
    """The reward parts a run computes, in order: the rule, the reward model and the judge when enabled,
    then ``reward.extra_fns``."""
    return ([RULE] + ([MODEL] if reward.reward_model.enable else []) + ([JUDGE] if reward.judge.enable else [])
            + list(reward.extra_fns))


def reward_model_section(config: Config) -> RewardModelScoringConfig:
    """``reward.reward_model`` as its workers run it: ``share_prompts`` null resolved to
    ``actor_rollout_ref.model.share_prompts`` (off when the reward model runs the padded batch). The
    workers share only a batch of the policy's own rows (rlpad.rewards.model_scorer ships ``responses``
    then), so a reward model that re-renders never shares."""
    rm = config.reward.reward_model
    share = rm.share_prompts
    if share is None:
        share = config.actor_rollout_ref.model.share_prompts and rm.use_remove_padding
    return dataclasses.replace(rm, share_prompts=bool(share))


def reward_problems(config: Config) -> list[str]:
    """Every problem of the ``reward`` section, each naming its dotted key."""
    r, problems = config.reward, []
    default_fn = RewardConfig.fn
    spec = r.function_spec
    if ":" not in spec and "." not in spec:
        problems.append(f"reward.fn={r.fn!r} must be 'package.module:function'")
    if r.custom_reward_function.path and r.fn != default_fn:
        problems.append(f"reward.custom_reward_function.path={r.custom_reward_function.path!r} and reward.fn={r.fn!r} "
                        "both name the reward function: set one")
    if r.reward_manager.name not in REWARD_MANAGERS:
        problems.append(f"reward.reward_manager.name={r.reward_manager.name!r} is not a reward manager rlpad has; "
                        f"choose one of {', '.join(REWARD_MANAGERS)} (a custom scorer: reward.fn)")
    if "overlong_buffer_cfg" in r.reward_kwargs or "max_resp_len" in r.reward_kwargs:
        problems.append("reward.reward_kwargs: verl's DAPO overlong_buffer_cfg / max_resp_len are "
                        "reward_model.overlong_buffer.{enable,len,penalty_factor} and data.max_response_length in rlpad")
    rm = r.reward_model
    if rm.enable and not rm.model_path:
        problems.append("reward.reward_model.enable=true needs reward.reward_model.model_path (a local folder)")
    if rm.dtype not in DTYPES:
        problems.append(f"reward.reward_model.dtype={rm.dtype!r} is not valid; choose one of {', '.join(DTYPES)}")
    if rm.attn_implementation not in ATTN_IMPLEMENTATIONS:
        problems.append(f"reward.reward_model.attn_implementation={rm.attn_implementation!r} is not valid; choose one "
                        f"of {', '.join(ATTN_IMPLEMENTATIONS)}")
    elif rm.attn_implementation == "sdpa" and rm.use_remove_padding:
        problems.append("reward.reward_model.attn_implementation=sdpa runs the padded path only; set "
                        "reward.reward_model.use_remove_padding=false or choose auto / rlpad_varlen / flash_attention_2")
    if rm.share_prompts and not rm.use_remove_padding:
        problems.append("reward.reward_model.share_prompts=true needs reward.reward_model.use_remove_padding=true "
                        "(the shared prompt lives in the packed row)")
    for key in ("micro_batch_size_per_gpu", "forward_max_token_len_per_gpu"):
        if getattr(rm, key) < 1:
            problems.append(f"reward.reward_model.{key}={getattr(rm, key)} must be >= 1")
    parts = part_names(r)
    for name, spec in r.extra_fns.items():
        if name in (RULE, MODEL, JUDGE):
            problems.append(f"reward.extra_fns.{name}: the names {RULE!r}, {MODEL!r} and {JUDGE!r} are taken; "
                            "pick another")
        elif ":" not in spec and "." not in spec:
            problems.append(f"reward.extra_fns.{name}={spec!r} must be 'package.module:function'")
    named = [(f"reward.weights.{k}", k) for k in r.weights] + [(f"reward.normalize[]={k}", k) for k in r.normalize]
    named += [(f"reward.source_weights.{src}.{k}", k) for src, ws in r.source_weights.items() for k in ws]
    for key, name in named:
        if name not in parts:
            problems.append(f"{key} names no reward part of this run; the parts are {', '.join(parts)}"
                            + (f" ({MODEL} needs reward.reward_model.enable=true)" if name == MODEL else "")
                            + (f" ({JUDGE} needs reward.judge.enable=true)" if name == JUDGE else ""))
    problems += judge_problems(r.judge)
    if r.clip is not None and not r.clip > 0:
        problems.append(f"reward.clip={r.clip} must be > 0 (or null: no clipping)")
    return problems
