"""A short run with the generative judge combined with the rule reward: its vLLM engine in this process
beside the in-process vLLM rollout engine (local stack), or as Ray actors (two replicas, a batch split
between them); every part and the judge's flags in the metrics, the logged reward their weighted sum."""

import json
import math
import os

import pytest

from rlpad.recipe.load import load_config
from rlpad.train import run
from paths import CACHE, recipe

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("backend, rollout, replicas", [
    ("local", "vllm", 1), pytest.param("ray", "hf", 2, marks=pytest.mark.ray)])
def test_judge_and_rule_combined_on_a_run(tmp_path, backend, rollout, replicas):
    out = tmp_path / "run"
    run(load_config(recipe("grpo_tiny"), [
        f"trainer.default_local_dir={out}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        f"trainer.backend={backend}", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
        "trainer.test_freq=2", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        f"actor_rollout_ref.rollout.name={rollout}", "actor_rollout_ref.rollout.cpu_kv_cache_gb=0.1",
        "actor_rollout_ref.rollout.n=4", "data.val_batch_size=16",
        # the judge: the embedded warm-started policy, which completes sums: asked "<response>+0=" it writes a
        # number (the verdict, /100), or not when the response is no number (unparsable)
        "reward.judge.enable=true", "reward.judge.model_path=embedded:toy",
        "reward.judge.prompt_template={response}+0=", "reward.judge.score_pattern=(\\d+)",
        "reward.judge.score_max=100", "reward.judge.default_score=-0.5", "reward.judge.rollout.response_length=8",
        "reward.judge.rollout.cpu_kv_cache_gb=0.1", f"reward.judge.rollout.num_replicas={replicas}",
        "reward.weights={rule: 1.0, judge: 0.5}",
    ]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = {r["step"]: r for r in map(json.loads, f)}
    for step in (1, 2):
        r = records[step]
        assert {"reward/rule/mean", "reward/judge/mean", "reward/judge/unparsable", "reward/judge/timeout",
                "reward/judge/overlong"} <= set(r)
        # the logged reward is the weighted sum of the logged parts (weights do not depend on the source)
        assert math.isclose(r["reward/mean"], r["reward/rule/mean"] + 0.5 * r["reward/judge/mean"],
                            rel_tol=0, abs_tol=1e-5)
        assert 0.0 <= r["reward/judge/unparsable"] <= 1.0 and r["reward/judge/timeout"] == 0.0
        # each row scores its verdict (in [0, 1]) or, unparsable, -0.5: the mean is bounded accordingly
        u = r["reward/judge/unparsable"]
        assert -0.5 * u - 1e-6 <= r["reward/judge/mean"] <= -0.5 * u + (1 - u) + 1e-6
    # the judge's verdicts really were parsed (not every row the default score)
    assert min(records[s]["reward/judge/unparsable"] for s in (1, 2)) < 1.0
    print({k: v for k, v in records[1].items() if k.startswith("reward/")})  # noqa: T201
    for step in (0, 2):
        assert {"val/reward/rule/mean", "val/reward/judge/mean", "val/reward/judge/unparsable"} <= set(records[step])
