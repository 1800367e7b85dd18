"""Sequence parallelism in the FSDP2 workers: 4 plain processes (gloo, no Ray) as 2 data-parallel x
2 sequence-parallel ranks against the same 2 data-parallel groups with sp = 1 (one rank each, so
shuffled mini-batches agree), for the actor and the critic.

Two layouts: row micro-batches with the token-mean loss, and token budgets (which count the whole
row: ``ppo_max_token_len_per_gpu x sp`` per micro-batch) with shuffled mini-batches, the
seq-mean-token-mean loss and gradient checkpointing (the exchanges run again in the recompute). The
budgets layout distills too (forward_kl_topk mixed with the task loss): a sequence-parallel teacher's
top-k (its positions gathered over the group) and the student's one-pass head, whose per-token losses
are summed over the group as (B, R) grids.
Log-probs / values, the full gradients of a mini-batch and the metrics of a whole update (two
mini-batches, the weights moving) must equal sp = 1 (fp32: 2e-5 per token, 1e-5 relative for
gradients and metrics), and every rank must return the same metrics.

A row over the token budget (``ppo_max_token_len_per_gpu x sp``) in one data-parallel group stops
every rank with the ValueError at once (the check rides on the micro-batch count's agreement), in
its own 4 processes whose collectives time out after 60 s: on a rank left waiting that is a
RuntimeError, not the ValueError.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

from run_compare import RUN_ABS, RUN_REL
from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL
from rlpad.batch import Batch
from rlpad.config.schema import ActorRolloutRefConfig, CriticConfig
from rlpad.embedded.synthetic import ppo_batch
from spawn_ranks import spawn_ranks
from rlpad.core.distill_scoring import join_rows
from workers.actor import ActorWorker
from workers.critic import CriticWorker
from workers.net import free_port

P, R, VOCAB, ROWS, MINI = 8, 12, 128, 16, 8
TOL, REL = FP32_LOGPROB_TOL, FP32_GRAD_REL  # derivations: rlpad/embedded/exactness.py
LAYOUTS = {
    "rows": dict(ppo_micro_batch_size_per_gpu=3, use_dynamic_bsz=False, shuffle=False, loss_agg_mode="token-mean"),
    "budgets": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=P + R, shuffle=True,
                    loss_agg_mode="seq-mean-token-mean", enable_gradient_checkpointing=True),
}
METRICS = ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm",
           "critic/vf_loss", "critic/vpred_mean", "critic/grad_norm")
DISTILL_METRICS = ("actor/distill/kl_mean", "actor/distill/loss", "actor/distill/teacher_topk_mass",
                   "actor/distill/student_topk_mass")
DISTILLED = "budgets"  # the layout whose actor distills from a teacher (tiny:llama: 2 key/value heads)


def configs(layout: str, sp: int) -> tuple[ActorRolloutRefConfig, CriticConfig]:
    actor = ActorRolloutRefConfig()
    actor.model.path = "tiny:qwen2"  # 2 query heads, 1 key/value head: repeated for sp = 2
    actor.rollout.n, actor.rollout.log_prob_micro_batch_size_per_gpu = 1, 3
    a = actor.actor
    a.ppo_mini_batch_size, a.entropy_coeff, a.optim.lr, a.ulysses_sequence_parallel_size = MINI, 0.01, 1e-2, sp
    critic = CriticConfig()
    critic.model.path, critic.ppo_mini_batch_size, critic.ulysses_sequence_parallel_size = "tiny:qwen2", MINI, sp
    for section in (a, critic, actor.model, critic.model):
        fields = {f.name for f in dataclasses.fields(section)}
        for k, v in LAYOUTS[layout].items():
            if k in fields and not (section is critic and k == "shuffle"):
                setattr(section, k, v)
    return actor, critic


def distilled(section: ActorRolloutRefConfig, sp: int, teacher: bool = False) -> ActorRolloutRefConfig:
    """``section`` as a forward_kl_topk student (or its teacher, sequence-parallel by the reference's key)."""
    from rlpad.config.distillation import DistillationConfig, DistillationLossConfig
    from workers.teacher import DistilledSection

    loss = DistillationLossConfig(loss_mode="forward_kl_topk", topk=5, use_task_rewards=True,
                                  distillation_loss_coef=0.5, loss_max_clamp=None)
    if teacher:
        section = dataclasses.replace(section, model=dataclasses.replace(section.model, path="tiny:llama"))
        section.ref.ulysses_sequence_parallel_size = sp
    fields = {f.name: getattr(section, f.name) for f in dataclasses.fields(ActorRolloutRefConfig)}
    return DistilledSection(**fields, distillation=DistillationConfig(enabled=True, distillation_loss=loss),
                            vocab_size=100)


def make_batch() -> Batch:
    return ppo_batch(ROWS, P, R, vocab_size=VOCAB, seed=4)


def group_rows(dp_rank: int, dp: int) -> torch.Tensor:
    """The rows a data-parallel group gets: each mini-batch's rows dealt out in turn (whole mini-batches)."""
    return torch.cat([torch.arange(s, s + MINI)[dp_rank::dp] for s in range(0, ROWS, MINI)])


def run_layout(rank: int, world: int, port: int, layout: str, sp: int) -> dict:
    actor_cfg, critic_cfg = configs(layout, sp)
    rows = group_rows(rank // sp, world // sp)
    shard = make_batch().index(rows)
    common = dict(rank=rank, world_size=world, master_port=port, device="cpu", seed=3)
    out = {"rows": rows}
    if layout == DISTILLED:
        teacher = ActorWorker(distilled(actor_cfg, sp, teacher=True), role="teacher", **common)
        teacher.init_model()
        scored = teacher.compute_teacher(shard)
        shard.update(scored)
        out["teacher"] = [join_rows(scored[k]) for k in scored.keys()]
        actor_cfg = distilled(actor_cfg, sp)
    actor = ActorWorker(actor_cfg, role="actor", **common)
    actor.init_model()
    critic = CriticWorker(critic_cfg, rollout_n=1, **common)
    critic.init_model()
    out |= {"old_log_probs": actor.compute_log_prob(shard)["old_log_probs"],
            "values": critic.compute_values(shard)["values"]}
    # Gradients at the initial weights (one mini-batch: its first rows), then a whole update on moved
    # weights (two mini-batches, two optimizer steps) for the metrics.
    first = shard.index(torch.arange(MINI // (world // sp)))
    out["actor_grads"] = actor.update_actor(first, return_grads=True)["grads"]
    out["critic_grads"] = critic.update_critic(first, return_grads=True)["grads"]
    out["metrics"] = actor.update_actor(shard) | critic.update_critic(shard)
    return out


def _ranks_main(rank: int, world: int, ports: list[int]) -> dict:
    results = {layout: run_layout(rank, world, ports[0], layout, sp=2) for layout in LAYOUTS}
    dist.destroy_process_group()
    if rank < 2:  # the reference: the same 2 data-parallel groups with sp = 1, one rank each
        results["reference"] = {layout: run_layout(rank, 2, ports[1], layout, sp=1) for layout in LAYOUTS}
        dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_ranks_main, 4, tmp_path_factory.mktemp("sp_workers"), [free_port(), free_port()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


# Rows of make_batch per data-parallel group (valid tokens 8, 11, 10, 13 | 20, 4, 5, 8) and a budget
# of 8 per rank, 16 per sp = 2 row: group 1 holds a row of 20 tokens, group 0 none over 16.
OVER_BUDGET_ROWS, OVER_BUDGET_PER_GPU, COLLECTIVE_TIMEOUT_S = ([1, 2, 3, 4], [0, 5, 6, 7]), 8, 60.0


def _over_budget_main(rank: int, world: int, port: int) -> dict:
    actor_cfg, _ = configs("budgets", sp=2)
    actor_cfg.actor.ppo_max_token_len_per_gpu = OVER_BUDGET_PER_GPU
    actor_cfg.actor.ppo_mini_batch_size = world // 2 * len(OVER_BUDGET_ROWS[0])  # one mini-batch
    shard = make_batch().index(torch.tensor(OVER_BUDGET_ROWS[rank // 2]))
    actor = ActorWorker(actor_cfg, role="actor", rank=rank, world_size=world, master_port=port, device="cpu",
                        seed=3, timeout_s=COLLECTIVE_TIMEOUT_S)  # fmt: skip
    actor.init_model()
    calls = {"compute_log_prob": lambda: actor.compute_log_prob(shard, update_layout=True),
             "update_actor": lambda: actor.update_actor(shard)}
    out = {}
    for call, run in calls.items():
        try:
            run()
            out[call] = None
        except Exception as e:  # noqa: BLE001 - the test reads which error each rank got
            out[call] = (type(e).__name__, str(e))
    dist.destroy_process_group()
    return out


def test_row_over_the_token_budget_stops_every_rank(tmp_path):
    """dp2 x sp2: every rank, not only group 1's, raises the ValueError with the numbers, for the
    old log-probs and the update (whose normalisers' all-reduce runs before the micro-batch plan)."""
    ranks = spawn_ranks(_over_budget_main, 4, tmp_path, free_port(), timeout_s=3 * COLLECTIVE_TIMEOUT_S)
    budget, row = OVER_BUDGET_PER_GPU * 2, 20
    for rank, out in enumerate(ranks):
        for call, error in out.items():
            assert error is not None and error[0] == "ValueError", f"rank {rank} {call}: {error}"
            if rank // 2 == 1:  # the group holding the row names it (its index in the shuffled mini-batch)
                assert re.fullmatch(f"sequence \\d has {row} tokens, more than the micro-batch token budget {budget}",
                                    error[1]), error[1]
            else:
                assert f"another rank holds a sequence of {row} tokens, more than the micro-batch token budget " \
                       f"{budget}" in error[1], error[1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dp2_x_sp2_workers_equal_one_rank(ranks, layout):
    for rank, results in enumerate(ranks):
        got, ref = results[layout], ranks[rank // 2]["reference"][layout]  # its data-parallel group with sp = 1
        assert torch.equal(got["rows"], ref["rows"])
        for key in ("old_log_probs", "values"):
            torch.testing.assert_close(got[key], ref[key], atol=TOL, rtol=0)
        same = {k: v for k, v in got["metrics"].items() if not k.startswith("worker_s")}
        assert same == {k: v for k, v in ranks[0][layout]["metrics"].items() if not k.startswith("worker_s")}, rank
        for key in METRICS + (DISTILL_METRICS if layout == DISTILLED else ()):
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=RUN_REL, abs=RUN_ABS), key  # tests/run_compare.py
        if layout == DISTILLED:  # the teacher's top-k ids and log-probs (gathered over the group) equal sp = 1's
            assert torch.equal(got["teacher"][0], ref["teacher"][0])
            torch.testing.assert_close(got["teacher"][1], ref["teacher"][1], atol=TOL, rtol=0)
        for which in ("actor_grads", "critic_grads"):
            for name, g in ref[which].items():
                assert _rel(got[which][name], g) <= REL, f"rank {rank} {which} {name}: {_rel(got[which][name], g):.2e}"
