"""A run with a reward model and the rule combined, on the local stack and on Ray (the reward model's
own FSDP2 worker group): every part in the metrics, the logged reward their weighted sum."""

import json
import math
import os

import pytest

from rlpad.embedded.tiny import build_tokenizer, tiny_reward_model
from rlpad.recipe.load import load_config
from rlpad.train import run
from paths import CACHE, recipe


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_reward_model_and_rule_both_logged_on_a_run(tmp_path, backend):
    rm_dir = tmp_path / "rm"
    tiny_reward_model("qwen2", seed=4).save_pretrained(rm_dir)
    build_tokenizer(rm_dir)  # the policy's tokenizer: the rollout's own rows are scored
    out = tmp_path / "run"
    run(load_config(recipe("grpo_tiny"), [
        f"trainer.default_local_dir={out}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        f"trainer.backend={backend}", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
        "trainer.test_freq=-1", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4", "data.val_batch_size=32",
        "reward.reward_model.enable=true", f"reward.reward_model.model_path={rm_dir}",
        "reward.weights={rule: 1.0, reward_model: 0.5}",
    ]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = {r["step"]: r for r in map(json.loads, f)}
    for step in (1, 2):
        r = records[step]
        assert {"reward/rule/mean", "reward/reward_model/mean"} <= set(r)
        # the logged reward is the weighted sum of the logged parts (weights do not depend on the source)
        assert math.isclose(r["reward/mean"], r["reward/rule/mean"] + 0.5 * r["reward/reward_model/mean"],
                            rel_tol=0, abs_tol=1e-5)
        assert r["reward/reward_model/mean"] != 0.0
    for step in (0, 2):
        assert {"val/reward/rule/mean", "val/reward/reward_model/mean"} <= set(records[step])
    if backend == "ray":
        with open(os.path.join(out, "workers.json")) as f:
            assert len(json.load(f)["reward_model"]) == 1  # its own group, one rank


def test_reward_model_shares_prompts_on_a_run(tmp_path):
    """The local stack with actor_rollout_ref.model.share_prompts=true: the reward model follows it
    (reward.reward_model.share_prompts null, the policy's own rows) and scores the first step's
    rollout (the same responses: same seed, same initial policy) as the plain packed row does."""
    rm_dir = tmp_path / "rm"
    tiny_reward_model("qwen2", seed=4).save_pretrained(rm_dir)
    build_tokenizer(rm_dir)
    parts = {}
    for share in ("true", "false"):
        out = tmp_path / f"run-{share}"
        run(load_config(recipe("grpo_tiny"), [
            f"trainer.default_local_dir={out}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
            "trainer.backend=local", "trainer.total_training_steps=1", "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4",
            f"actor_rollout_ref.model.share_prompts={share}",
            "reward.reward_model.enable=true", f"reward.reward_model.model_path={rm_dir}",
        ]))
        with open(os.path.join(out, "metrics.jsonl")) as f:
            parts[share] = {r["step"]: r for r in map(json.loads, f)}[1]["reward/reward_model/mean"]
    assert parts["true"] != 0.0
    assert math.isclose(parts["true"], parts["false"], rel_tol=0, abs_tol=1e-5), parts
