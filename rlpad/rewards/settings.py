"""The reward section's rules, torch-free (the config checks import them): the names of the reward
parts, each part's weight per data source (:func:`part_weight`, the one rule), :func:`reward_problems`,
every check of ``reward.*`` and its verl names, one line each, and the notices a run starts with."""

from __future__ import annotations

import dataclasses

from rlpad.config.choices import ATTN_IMPLEMENTATIONS, DTYPES, REWARD_MANAGERS
from rlpad.config.rewards import RewardConfig, RewardModelScoringConfig
from rlpad.config.schema import Config
from rlpad.rewards.judge_rules import judge_problems

__all__ = ["JUDGE", "MODEL", "PART_FLAGS", "RULE", "function_named", "part_names", "part_weight", "reward_model_section",
           "reward_notices", "reward_problems", "rule_may_weigh_zero"]

RULE = "rule"  # the part scored by the reward function (reward.fn / reward.custom_reward_function)
MODEL = "reward_model"  # the part scored by reward.reward_model
JUDGE = "judge"  # the part scored by reward.judge (a generative judge: rlpad.rewards.judge)
# a part's per-row 0/1 flags, logged as fractions reward/<part>/<flag> (rlpad.rewards.combine)
PART_FLAGS = {
    MODEL: ("truncated",),  # the conversation was longer than the reward model's limit: its start dropped
    JUDGE: ("unparsable", "timeout", "overlong"),  # rlpad.rewards.judge
}


def part_names(reward: RewardConfig) -> list[str]:
    """The reward parts a run computes, in order: the rule, the reward model and the judge when enabled,
    then ``reward.extra_fns``."""
    return ([RULE] + ([MODEL] if reward.reward_model.enable else []) + ([JUDGE] if reward.judge.enable else [])
            + list(reward.extra_fns))


def function_named(reward: RewardConfig) -> bool:
    """The run names its reward function (``reward.fn`` other than the default, or
    ``reward.custom_reward_function.path``)."""
    return reward.custom_reward_function.path is not None or reward.fn != RewardConfig.fn


def part_weight(reward: RewardConfig, part: str, data_source: str) -> float:
    """The weight of ``part`` for a response of ``data_source``: ``reward.source_weights[source][part]``, else
    ``reward.weights[part]``, else 1, except the rule's default when a reward model is enabled and no reward
    function is named: 0 (verl 0.9's meaning: the reward model's score alone is the reward)."""
    per_source = reward.source_weights.get(str(data_source), {})
    return float(per_source[part]) if part in per_source else _base_weight(reward, part)


def _base_weight(reward: RewardConfig, part: str) -> float:
    """``part``'s weight for a data source ``reward.source_weights`` does not list."""
    if part in reward.weights:
        return float(reward.weights[part])
    return 0.0 if part == RULE and reward.reward_model.enable and not function_named(reward) else 1.0


def rule_may_weigh_zero(reward: RewardConfig) -> bool:
    """The rule part weighs 0 for some data source (it is then not computed for those rows in training)."""
    return _base_weight(reward, RULE) == 0 or any(float(ws[RULE]) == 0 for ws in reward.source_weights.values()
                                                   if RULE in ws)


def reward_model_section(config: Config) -> RewardModelScoringConfig:
    """``reward.reward_model`` as its workers run it: ``share_prompts`` null resolved to
    ``actor_rollout_ref.model.share_prompts`` (off when the reward model runs the padded batch). The
    workers share a batch in the rollout layout (rlpad.rewards.model_scorer ships ``responses`` when every
    row's rendering splits at its prompt's end: rlpad.rewards.conversation)."""
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
    fg = config.algorithm.filter_groups
    if fg.enable and fg.metric == "acc" and rule_may_weigh_zero(r):
        why = ("reward.reward_model.enable=true with no reward function named: the reward model's score alone, as "
               "in verl 0.9" if RULE not in r.weights and _base_weight(r, RULE) == 0
               else "a weight of 0 in reward.weights or reward.source_weights")
        problems.append(f"algorithm.filter_groups.metric=acc reads the rule part's acc, but the rule is not trained on "
                        f"({why}) and not computed for those rows; filter on metric=score (the trained reward) or "
                        "give the rule a weight")
    return problems


def reward_notices(reward: RewardConfig) -> list[str]:
    """The line a run with a reward model starts with (rlpad.train.prepare): what its reward is, as verl 0.9 would
    have it (the reward model alone), or how it differs (a function named: both summed); none when
    ``reward.weights`` sets the rule's weight with no function named (the user chose)."""
    if not reward.reward_model.enable:
        return []
    if not function_named(reward):
        if RULE in reward.weights:
            return []
        return ["rlpad: the reward is the reward model's score alone (reward.reward_model.enable=true and no reward "
                "function named, as in verl 0.9: reward.weights.rule defaults to 0 and the rule is not computed in "
                "training; validation still reports it as val/reward/rule/mean where it knows the data source)"]
    return [f"rlpad: the reward is the sum of the reward function ({reward.function_spec}) and the reward model, "
            "weighted by reward.weights (default 1 each); verl 0.9 would use the function alone and serve the reward "
            "model for the function to call"]
