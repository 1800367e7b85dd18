"""On-policy distillation through the trainer on both stacks: the teacher worker group wired into the
step, the single-process stack (trainer.backend=local) and the Ray stack (a 2-rank actor, a 2-rank
teacher colocated in the actor's pool, real FSDP2) give the same metrics for the same seeds; the
teacher's term is in them (negative control: another teacher changes the run)."""

import json
import os

import pytest

from paths import CACHE, recipe
from rlpad.recipe.load import load_config
from rlpad.train import run
from run_compare import assert_same_metrics

pytestmark = [pytest.mark.ray, pytest.mark.exactness]

STEPS = 2


def records(out_dir: str) -> dict[int, dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def train(out_dir: str, backend: str, *overrides: str) -> dict[int, dict]:
    run(load_config(recipe("grpo_tiny"), [
        f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        f"trainer.backend={backend}", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
        "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.name=hf", "trainer.seed=3",
        "distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=tiny:llama",
        "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8",
        "distillation.distillation_loss.use_policy_gradient=false", "distillation.distillation_loss.use_task_rewards=true",
        "distillation.distillation_loss.distillation_loss_coef=0.5", *overrides,
    ]))
    return records(out_dir)


def test_distillation_trains_alike_on_the_local_and_the_ray_stack(tmp_path):
    local = train(str(tmp_path / "local"), "local")
    ray_ = train(str(tmp_path / "ray"), "ray")
    assert sorted(local) == sorted(ray_) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        assert {"actor/distill/kl_mean", "actor/distill/teacher_topk_mass", "actor/distill/loss",
                "timing_s/teacher"} <= set(local[step])
        assert local[step]["actor/distill/kl_mean"] > 0
    assert assert_same_metrics(local, ray_, steps=tuple(range(1, STEPS + 1))) > 40
    with open(os.path.join(tmp_path, "ray", "workers.json")) as f:
        assert len(json.load(f)["teacher"]) == 2  # the teacher's own 2-rank group, in the actor's pool
    # negative control: another teacher (qwen3) moves the distillation metrics beyond the bounds
    other = train(str(tmp_path / "other"), "local", "distillation.teacher_models.teacher_model.model_path=tiny:qwen3")
    with pytest.raises(AssertionError, match="step 1: "):
        assert_same_metrics(local, other, steps=(1,))
