"""async_training.* (rlpad/config/streaming.py): each bad value and each unsupported combination is one line at
config load naming the key; the base streaming config has no other problem."""

from __future__ import annotations

import re

import pytest

from rlpad.config.streaming import LOOP_BUILT, window_groups
from rlpad.recipe.load import load_config

BASE = ["async_training.enable=true", "trainer.colocate=false", "trainer.backend=ray",
        "algorithm.rollout_correction.mode=token_tis"]


def problems(overrides: list[str]) -> list[str]:
    """The config's problem lines, less the one saying the loop is not built (while it is not)."""
    try:
        load_config(None, overrides)
    except ValueError as e:
        lines = str(e).splitlines()[1:]
    else:
        return []
    return [line.strip() for line in lines if LOOP_BUILT or "streaming loop on the engines is not built" not in line]


def test_the_base_streaming_config_has_no_other_problem():
    assert problems(BASE) == []
    if not LOOP_BUILT:  # refused as a whole, in one line, until the loop exists
        with pytest.raises(ValueError, match="async_training.enable=true: the streaming loop"):
            load_config(None, BASE)
    assert problems([]) == []  # streaming off: nothing asked of the rest


@pytest.mark.parametrize("override, wanted", [
    ("async_training.staleness_threshold=-0.5", "async_training.staleness_threshold=-0.5 must be a finite number >= 0"),
    ("async_training.staleness_threshold=inf", "async_training.staleness_threshold=inf must be a finite number >= 0"),
    ("async_training.trigger_parameter_sync_step=0", "async_training.trigger_parameter_sync_step=0 must be >= 1"),
    ("async_training.require_batches=0", "async_training.require_batches=0 must be >= 1"),
    ("async_training.concurrent_samples_per_replica=3", "async_training.concurrent_samples_per_replica=3 must be >= "
                                                        "actor_rollout_ref.rollout.n=4: a group's responses run on one engine"),
    ("trainer.max_off_policy_steps=1", "trainer.max_off_policy_steps=1 and async_training.enable=true are two"),
    ("algorithm.rollout_correction.mode=none", "set algorithm.rollout_correction.mode to token_tis or seq_mask"),
    ("trainer.colocate=true", "needs the separate layout (engines generate while the actor trains): set trainer.colocate=false"),
    ("trainer.colocate=null", "set trainer.colocate=false, got None"),
    ("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.name=hf has no asynchronous engine"),
    ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_rank=4 is not supported with async_training"),
    ("algorithm.adv_estimator=gae trainer.critic_warmup=3",
     "trainer.critic_warmup=3 is not supported with async_training.enable=true: a step without an actor update"),
    ("reward.judge.enable=true", "reward.judge.enable=true is not supported with async_training"),
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "multi_turn.enable=true is not supported with async_training"),
    ("distillation.enabled=true", "distillation.enabled=true is not supported with async_training"),
    ("data.val_files=[toy:val] trainer.test_freq=3 async_training.trigger_parameter_sync_step=2",
     "trainer.test_freq=3 is not supported with async_training.enable=true: validation runs on the weights a load"),
    ("trainer.save_freq=5", "trainer.save_freq=5 is not supported with async_training.enable=true: a checkpoint of "
                            "the buffer and the in-flight partial responses needs the round schedule: set "
                            "async_training.deterministic=true"),
    ("async_training.deterministic=true trainer.save_freq=3 async_training.trigger_parameter_sync_step=2",
     "trainer.save_freq=3 is not supported with async_training.enable=true: the stream's state is saved at a weight "
     "load: it must be a multiple of async_training.trigger_parameter_sync_step=2"),
    ("async_training.deterministic=true trainer.save_freq=2 reward.normalize=[rule]",
     "reward.normalize=['rule'] is not supported with async_training.enable=true: a resume rescores"),
    ("async_training.deterministic=true async_training.round_tokens=0", "async_training.round_tokens=0 must be >= 1"),
    ("data.train_batch_size=32", "data.train_batch_size=32 must equal async_training.require_batches x "
                                 "actor_rollout_ref.actor.ppo_mini_batch_size = 16"),
])
def test_each_refusal_is_one_line_naming_the_key(override, wanted):
    got = problems(BASE + override.split())
    mine = [line for line in got if wanted in line]
    assert len(mine) == 1, got
    assert re.match(r"[a-z_]+(\.[a-z_]+)+[= ]", mine[0]), mine  # it opens with the dotted key


def test_checkpoints_are_served_by_the_deterministic_stream():
    """Issue 60 item 5 (tests/test_streaming_train.py saves and resumes one)."""
    assert problems(BASE + ["async_training.deterministic=true", "trainer.save_freq=2",
                            "async_training.trigger_parameter_sync_step=2", "async_training.round_tokens=1"]) == []


def test_local_backend_is_refused_by_streaming_too():
    got = problems(BASE + ["trainer.backend=local"])
    assert "async_training.enable=true needs trainer.backend=ray (engines in processes of their own), got local" in got


def test_the_critic_the_group_filter_and_the_reward_model_are_served():
    """Streamed since issue 60 item 6 (tests/test_streaming_train.py runs them): no refusal left."""
    assert problems(BASE + ["algorithm.adv_estimator=gae", "trainer.critic_warmup=1",
                            "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                            "reward.reward_model.enable=true",
                            "reward.reward_model.model_path=/nowhere"]) == []


def test_vllm_temperature_above_its_bound_is_refused():
    """vLLM's SamplingParams refuses a temperature above 2 at the first request: refused at config load instead."""
    for key in ("temperature", "val_kwargs.temperature"):
        got = problems([f"actor_rollout_ref.rollout.{key}=2.5"])
        assert got == [f"actor_rollout_ref.rollout.{key}=2.5 must be <= 2.0 with actor_rollout_ref.rollout.name=vllm "
                       "(vLLM's SamplingParams bound)"], got
        assert problems([f"actor_rollout_ref.rollout.{key}=2.0"]) == []
        assert problems([f"actor_rollout_ref.rollout.{key}=2.5", "actor_rollout_ref.rollout.name=hf"]) == []


def test_the_hard_cap_must_admit_a_whole_window():
    got = problems(BASE + ["async_training.trigger_parameter_sync_step=4", "async_training.max_staleness=2"])
    assert got == ["async_training.max_staleness=2 must be >= trigger_parameter_sync_step - 1 = 3: the last step "
                   "between two weight loads trains groups that many updates old, so every such group would be dropped"]
    assert problems(BASE + ["async_training.trigger_parameter_sync_step=4", "async_training.max_staleness=3"]) == []


def test_require_batches_sets_the_step_and_the_window():
    over = BASE + ["async_training.require_batches=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                   "data.train_batch_size=8", "async_training.trigger_parameter_sync_step=3"]
    assert problems(over) == []
    config = load_config(None, [o for o in over if not o.startswith("async_training.enable")])
    assert window_groups(config) == 24  # 3 steps x 8 groups between two weight loads
