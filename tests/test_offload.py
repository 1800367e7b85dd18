"""workers.offload: the actor's parameters and optimizer state leave the device and come back bit for bit;
the reference's and the critic's live in host memory between their calls (verl's fsdp_config keys)."""

import pytest
import torch

from rlpad.batch import WORKER_SECONDS
from rlpad.config.schema import ActorRolloutRefConfig, CriticConfig
from workers.actor import ActorWorker
from workers.critic import CriticWorker
from rlpad.embedded.synthetic import ppo_batch
from workers.offload import StateOffloader
from worker_state import snapshot
from paths import CACHE, recipe
from rlpad.recipe.load import load_config
from rlpad.train import fit
from run_compare import assert_same_metrics, compared_keys

P, R, VOCAB = 8, 10, 128


def make_actor() -> ActorWorker:
    cfg = ActorRolloutRefConfig()
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu = 8, 4
    cfg.actor.optim.lr, cfg.rollout.n = 1e-2, 1
    w = ActorWorker(cfg, device="cpu")
    w.init_model()
    return w


def test_offload_round_trip_is_bit_identical_and_training_continues_identically():
    actor = make_actor()
    batch = ppo_batch(8, P, R, vocab_size=VOCAB, seed=1)
    actor.update_actor(batch)  # optimizer state exists now
    before = snapshot(actor)
    off = StateOffloader(actor.root, actor.optimizer)
    moved = off.offload("params") + off.offload("optimizer")
    n_param_bytes = sum(p.to_local().numel() * p.element_size() for p in actor.root.parameters())
    assert moved >= 3 * n_param_bytes  # weights + AdamW's two moments
    # The device storages really are freed (on CPU too: the same code path as on CUDA).
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in actor.root.parameters())
    off.reload("params")
    off.reload("optimizer")
    after = snapshot(actor)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The next update equals that of an actor that never offloaded.
    twin = make_actor()
    twin.update_actor(batch)
    batch2 = ppo_batch(8, P, R, vocab_size=VOCAB, seed=2)
    m1, m2 = actor.update_actor(batch2), twin.update_actor(batch2)
    m1.pop(WORKER_SECONDS), m2.pop(WORKER_SECONDS)  # wall-clock seconds
    assert m1 == m2
    assert all(torch.equal(a, b) for a, b in zip(snapshot(actor).values(), snapshot(twin).values()))


def test_offload_twice_or_unknown_part_is_refused():
    actor = make_actor()
    off = StateOffloader(actor.root, actor.optimizer)
    off.offload("params")
    try:
        off.offload("params")
        raise AssertionError("second offload accepted")
    except RuntimeError as e:
        assert "already offloaded" in str(e)
    off.reload("params")
    try:
        off.offload("weights")
        raise AssertionError("unknown part accepted")
    except ValueError as e:
        assert "'params' or 'optimizer'" in str(e)


# ----------------------------------------------------------------------------- reference and critic (verl's keys)


def _nbytes(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()


def _stored_bytes(module) -> int:
    return sum(_nbytes(p) for p in module.parameters())


def _optimizer_bytes(optimizer) -> int:
    return sum(_nbytes(v) for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1)


def make_ref(param_offload: bool) -> ActorWorker:
    cfg = ActorRolloutRefConfig()
    cfg.ref.log_prob_micro_batch_size_per_gpu, cfg.rollout.n = 3, 1
    cfg.ref.fsdp_config.param_offload = param_offload
    w = ActorWorker(cfg, role="ref", device="cpu")
    w.init_model()
    return w


def make_critic(param_offload: bool, optimizer_offload: bool) -> CriticWorker:
    cfg = CriticConfig()
    cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu, cfg.optim.lr = 4, 3, 1e-2
    cfg.model.fsdp_config.param_offload, cfg.model.fsdp_config.optimizer_offload = param_offload, optimizer_offload
    w = CriticWorker(cfg, device="cpu")
    w.init_model()
    return w


def test_ref_param_offload_keeps_the_weights_off_the_device_between_calls():
    """``actor_rollout_ref.ref.fsdp_config.param_offload`` (verl's): the reference's parameters are freed
    on the device except while its log-probs run, and the log-probs are bit for bit those of a
    reference that keeps them."""
    resting, kept = make_ref(True), make_ref(False)
    assert _stored_bytes(resting.root) == 0 < _stored_bytes(kept.root)  # the negative control keeps them
    for seed in (1, 2):
        batch = ppo_batch(8, P, R, vocab_size=VOCAB, seed=seed)
        a, b = resting.compute_ref_log_prob(batch), kept.compute_ref_log_prob(batch)
        assert torch.equal(a["ref_log_probs"], b["ref_log_probs"])
        assert _stored_bytes(resting.root) == 0 < _stored_bytes(kept.root)


def test_critic_offload_keeps_its_state_off_the_device_between_calls(tmp_path):
    """``critic.model.fsdp_config.{param_offload, optimizer_offload}`` (verl's): parameters and AdamW
    moments are freed on the device between calls; values, updates and a checkpoint round trip equal a
    critic that keeps them, bit for bit."""
    resting, kept = make_critic(True, True), make_critic(False, False)
    for seed in (1, 2):
        batch = ppo_batch(8, P, R, vocab_size=VOCAB, seed=seed)
        assert torch.equal(resting.compute_values(batch)["values"], kept.compute_values(batch)["values"])
        m1, m2 = resting.update_critic(batch), kept.update_critic(batch)
        m1.pop(WORKER_SECONDS), m2.pop(WORKER_SECONDS)
        assert m1 == m2
        assert _stored_bytes(resting.root) == 0 and _optimizer_bytes(resting.optimizer) == 0
        assert _stored_bytes(kept.root) > 0 and _optimizer_bytes(kept.optimizer) > 0  # negative control
    resting.save_checkpoint(str(tmp_path / "ckpt"))
    fresh = make_critic(True, True)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert _stored_bytes(fresh.root) == 0 and _optimizer_bytes(fresh.optimizer) == 0
    batch = ppo_batch(8, P, R, vocab_size=VOCAB, seed=3)
    assert torch.equal(fresh.compute_values(batch)["values"], kept.compute_values(batch)["values"])
    m1, m2 = fresh.update_critic(batch), kept.update_critic(batch)
    m1.pop(WORKER_SECONDS), m2.pop(WORKER_SECONDS)
    assert m1 == m2


def test_critic_param_offload_alone_leaves_the_optimizer_state():
    critic = make_critic(True, False)
    critic.update_critic(ppo_batch(8, P, R, vocab_size=VOCAB, seed=1))
    assert _stored_bytes(critic.root) == 0 and _optimizer_bytes(critic.optimizer) > 0


@pytest.mark.ray
@pytest.mark.exactness
def test_ref_and_critic_offload_on_the_ray_stack_train_as_without(tmp_path):
    """PPO with a KL loss on Ray (reference and critic as Ray actors, offloaded between calls) against the
    local stack without offload: the same metrics (two stacks: rounding only, tests/run_compare.py)."""

    def train(out: str, *overrides: str) -> dict[int, dict]:
        history = fit(load_config(recipe("ppo_tiny"), [
            f"trainer.default_local_dir={out}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
            "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2", "data.val_files=[]",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.use_kl_loss=true", *overrides]))
        return {r["step"]: r for r in history}

    ray_ = train(str(tmp_path / "ray"), "trainer.backend=ray", "actor_rollout_ref.ref.fsdp_config.param_offload=true",
                 "critic.model.fsdp_config.param_offload=true", "critic.model.fsdp_config.optimizer_offload=true")
    local = train(str(tmp_path / "local"), "trainer.backend=local")
    for step in (1, 2):
        assert {"actor/kl_loss", "critic/vf_loss", "critic/grad_norm"} <= set(compared_keys(local[step], ray_[step]))
    assert assert_same_metrics(local, ray_, steps=(1, 2)) > 20
