"""FSDP2 on nccl (world 1, ``cpu:gloo,cuda:nccl``): the actor's compute_log_prob and update_actor on
CUDA against the same worker on the CPU, in fp32 (the exact fallback: equal to 2e-5 / 1e-4) and in
bf16 (the varlen kernel: log-probs within the bf16 bounds of the fp32 oracle, update gradients within
the gradient bounds of the CPU bf16 worker's); then the offload round trip on CUDA: the device
memory is given back and the state returns bit for bit.
"""

import pytest
import torch
import torch.distributed as dist

from rlpad.batch import Batch
from rlpad.config.schema import ActorRolloutRefConfig
from rlpad.embedded.exactness import BF16_BOUNDS, PathResult, errors, oracle, violations
from rlpad.embedded.tiny import tiny_model
from workers.actor import ActorWorker

from rlpad.embedded.synthetic import ppo_batch
from worker_state import snapshot

P, R, VOCAB = 24, 40, 128  # tiny:qwen2: vocab 128, GQA, 2 layers, random weights of seed 0
GRAD_BOUNDS = {k: BF16_BOUNDS[k] for k in ("grad_rel", "grad_cos_min")}


def actor_config(dtype: str) -> ActorRolloutRefConfig:
    cfg = ActorRolloutRefConfig()
    cfg.model.dtype = dtype
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu = 8, 4
    cfg.actor.optim.lr, cfg.rollout.n = 1e-2, 1
    cfg.actor.fsdp_config.param_offload = cfg.actor.fsdp_config.optimizer_offload = True
    return cfg


@pytest.fixture(scope="module")
def workers():
    """(device, dtype) -> an initialised actor; the first creates the world-1 group, the others join it."""
    out = {}
    for device, dtype in (("cuda", "float32"), ("cpu", "float32"), ("cuda", "bfloat16"), ("cpu", "bfloat16")):
        out[device, dtype] = ActorWorker(actor_config(dtype), device=device)
        out[device, dtype].init_model()
    yield out
    out["cuda", "float32"].shutdown()  # the group, for the next module's workers


@pytest.fixture(scope="module")
def batch() -> Batch:
    return ppo_batch(8, P, R, vocab_size=VOCAB, seed=1)


def grad_errors(got: dict, ref: dict) -> dict[str, float]:
    zero = torch.zeros(1, 1, dtype=torch.float64)
    as_result = lambda g: PathResult(zero, zero, {k: v.float().cpu() for k, v in g.items()})  # noqa: E731
    errs = errors(as_result(got), as_result(ref), torch.ones(1, 1))
    return {k: errs[k] for k in GRAD_BOUNDS}


def test_fsdp2_nccl_fp32_equals_the_cpu_worker(workers, batch, record):
    cuda, cpu = workers["cuda", "float32"], workers["cpu", "float32"]
    backend = dist.get_backend()
    lp_cuda, lp_cpu = (w.compute_log_prob(batch)["old_log_probs"].cpu() for w in (cuda, cpu))
    lp_diff = float((lp_cuda - lp_cpu).abs().max())
    m_cuda, m_cpu = (w.update_actor(batch, return_grads=True) for w in (cuda, cpu))
    grads = grad_errors(m_cuda["grads"], m_cpu["grads"])
    pg = (m_cuda["actor/pg_loss"], m_cpu["actor/pg_loss"])
    record(backend=str(backend), device=str(cuda.device), log_prob_max_diff=lp_diff, grads=grads, pg_loss=pg)
    assert "nccl" in str(backend) and cuda.device.type == "cuda"
    assert lp_diff <= 2e-5
    assert grads["grad_rel"] <= 1e-4, grads
    assert pg[0] == pytest.approx(pg[1], rel=1e-5, abs=1e-7)


def test_fsdp2_nccl_bf16_within_the_bounds(workers, batch, record):
    cuda, cpu = workers["cuda", "bfloat16"], workers["cpu", "bfloat16"]
    model32 = tiny_model("qwen2", vocab_size=VOCAB, seed=0, dtype=torch.bfloat16, attn_implementation="sdpa").float()
    rows = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    ref = oracle(model32, rows, R, backward=False)
    out = cuda.compute_log_prob(batch)
    got = PathResult(out["old_log_probs"].double().cpu(), out["entropy"].double().cpu(), None)
    lp = errors(got, ref, batch["response_mask"])
    m_cuda, m_cpu = (w.update_actor(batch, return_grads=True) for w in (cuda, cpu))
    finite = all(torch.isfinite(g).all() for g in m_cuda["grads"].values())
    grads = grad_errors(m_cuda["grads"], m_cpu["grads"])
    record(log_probs_vs_oracle=lp, update_grads_vs_cpu_bf16=grads, grads_finite=bool(finite))
    assert finite, "NaN/inf gradients from the CUDA update"
    assert not violations(lp), violations(lp)
    assert not violations(grads, GRAD_BOUNDS), violations(grads, GRAD_BOUNDS)


def test_offload_round_trip_on_cuda(workers, batch, record):
    actor = workers["cuda", "float32"]
    actor.update_actor(batch)  # optimizer state exists
    before = snapshot(actor)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = actor.offload_state()
    freed = held - torch.cuda.memory_allocated()
    actor.reload_state()
    after = snapshot(actor)
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    metrics = actor.update_actor(batch)
    record(bytes_moved=moved, device_bytes_freed=freed, bit_identical=same, pg_loss_after=metrics["actor/pg_loss"])
    assert moved > 0 and freed >= 0.9 * moved, (moved, freed)
    assert same
    assert all(v == v for v in metrics.values() if isinstance(v, float))  # no NaN after the round trip
