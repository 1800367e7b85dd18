"""Worker groups on a real local Ray (127.0.0.1) with real FSDP2 over gloo: log-probs vs the
single-process forward, gradient equivalence across micro-batching / token budget / world size,
checkpoint resume, and a dead rank reported by role and rank."""

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from rlpad.batch import WORKER_SECONDS, Batch  # noqa: E402
from rlpad.config import ActorRolloutRefConfig  # noqa: E402
from rlpad.core.forward import compute_log_probs  # noqa: E402
from rlpad.core.models import load_causal_lm  # noqa: E402
from rlpad.seqlen import count_micro_batches  # noqa: E402
from workers.actor import ActorWorker  # noqa: E402
from rlpad.embedded.synthetic import ppo_batch  # noqa: E402
from workers.group import WorkerGroup  # noqa: E402

pytestmark = pytest.mark.ray

P, R, VOCAB, ROWS = 8, 12, 128, 8
BUDGET = 40  # tokens per micro-batch: several micro-batches per rank at every world size


def config() -> ActorRolloutRefConfig:
    cfg = ActorRolloutRefConfig()
    a = cfg.actor
    a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu = ROWS, 4, BUDGET
    a.use_kl_loss, a.kl_loss_coef, a.entropy_coeff, a.optim.lr = True, 0.1, 0.01, 1e-2
    cfg.rollout.log_prob_micro_batch_size_per_gpu, cfg.rollout.n = 2, 1
    cfg.ref.log_prob_micro_batch_size_per_gpu = 3
    return cfg


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def actor_group(ray_session):
    group = WorkerGroup(ActorWorker, config(), role="actor", world_size=2, device="cpu")
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def initial_checkpoint(actor_group, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "initial")
    actor_group.call("save_checkpoint", path)
    return path


def reference_log_probs(state: dict, batch: Batch, rmpad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model = load_causal_lm("tiny:qwen2")
    model.load_state_dict(state)
    with torch.no_grad():
        return compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], R,
                                 use_remove_padding=rmpad, calculate_entropy=True)  # fmt: skip


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_group_log_prob_matches_single_process(actor_group, initial_checkpoint, rmpad):
    # 9 rows over 2 ranks (5 + 4) with 2-row micro-batches: 3 vs 2 pieces, so rank 1 runs a dummy one.
    batch = ppo_batch(9, P, R, vocab_size=VOCAB, seed=5)
    batch["uid"] = np.arange(9)
    actor_group.call("set_config", {"model.use_remove_padding": rmpad})
    try:
        out = actor_group.call_batch("compute_log_prob", batch)
    finally:
        actor_group.call("set_config", {"model.use_remove_padding": True})
    ref_lp, ref_ent = reference_log_probs(actor_group.call("full_state_dict")[0], batch, rmpad)
    assert out["old_log_probs"].shape == (9, R)
    assert (out["old_log_probs"] - ref_lp).abs().max() <= 1e-5
    assert (out["entropy"] - ref_ent).abs().max() <= 1e-5


def run_update(worker_or_group, batch: Batch, overrides: dict) -> dict:
    """The update's metrics without the worker's own seconds (timing, not a result)."""
    if isinstance(worker_or_group, WorkerGroup):
        worker_or_group.call("set_config", overrides)
        out = worker_or_group.call_batch("update_actor", batch, chunk_rows=ROWS, return_grads=True)
    else:
        worker_or_group.set_config(overrides)
        out = worker_or_group.update_actor(batch, return_grads=True)
    assert out.pop(WORKER_SECONDS) > 0
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gradient_equivalence_across_micro_batches_budget_and_world_size(actor_group, initial_checkpoint, mode):
    batch = ppo_batch(ROWS, P, R, vocab_size=VOCAB, seed=11)
    lengths = batch["attention_mask"].sum(-1)
    assert count_micro_batches(lengths.tolist(), BUDGET) >= 3  # world 1: several budget micro-batches
    by_rows = {"actor.use_dynamic_bsz": False, "actor.ppo_micro_batch_size_per_gpu": 2, "actor.loss_agg_mode": mode}
    by_budget = {"actor.use_dynamic_bsz": True, "actor.loss_agg_mode": mode}
    runs = {}
    for name, overrides in (("w1_4micro", by_rows), ("w1_budget", by_budget)):
        worker = ActorWorker(config(), device="cpu")  # this process, world 1; starts from the group's initial weights
        worker.init_model()
        worker.load_checkpoint(initial_checkpoint)  # resharded from 2 ranks to 1
        runs[name] = run_update(worker, batch, overrides)
    one_micro = {**by_rows, "actor.ppo_micro_batch_size_per_gpu": 4}
    for name, overrides in (("w2_1micro", one_micro), ("w2_budget", by_budget)):
        actor_group.call("load_checkpoint", initial_checkpoint)
        runs[name] = run_update(actor_group, batch, overrides)

    base = runs.pop("w1_4micro")
    grads = base.pop("grads")
    assert len(grads) == 26 and all(g.abs().sum() > 0 for g in grads.values())
    assert base["actor/pg_clipfrac"] > 0 and base["actor/kl_loss"] > 0  # clipping and KL terms are live
    for name, run in runs.items():
        other = run.pop("grads")
        assert set(other) == set(grads), name
        for k, g in grads.items():
            rel = float((other[k] - g).norm() / g.norm())
            assert rel <= 1e-6, f"{name}: {k} differs, relative {rel:.2e}"
        assert set(run) == set(base)
        for k, v in base.items():
            assert run[k] == pytest.approx(v, rel=1e-6, abs=1e-9), f"{name}: metric {k}"


def test_checkpoint_resume_equals_uninterrupted(actor_group, initial_checkpoint, tmp_path):
    actor_group.call("load_checkpoint", initial_checkpoint)
    actor_group.call("set_config", {"actor.use_dynamic_bsz": True, "actor.shuffle": True, "actor.ppo_epochs": 2,
                                    "actor.ppo_mini_batch_size": ROWS // 2, "actor.loss_agg_mode": "token-mean"})
    b1, b2 = (ppo_batch(ROWS, P, R, vocab_size=VOCAB, seed=s) for s in (21, 22))
    chunk = ROWS // 2
    actor_group.call_batch("update_actor", b1, chunk_rows=chunk)
    actor_group.call("save_checkpoint", str(tmp_path / "step1"))
    uninterrupted = actor_group.call_batch("update_actor", b2, chunk_rows=chunk)
    state = actor_group.call("full_state_dict")[0]
    actor_group.call_batch("update_actor", b2, chunk_rows=chunk)  # drift further before restoring

    actor_group.call("load_checkpoint", str(tmp_path / "step1"))
    resumed = actor_group.call_batch("update_actor", b2, chunk_rows=chunk)
    assert resumed.pop(WORKER_SECONDS) > 0 and uninterrupted.pop(WORKER_SECONDS) > 0  # timing, not a result
    assert resumed == uninterrupted
    for name, t in actor_group.call("full_state_dict")[0].items():
        assert torch.equal(t, state[name]), name


def test_bad_shard_stops_every_rank_and_group_stays_usable(actor_group, initial_checkpoint):
    bad = ppo_batch(ROWS, P, R, vocab_size=VOCAB, seed=1)
    bad["advantages"][5, 2] = float("nan")  # lands on one rank only
    with pytest.raises(ValueError, match="advantages contains NaN or inf"):
        actor_group.call_batch("update_actor", bad, chunk_rows=ROWS)
    with pytest.raises(ValueError, match="cannot be split over 2 ranks"):
        actor_group.call_batch("compute_log_prob", bad.index([0]))
    out = actor_group.call_batch("compute_log_prob", bad)  # no rank was left inside a collective
    assert out["old_log_probs"].shape == (ROWS, R)


def test_ref_group_log_probs_and_dead_rank(ray_session):
    group = WorkerGroup(ActorWorker, config(), role="ref", world_size=2, device="cpu")
    try:
        batch = ppo_batch(6, P, R, vocab_size=VOCAB, seed=9)
        out = group.call_batch("compute_ref_log_prob", batch)
        ref_lp, _ = reference_log_probs(load_causal_lm("tiny:qwen2").state_dict(), batch, True)
        assert (out["ref_log_probs"] - ref_lp).abs().max() <= 1e-5
        with pytest.raises(ValueError, match="responses"):
            group.call_batch("compute_ref_log_prob", Batch({k: batch[k] for k in ("input_ids", "attention_mask")}))
        ray.kill(group.workers[1])
        with pytest.raises(RuntimeError, match=r"ref worker rank 1 of 2 died"):
            group.call_batch("compute_ref_log_prob", batch)
    finally:
        group.shutdown()


def with_short_responses(batch: Batch, length: int = 1) -> Batch:
    """Every other row cut to ``length`` response tokens. On CPU the LM-head matmul of a piece that
    scores fewer than 4 tokens takes another kernel, so such a row's log-probs depend on whether it
    is scored alone or with others: the batch variance the old layout runs into."""
    rows = torch.arange(0, len(batch), 2)
    batch["attention_mask"][rows, P + length:] = 0
    batch["response_mask"][rows, length:] = 0
    batch["input_ids"][rows, P + length:] = 0
    return batch


ON_POLICY_CASES = {
    # log-prob micro-batches of 1 row, update micro-batches of 3 rows, two mini-batches per step
    "rows": ({"rollout.log_prob_micro_batch_size_per_gpu": 1, "actor.ppo_micro_batch_size_per_gpu": 3,
              "actor.use_dynamic_bsz": False, "actor.shuffle": False}),
    # token budgets on both sides (log-prob P + R = 20 tokens: a row or two per piece; update 60),
    # shuffled mini-batches
    "budgets": ({"rollout.log_prob_use_dynamic_bsz": True, "rollout.log_prob_max_token_len_per_gpu": P + R,
                 "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 3 * (P + R), "actor.shuffle": True}),
}


@pytest.mark.parametrize("case", sorted(ON_POLICY_CASES))
def test_first_mini_batch_is_exactly_on_policy(actor_group, initial_checkpoint, case):
    """Old log-probs computed in the update's layout: ratio == 1 and ppo_kl == 0 bitwise on the first
    mini-batch of every step; the old behaviour (log-prob micro-batches) misses by the kernels' batch
    variance (negative control)."""
    rows, mini = 4 * ROWS, 2 * ROWS  # two mini-batches per step, 8 rows per rank in each
    base = {"actor.ppo_mini_batch_size": mini, "actor.loss_agg_mode": "token-mean", "actor.ppo_epochs": 1,
            "rollout.log_prob_use_dynamic_bsz": False, **ON_POLICY_CASES[case]}
    actor_group.call("set_config", base)
    try:
        results = {}
        for layout in (True, False):
            actor_group.call("load_checkpoint", initial_checkpoint)
            firsts, overall = [], []
            for step in range(3):
                batch = with_short_responses(ppo_batch(rows, P, R, vocab_size=VOCAB, seed=40 + step))
                if layout:  # as RayWorkers.compute_log_prob does with old_log_prob_layout=update
                    old = actor_group.call_batch("compute_log_prob", batch, chunk_rows=mini, update_layout=True)
                else:
                    old = actor_group.call_batch("compute_log_prob", batch)
                batch.update(old)
                m = actor_group.call_batch("update_actor", batch, chunk_rows=mini)
                firsts.append((m["actor/first_mini_batch/ppo_kl"], m["actor/first_mini_batch/log_ratio_abs_max"]))
                overall.append(m["actor/log_ratio_abs_max"])
            results[layout] = firsts, overall
    finally:
        actor_group.call("set_config", {"actor.ppo_mini_batch_size": ROWS, "actor.shuffle": False,
                                        "rollout.log_prob_micro_batch_size_per_gpu": 2,
                                        "rollout.log_prob_use_dynamic_bsz": False, "actor.use_dynamic_bsz": False,
                                        "actor.ppo_micro_batch_size_per_gpu": 4,
                                        "actor.ppo_max_token_len_per_gpu": BUDGET})
    firsts, overall = results[True]
    assert firsts == [(0.0, 0.0)] * 3  # exactly: every token's log-ratio is 0, so ratio == exp(0) == 1
    assert all(o > 1e-3 for o in overall)  # the second mini-batch sees the moved policy: the metric is live
    # Negative control: computed in other pieces, the short rows' log-probs differ in the last bits,
    # so the first mini-batch is not exactly on-policy; by the batch variance only.
    old_firsts, _ = results[False]
    assert all(mx > 0 for _, mx in old_firsts), old_firsts
    assert all(abs(kl) < 1e-5 and mx < 1e-4 for kl, mx in old_firsts), old_firsts
