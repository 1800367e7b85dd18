"""workers.offload: the actor's parameters and optimizer state leave the device and come back bit for bit."""

import torch

from rlpad.batch import WORKER_SECONDS
from rlpad.config.schema import ActorRolloutRefConfig
from workers.actor import ActorWorker
from rlpad.embedded.synthetic import ppo_batch
from workers.offload import StateOffloader
from worker_state import snapshot

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
