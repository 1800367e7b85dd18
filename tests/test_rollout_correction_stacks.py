"""Rollout correction reaches the actor's loss on both stacks (real Ray workers, real FSDP2, HF rollout).

The rollout engine runs in bf16 against the fp32 actor, so rollout and actor log-probs really
differ, and the cap C = 1.01 is close to 1, so ``token_tis`` reweights (and clips) most tokens and
``seq_mask`` drops sequences. What this catches, that the driver-side metrics
(``rollout_corr/*``, the reward) cannot:

* a correction computed by the trainer but lost on its way into the actor's loss (the Ray worker
  group once shipped only a hand-kept key list without ``rollout_is_weights``, so ``token_tis``
  trained uncorrected on Ray): the 2-rank Ray actor's ``pg_loss`` must move against ``mode=none``
  on the same step, same samples;
* the two stacks training differently on the same seeds (the local stack passed whole batches):
  1-rank Ray and ``trainer.backend=local`` must give the same step metrics with the correction on.
"""

import json
import os

import pytest
from paths import CACHE, recipe

ray = pytest.importorskip("ray")

from rlpad.recipe.load import load_config  # noqa: E402
from rlpad.train import run  # noqa: E402
from run_compare import assert_same_metrics, compared_keys  # noqa: E402

pytestmark = pytest.mark.ray

GRPO = recipe("grpo_tiny")
CAP = 1.01


@pytest.fixture(scope="module")
def ray_session():
    """One Ray for every run of the module (launch_workers joins it instead of starting its own)."""
    ray.init(address="local", num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def train(out_dir: str, backend: str, ranks: int, mode: str, steps: int) -> dict[int, dict]:
    """GRPO steps of the tiny recipe (32 responses, 2 mini-batches each); the per-step metric records."""
    run(load_config(GRPO, [
        f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        f"trainer.backend={backend}", f"trainer.n_gpus_per_node={ranks}", f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "data.val_files=[]", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.dtype=bfloat16", f"algorithm.rollout_correction.mode={mode}",
        f"algorithm.rollout_correction.threshold={CAP}",
    ]))
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def uncorrected(ray_session, tmp_path_factory):
    return train(str(tmp_path_factory.mktemp("none")), "ray", 2, "none", steps=1)


@pytest.mark.parametrize("mode, acted", [("token_tis", "rollout_corr/clipped_token_frac"),
                                         ("seq_mask", "rollout_corr/masked_seq_frac")])
def test_correction_changes_the_actor_loss_and_both_stacks_agree(ray_session, uncorrected, tmp_path, mode, acted):
    corrected = train(str(tmp_path / "ray2"), "ray", 2, mode, steps=1)
    first, base = corrected[1], uncorrected[1]
    # Same weights, seeds and samples at step 1: only the correction can move the loss.
    assert first["reward/mean"] == base["reward/mean"] and first["mismatch/abs_diff_mean"] > 1e-4
    assert 0 < first[acted] < 1
    assert abs(first["actor/pg_loss"] - base["actor/pg_loss"]) > 1e-4 * max(abs(base["actor/pg_loss"]), 1e-3), (
        first["actor/pg_loss"], base["actor/pg_loss"])

    # Two steps: the second samples with the weights the corrected update pushed to the engine.
    local = train(str(tmp_path / "local"), "local", 1, mode, steps=2)
    ray1 = train(str(tmp_path / "ray1"), "ray", 1, mode, steps=2)
    assert sorted(local) == sorted(ray1) == [1, 2]
    for step in (1, 2):
        assert sorted(local[step]) == sorted(ray1[step])
        assert {"actor/pg_loss", "actor/grad_norm", acted} <= set(compared_keys(local[step], ray1[step]))
    assert_same_metrics(local, ray1)  # tests/run_compare.py
