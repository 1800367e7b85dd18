"""The teacher worker and the distilled actor update with real FSDP2 (world 1 in this process, and a
2-rank group on a real local Ray): the teacher's numbers equal the scoring core's on its model, the
distilled gradient does not depend on micro-batches or world size, and the teacher's term is live
(negative controls)."""

import dataclasses

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from rlpad.batch import WORKER_SECONDS, Batch  # noqa: E402
from rlpad.config.distillation import DistillationConfig, DistillationLossConfig
from rlpad.config.schema import ActorRolloutRefConfig
from rlpad.core.distill_scoring import compute_teacher_topk, join_rows  # noqa: E402
from rlpad.core.forward import compute_log_probs  # noqa: E402
from rlpad.core.models import load_causal_lm  # noqa: E402
from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL  # noqa: E402
from rlpad.embedded.synthetic import ppo_batch  # noqa: E402
from workers.actor import ActorWorker  # noqa: E402
from workers.group import WorkerGroup  # noqa: E402
from workers.teacher import DistilledSection  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.exactness]

P, R, VOCAB = 8, 10, 128
TOKENIZER_IDS = 100  # the KL of forward_kl_topk over the first 100 head rows (the tokenizer's ids)
TEACHER, STUDENT = "tiny:llama", "tiny:qwen2"
MINI, K = 12, 5


def section(loss: DistillationLossConfig, *, teacher: bool = False, micro: int = 2,
            offload: bool = False) -> DistilledSection:
    """``offload``: every offload key on (the teacher rests by ref.fsdp_config.param_offload; the actor's keys are
    the actor's, read only by its colocated phases)."""
    arr = ActorRolloutRefConfig()
    a = arr.actor
    a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.optim.lr, a.use_kl_loss = MINI, micro, 1e-2, False
    arr.rollout.n, arr.ref.log_prob_micro_batch_size_per_gpu = 1, micro
    arr.ref.fsdp_config.param_offload = a.fsdp_config.param_offload = a.fsdp_config.optimizer_offload = offload
    if teacher:
        arr.model.path = TEACHER
    fields = {f.name: getattr(arr, f.name) for f in dataclasses.fields(ActorRolloutRefConfig)}
    return DistilledSection(**fields, distillation=DistillationConfig(enabled=True, distillation_loss=loss),
                            vocab_size=TOKENIZER_IDS)


TOPK = DistillationLossConfig(loss_mode="forward_kl_topk", topk=K, use_policy_gradient=False, use_task_rewards=True,
                              distillation_loss_coef=0.5, loss_max_clamp=None)
K1 = DistillationLossConfig(loss_mode="k1", use_policy_gradient=True, use_task_rewards=False)


def local(sec: DistilledSection, role: str) -> ActorWorker:
    w = ActorWorker(sec, role=role, device="cpu")
    w.init_model()
    return w


@pytest.fixture(scope="module")
def batch() -> Batch:
    b = ppo_batch(MINI, P, R, vocab_size=VOCAB, seed=3)
    b["uid"] = np.arange(MINI)
    return b


def resting(params) -> bool:
    """Every parameter's storage is given back (0 bytes): the state is in host memory (workers/offload.py)."""
    return all((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() == 0 for p in params)


@pytest.mark.parametrize("loss,offload", [(TOPK, True), (K1, False)], ids=["forward_kl_topk-offload", "k1"])
def test_teacher_worker_equals_the_scoring_core_on_its_model(batch, loss, offload):
    """With every offload key on, the teacher rests between calls and comes back for its scoring (it read
    freed storages before: a segfault at its first compute_teacher)."""
    worker = local(section(loss, teacher=True, offload=offload), "teacher")
    assert resting(worker.root.parameters()) == offload
    hot = Batch(dict(batch.tensors), dict(batch.non_tensors), {"temperature": 0.7})  # the rollout's temperature
    out = worker.compute_teacher(hot)
    assert resting(worker.root.parameters()) == offload  # back in host memory after the call
    assert "temperature" not in out.meta  # the batch's (the student's) temperature stays the rollout's
    model = load_causal_lm(TEACHER)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], R)
    student = load_causal_lm(STUDENT)
    with torch.no_grad():
        if loss is K1:  # scored at teacher_model.temperature, 1.0 (verl's), not the rollout's 0.7
            want, _ = compute_log_probs(model, *args, use_remove_padding=True)
            assert (out["teacher_log_probs"] - want).abs().max() <= FP32_LOGPROB_TOL
            rollout_t, _ = compute_log_probs(model, *args, use_remove_padding=True, temperature=0.7)
            assert (out["teacher_log_probs"] - rollout_t).abs().max() > 100 * FP32_LOGPROB_TOL  # negative control
            other, _ = compute_log_probs(student, *args, use_remove_padding=True)  # negative control: the student
            assert (out["teacher_log_probs"] - other).abs().max() > 100 * FP32_LOGPROB_TOL
            return
        ids, lp = compute_teacher_topk(model, *args, topk=K, vocab_size=TOKENIZER_IDS, use_remove_padding=True)
        s_ids, s_lp = compute_teacher_topk(student, *args, topk=K, vocab_size=TOKENIZER_IDS, use_remove_padding=True)
    # per row, its scored positions only (the jagged layout), int32 ids, k log-probs + the tail's
    scored = batch["response_mask"].sum(-1).tolist()
    assert [tuple(r.shape) for r in out["teacher_topk_ids"]] == [(n, K) for n in scored]
    assert all(r.dtype == torch.int32 for r in out["teacher_topk_ids"])
    assert [tuple(r.shape) for r in out["teacher_topk_log_probs"]] == [(n, K + 1) for n in scored]
    assert torch.equal(join_rows(out["teacher_topk_ids"]), ids)
    assert (join_rows(out["teacher_topk_log_probs"]) - lp).abs().max() <= FP32_LOGPROB_TOL
    assert int(ids.max()) < TOKENIZER_IDS
    assert not torch.equal(s_ids, ids) and (s_lp - lp).abs().max() > 100 * FP32_LOGPROB_TOL  # negative control


def update(worker_or_group, batch: Batch) -> dict:
    if isinstance(worker_or_group, WorkerGroup):
        out = worker_or_group.call_batch("update_actor", batch, chunk_rows=MINI, return_grads=True)
    else:
        out = worker_or_group.update_actor(batch, return_grads=True)
    out.pop(WORKER_SECONDS)
    return out


def rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def test_two_rank_teacher_and_distilled_update_equal_world_one(ray_session, batch, tmp_path):
    """forward_kl_topk mixed with the task loss: the 2-rank teacher group's top-k equal the world-1
    teacher's; the 2-rank actor (3-row micro-batches) gives the world-1 actor's (2-row) gradient."""
    teacher_group = WorkerGroup(ActorWorker, section(TOPK, teacher=True, micro=3, offload=True), role="teacher",
                                world_size=2, device="cpu")  # every offload key on: the teacher rests between calls
    actor_group = WorkerGroup(ActorWorker, section(TOPK, micro=3), role="actor", world_size=2, device="cpu")
    try:
        scored = teacher_group.call_batch("compute_teacher", batch)
        alone = local(section(TOPK, teacher=True), "teacher").compute_teacher(batch)
        assert torch.equal(join_rows(scored["teacher_topk_ids"]), join_rows(alone["teacher_topk_ids"]))
        assert (join_rows(scored["teacher_topk_log_probs"]) - join_rows(alone["teacher_topk_log_probs"])
                ).abs().max() <= FP32_LOGPROB_TOL
        batch = Batch(dict(batch.tensors), dict(batch.non_tensors) | dict(scored.non_tensors))
        ckpt = str(tmp_path / "initial")
        actor_group.call("save_checkpoint", ckpt)
        two = update(actor_group, batch)
        one_worker = local(section(TOPK), "actor")
        one_worker.load_checkpoint(ckpt)
        one = update(one_worker, batch)
    finally:
        actor_group.shutdown()
        teacher_group.shutdown()
    assert rel(two["grads"], one["grads"]) <= FP32_GRAD_REL
    for key in ("actor/distill/kl_mean", "actor/distill/teacher_topk_mass", "actor/distill/loss"):
        assert abs(two[key] - one[key]) <= 1e-5 * max(1.0, abs(one[key])), key
    assert one["actor/distill/kl_mean"] > 0 and 0 < one["actor/distill/teacher_topk_mass"] < 1
    assert one["actor/distill/loss_clamp_frac"] == 0
    # negative control: the same update without the teacher's term is far from it
    plain = local(dataclasses.replace(section(TOPK), distillation=DistillationConfig()), "actor")
    plain.load_checkpoint(ckpt)
    assert rel(update(plain, batch)["grads"], one["grads"]) > 100 * FP32_GRAD_REL


def test_k1_policy_gradient_update_reads_the_teacher(batch):
    """k1 with the policy gradient and no task reward: the gradient moves with the teacher's log-probs; under
    bypass_mode its ratio is against the rollout's log-probs, as the task loss's."""
    teacher = local(section(K1, teacher=True), "teacher")
    scored = Batch(dict(batch.tensors) | dict(teacher.compute_teacher(batch).tensors), dict(batch.non_tensors))
    student = local(section(K1), "actor")
    own = student.compute_log_prob(scored, update_layout=True)["old_log_probs"]  # the update's own split
    scored["old_log_probs"] = own  # on-policy: ratio 1
    first = update(student, scored)
    assert first["actor/distill/pg_clipfrac"] == 0
    # use_task_rewards=false: the task's loss is not trained, so neither computed nor logged
    assert not {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss"} & set(first)
    mask = scored["response_mask"].bool()
    want = float((own - scored["teacher_log_probs"])[mask].mean())
    assert abs(first["actor/distill/kl_mean"] - want) < 1e-5
    # bypass_mode (verl's: the rollout policy is the old one): the distillation term's ratio is against the
    # rollout's log-probs too (it read old_log_probs, absent from bypass_mode's batch: a KeyError at the update)
    bypass_section = section(K1)
    bypass_section.actor.policy_loss.loss_mode = "bypass_mode"
    noise = torch.randn(own.shape, generator=torch.Generator().manual_seed(7)) * 0.1
    scored["rollout_log_probs"] = (own + noise) * scored["response_mask"]
    bypass = update(local(bypass_section, "actor"), scored)
    assert abs(bypass["actor/distill/pg_ppo_kl"] - float(noise[mask].mean())) < 1e-6  # mean(old - new), old = rollout's
    assert abs(first["actor/distill/pg_ppo_kl"]) < 1e-7 < abs(float(noise[mask].mean()))  # negative control
    # negative control: a teacher that agrees with the student gives advantage 0 and no gradient
    agreeing = local(section(K1), "actor")
    scored["old_log_probs"] = scored["teacher_log_probs"] = agreeing.compute_log_prob(scored, update_layout=True)["old_log_probs"]
    none = update(agreeing, scored)
    assert max(float(g.abs().max()) for g in none["grads"].values()) == 0
    assert max(float(g.abs().max()) for g in first["grads"].values()) > 1e-4


def test_teacher_in_its_own_pool_scores_as_colocated_and_alone(ray_session, batch):
    """The launcher's two teacher placements (workers.teacher.teacher_group_kwargs) next to a 2-rank actor
    in its colocated pool (a share of each bundle, as RayWorkers reserves it): the teacher in that pool,
    and in a pool of its own (``distillation.n_gpus_per_node=2``). The own pool's ranks run outside the
    actor's placement group; both teachers' log-probs equal the teacher scoring each sequence alone
    (fp32, float64 log-softmax) to the fp32 bound. Negative control: the next column's log-probs (a
    teacher scoring a shifted token) differ by far more."""
    from rlpad.config.schema import Config
    from rlpad.embedded.exactness import oracle
    from workers.placement import plan_nodes, release, reserve
    from workers.teacher import teacher_group_kwargs

    def config(n_gpus_per_node: int) -> Config:
        c = Config()
        c.trainer.n_gpus_per_node = 2
        c.distillation = DistillationConfig(enabled=True, distillation_loss=K1, n_gpus_per_node=n_gpus_per_node)
        return c

    share = 1 / 3  # actor, teacher, rollout engine: a third of each bundle, as the launcher's colocated layout
    nodes = plan_nodes(1, {"CPU": 2.0}, what="colocated pool")
    pool = reserve(nodes, 2, {"CPU": 1.0}, what="colocated pool", timeout_s=120.0)
    actor_kwargs = dict(nnodes=1, ranks_per_node=2, nodes=nodes, seed=1, num_cpus_per_worker=share,
                        num_gpus_per_worker=0, placement_groups=pool)
    groups = []
    try:
        groups.append(WorkerGroup(ActorWorker, section(K1), role="actor", **actor_kwargs))
        scores, where = {}, {}
        for name, n_gpus in (("colocated", 0), ("own_pool", 2)):
            kwargs = teacher_group_kwargs(config(n_gpus), actor_kwargs, gpus=0)
            groups.append(WorkerGroup(ActorWorker, section(K1, teacher=True), role="teacher", **kwargs))
            scores[name] = groups[-1].call_batch("compute_teacher", batch)["teacher_log_probs"]
            where[name] = {p["placement_group_id"] for p in groups[-1].call("placement")}
        where["actor"] = {p["placement_group_id"] for p in groups[0].call("placement")}
    finally:
        for g in groups:
            g.shutdown()
        release(pool)
    assert where["actor"] == where["colocated"] == {pool[0].id.hex()}
    assert len(where["own_pool"]) == 1 and None not in where["own_pool"] and not where["own_pool"] & where["actor"]
    mask = batch["response_mask"].bool()
    alone = oracle(load_causal_lm(TEACHER), dict(batch.tensors), R, backward=False).lp
    for name, lp in scores.items():
        assert (lp.double() - alone)[mask].abs().max() <= FP32_LOGPROB_TOL, name
    assert (scores["own_pool"] - scores["colocated"])[mask].abs().max() <= FP32_LOGPROB_TOL
    both = mask[:, :-1] & mask[:, 1:]  # negative control: column t scored as column t + 1's token
    assert (scores["own_pool"][:, :-1].double() - alone[:, 1:])[both].abs().max() > 100 * FP32_LOGPROB_TOL
