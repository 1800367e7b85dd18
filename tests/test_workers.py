"""Worker groups on a real local Ray (127.0.0.1) with real FSDP2 over gloo: log-probs vs the
single-process forward, gradient equivalence across micro-batching / token budget / world size,
checkpoint resume, and a dead rank reported by role and rank.

A worker reads its config once, so each layout is a group of its own: ``rows_group`` (row
micro-batches, token-mean), ``budgets_group`` (token budgets, shuffled mini-batches,
seq-mean-token-mean) and ``padded_ref_group`` (the padded path, reference role).
"""

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from run_compare import RUN_ABS, RUN_REL  # noqa: E402
from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL  # noqa: E402
from rlpad.batch import WORKER_SECONDS, Batch  # noqa: E402
from rlpad.config.schema import ActorRolloutRefConfig  # noqa: E402
from rlpad.core.forward import compute_log_probs  # noqa: E402
from rlpad.core.models import load_causal_lm  # noqa: E402
from rlpad.batching.balance import count_micro_batches  # noqa: E402
from workers.actor import ActorWorker  # noqa: E402
from rlpad.embedded.synthetic import ppo_batch  # noqa: E402
from workers.group import WorkerGroup  # noqa: E402

pytestmark = pytest.mark.ray

P, R, VOCAB = 8, 12, 128
MINI = 16  # rows of a mini-batch (all ranks)
BUDGET = 40  # tokens per micro-batch: several micro-batches per rank at every world size


def config(overrides: dict | None = None) -> ActorRolloutRefConfig:
    """The test config, then ``{"section.field": value}`` overrides."""
    cfg = ActorRolloutRefConfig()
    a = cfg.actor
    a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu = MINI, 4, BUDGET
    a.use_kl_loss, a.kl_loss_coef, a.entropy_coeff, a.optim.lr = True, 0.1, 0.01, 1e-2
    cfg.rollout.log_prob_micro_batch_size_per_gpu, cfg.rollout.n = 2, 1
    cfg.ref.log_prob_micro_batch_size_per_gpu = 3
    for dotted, value in (overrides or {}).items():
        section, field = dotted.split(".")
        assert hasattr(getattr(cfg, section), field), dotted
        setattr(getattr(cfg, section), field, value)
    return cfg


# The two update layouts of the 2-rank groups (16-row mini-batches): log-prob micro-batches of 1 row
# and update micro-batches of 3 rows; or token budgets on both sides (log-prob P + R = 20 tokens:
# a row or two per piece; update 60), shuffled mini-batches.
LAYOUTS = {
    "rows": {"rollout.log_prob_micro_batch_size_per_gpu": 1, "actor.ppo_micro_batch_size_per_gpu": 3,
             "actor.use_dynamic_bsz": False, "actor.shuffle": False, "actor.loss_agg_mode": "token-mean"},
    "budgets": {"rollout.log_prob_use_dynamic_bsz": True, "rollout.log_prob_max_token_len_per_gpu": P + R,
                "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 3 * (P + R), "actor.shuffle": True,
                "actor.loss_agg_mode": "seq-mean-token-mean"},
}


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=6, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def rows_group(ray_session):
    group = WorkerGroup(ActorWorker, config(LAYOUTS["rows"]), role="actor", world_size=2, device="cpu")
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def budgets_group(ray_session):
    group = WorkerGroup(ActorWorker, config(LAYOUTS["budgets"]), role="actor", world_size=2, device="cpu")
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def padded_ref_group(ray_session):
    group = WorkerGroup(ActorWorker, config({"model.use_remove_padding": False}), role="ref", world_size=2, device="cpu")
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def initial_checkpoint(rows_group, tmp_path_factory):
    """The initial weights (every group starts from the same tiny:qwen2 weights)."""
    path = str(tmp_path_factory.mktemp("ckpt") / "initial")
    rows_group.call("save_checkpoint", path)
    return path


def reference_log_probs(state: dict, batch: Batch, rmpad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model = load_causal_lm("tiny:qwen2")
    model.load_state_dict(state)
    with torch.no_grad():
        return compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], R,
                                 use_remove_padding=rmpad, calculate_entropy=True)  # fmt: skip


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_group_log_prob_matches_single_process(request, initial_checkpoint, rmpad):
    # 9 rows over 2 ranks (5 + 4): with 1-row (rows_group) or 2-row (padded_ref_group) micro-batches
    # rank 1 runs a dummy piece.
    group = request.getfixturevalue("rows_group" if rmpad else "padded_ref_group")
    batch = ppo_batch(9, P, R, vocab_size=VOCAB, seed=5)
    batch["uid"] = np.arange(9)
    out = group.call_batch("compute_log_prob", batch)
    ref_lp, ref_ent = reference_log_probs(group.call("full_state_dict")[0], batch, rmpad)
    assert out["old_log_probs"].shape == (9, R)
    assert (out["old_log_probs"] - ref_lp).abs().max() <= FP32_LOGPROB_TOL
    assert (out["entropy"] - ref_ent).abs().max() <= FP32_LOGPROB_TOL


def run_update(worker_or_group, batch: Batch) -> dict:
    """The update's metrics without the worker's own seconds (timing, not a result)."""
    if isinstance(worker_or_group, WorkerGroup):
        out = worker_or_group.call_batch("update_actor", batch, chunk_rows=MINI, return_grads=True)
    else:
        out = worker_or_group.update_actor(batch, return_grads=True)
    assert out.pop(WORKER_SECONDS) > 0
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradient_equivalence_across_micro_batches_budget_and_world_size(request, initial_checkpoint, layout):
    """One mini-batch of 16 rows: world 1 in 8 row micro-batches or by a 40-token budget, world 2
    in the group's layout (3-row micro-batches, or 60-token budgets after shuffling), same gradients."""
    group = request.getfixturevalue(f"{layout}_group")
    mode = LAYOUTS[layout]["actor.loss_agg_mode"]
    batch = ppo_batch(MINI, P, R, vocab_size=VOCAB, seed=11)
    lengths = batch["attention_mask"].sum(-1)
    assert count_micro_batches(lengths.tolist(), BUDGET) >= 3  # world 1: several budget micro-batches
    by_rows = {"actor.use_dynamic_bsz": False, "actor.ppo_micro_batch_size_per_gpu": 2, "actor.loss_agg_mode": mode}
    by_budget = {"actor.use_dynamic_bsz": True, "actor.loss_agg_mode": mode}
    runs = {}
    for name, overrides in (("w1_8micro", by_rows), ("w1_budget", by_budget)):
        worker = ActorWorker(config(overrides), device="cpu")  # this process, world 1; starts from the group's initial weights
        worker.init_model()
        worker.load_checkpoint(initial_checkpoint)  # resharded from 2 ranks to 1
        runs[name] = run_update(worker, batch)
    group.call("load_checkpoint", initial_checkpoint)
    runs[f"w2_{layout}"] = run_update(group, batch)

    base = runs.pop("w1_8micro")
    grads = base.pop("grads")
    assert len(grads) == 26 and all(g.abs().sum() > 0 for g in grads.values())
    assert base["actor/pg_clipfrac"] > 0 and base["actor/kl_loss"] > 0  # clipping and KL terms are live
    for name, run in runs.items():
        other = run.pop("grads")
        assert set(other) == set(grads), name
        for k, g in grads.items():
            rel = float((other[k] - g).norm() / g.norm())
            assert rel <= FP32_GRAD_REL, f"{name}: {k} differs, relative {rel:.2e}"
        assert set(run) == set(base)
        for k, v in base.items():  # one update in another order: tests/run_compare.py
            assert run[k] == pytest.approx(v, rel=RUN_REL, abs=RUN_ABS), f"{name}: metric {k}"


def test_checkpoint_resume_equals_uninterrupted(budgets_group, initial_checkpoint, tmp_path):
    """Two mini-batches per update, shuffled by (seed, update count, rank): the optimizer, LR schedule,
    update count and RNG all come back."""
    group = budgets_group
    group.call("load_checkpoint", initial_checkpoint)
    b1, b2 = (ppo_batch(2 * MINI, P, R, vocab_size=VOCAB, seed=s) for s in (21, 22))
    group.call_batch("update_actor", b1, chunk_rows=MINI)
    group.call("save_checkpoint", str(tmp_path / "step1"))
    uninterrupted = group.call_batch("update_actor", b2, chunk_rows=MINI)
    state = group.call("full_state_dict")[0]
    group.call_batch("update_actor", b2, chunk_rows=MINI)  # drift further before restoring

    group.call("load_checkpoint", str(tmp_path / "step1"))
    resumed = group.call_batch("update_actor", b2, chunk_rows=MINI)
    assert resumed.pop(WORKER_SECONDS) > 0 and uninterrupted.pop(WORKER_SECONDS) > 0  # timing, not a result
    assert resumed == uninterrupted
    for name, t in group.call("full_state_dict")[0].items():
        assert torch.equal(t, state[name]), name


def test_bad_shard_stops_every_rank_and_group_stays_usable(rows_group, initial_checkpoint):
    bad = ppo_batch(MINI, P, R, vocab_size=VOCAB, seed=1)
    bad["advantages"][5, 2] = float("nan")  # lands on one rank only
    with pytest.raises(ValueError, match="advantages contains NaN or inf"):
        rows_group.call_batch("update_actor", bad, chunk_rows=MINI)
    with pytest.raises(ValueError, match="cannot be split over 2 ranks"):
        rows_group.call_batch("compute_log_prob", bad.index([0]))
    out = rows_group.call_batch("compute_log_prob", bad)  # no rank was left inside a collective
    assert out["old_log_probs"].shape == (MINI, R)


def with_short_responses(batch: Batch, length: int = 1) -> Batch:
    """Every other row cut to ``length`` response tokens. On CPU the LM-head matmul of a piece that
    scores fewer than 4 tokens takes another kernel, so such a row's log-probs depend on whether it
    is scored alone or with others: the batch variance the old layout runs into."""
    rows = torch.arange(0, len(batch), 2)
    batch["attention_mask"][rows, P + length:] = 0
    batch["response_mask"][rows, length:] = 0
    batch["input_ids"][rows, P + length:] = 0
    return batch


@pytest.mark.exactness
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_first_mini_batch_is_exactly_on_policy(request, initial_checkpoint, layout):
    """Old log-probs computed in the update's layout: ratio == 1 and ppo_kl == 0 bitwise on the first
    mini-batch of every step. Negative control: the same old log-probs moved by one ulp each, a known
    perturbation, and the check sees exactly that ulp (it does not rely on a kernel's batch variance,
    which some CPUs do not have: AMX Xeons score these pieces batch-invariantly)."""
    group = request.getfixturevalue(f"{layout}_group")
    rows = 2 * MINI  # two mini-batches per step, 8 rows per rank in each
    group.call("load_checkpoint", initial_checkpoint)
    firsts, overall = [], []
    for step in range(3):
        batch = with_short_responses(ppo_batch(rows, P, R, vocab_size=VOCAB, seed=40 + step))
        # as RayWorkers.compute_log_prob does with old_log_prob_layout=update
        batch.update(group.call_batch("compute_log_prob", batch, chunk_rows=MINI, update_layout=True))
        m = group.call_batch("update_actor", batch, chunk_rows=MINI)
        firsts.append((m["actor/first_mini_batch/ppo_kl"], m["actor/first_mini_batch/log_ratio_abs_max"]))
        overall.append(m["actor/log_ratio_abs_max"])
    assert firsts == [(0.0, 0.0)] * 3  # exactly: every token's log-ratio is 0, so ratio == exp(0) == 1
    assert all(o > 1e-3 for o in overall)  # the second mini-batch sees the moved policy: the metric is live

    # Negative control: every old log-prob one ulp lower. The new log-probs equal the unmoved old ones
    # bitwise, so each token's log-ratio is exactly its ulp (a difference of adjacent floats is exact):
    # the first mini-batch's max lies between the smallest and the largest ulp of the scored tokens.
    group.call("load_checkpoint", initial_checkpoint)
    batch = with_short_responses(ppo_batch(rows, P, R, vocab_size=VOCAB, seed=40))
    old = group.call_batch("compute_log_prob", batch, chunk_rows=MINI, update_layout=True)["old_log_probs"]
    moved = torch.nextafter(old, torch.full_like(old, -float("inf")))
    batch["old_log_probs"] = torch.where(batch["response_mask"].bool(), moved, old)
    ulps = (old - moved)[batch["response_mask"].bool()]
    m = group.call_batch("update_actor", batch, chunk_rows=MINI)
    kl, mx = m["actor/first_mini_batch/ppo_kl"], m["actor/first_mini_batch/log_ratio_abs_max"]
    assert ulps.min().item() <= mx <= ulps.max().item() and mx > 0, (mx, ulps.min(), ulps.max())
    assert kl < 0  # ppo_kl = mean(old - new) = -(mean ulp): the one-ulp shift is seen in the KL too


def test_ref_group_log_probs_and_dead_rank(padded_ref_group):
    """Last: it kills a rank of the group."""
    group = padded_ref_group
    batch = ppo_batch(6, P, R, vocab_size=VOCAB, seed=9)
    out = group.call_batch("compute_ref_log_prob", batch)
    ref_lp, _ = reference_log_probs(load_causal_lm("tiny:qwen2").state_dict(), batch, False)
    assert (out["ref_log_probs"] - ref_lp).abs().max() <= FP32_LOGPROB_TOL
    with pytest.raises(ValueError, match="responses"):
        group.call_batch("compute_ref_log_prob", Batch({k: batch[k] for k in ("input_ids", "attention_mask")}))
    ray.kill(group.workers[1])
    with pytest.raises(RuntimeError, match=r"ref worker rank 1 of 2 died"):
        group.call_batch("compute_ref_log_prob", batch)
