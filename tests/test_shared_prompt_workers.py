"""share_prompts in the FSDP2 workers: splits keep prompt groups whole, results equal rmpad.

A real 2-rank Ray worker group (gloo) and a world-1 worker in this process."""

import math

import pytest
import torch

ray = pytest.importorskip("ray")

from run_compare import RUN_ABS, RUN_REL  # noqa: E402
from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL  # noqa: E402
from rlpad.batch import Batch  # noqa: E402
from rlpad.config.schema import ActorRolloutRefConfig  # noqa: E402
from rlpad.core.forward import compute_log_probs  # noqa: E402
from rlpad.core.models import load_causal_lm  # noqa: E402
from rlpad.core.shared_prompt import prompt_groups  # noqa: E402
from rlpad.embedded.synthetic import grpo_batch  # noqa: E402
from rlpad.batching.micro_batches import micro_batches  # noqa: E402
from rlpad.batching.balance import balance_units_across_ranks, pack_units_by_rows, shared_units  # noqa: E402
from workers.actor import ActorWorker  # noqa: E402
from workers.group import WorkerGroup  # noqa: E402

pytestmark = pytest.mark.ray

P, R, VOCAB, GROUPS, N = 8, 6, 128, 4, 3  # tiny:qwen2: vocab 128


def shared_batch(seed: int, shuffle: bool = False) -> Batch:
    """GRPO-shaped: GROUPS prompts x N responses, with every key update_actor reads."""
    d = grpo_batch(GROUPS, N, P, R, vocab_size=VOCAB, seed=seed, shuffle=shuffle, min_prompt=2)
    d.pop("group")
    gen = torch.Generator().manual_seed(seed + 1)
    mask = d["response_mask"].float()
    d["responses"] = d["input_ids"][:, P:]
    rows = mask.shape[0]
    d["advantages"] = torch.randn(rows, R, generator=gen) * mask
    d["old_log_probs"] = (-math.log(VOCAB) + 0.2 * torch.randn(rows, R, generator=gen)) * mask
    return Batch(d)


def config(share: bool, dynamic: bool = False) -> ActorRolloutRefConfig:
    cfg = ActorRolloutRefConfig()
    cfg.model.share_prompts, cfg.actor.use_dynamic_bsz = share, dynamic
    cfg.model.share_prompts_min_saved_fraction = 0.0  # share every micro-batch: the shared path is under test
    a = cfg.actor
    a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu = GROUPS, 4, 24
    a.entropy_coeff, a.optim.lr = 0.01, 1e-2
    cfg.rollout.n, cfg.rollout.log_prob_micro_batch_size_per_gpu = N, 4
    return cfg


def groups_of(batch: Batch) -> list[list[int]]:
    return prompt_groups(batch["input_ids"], batch["attention_mask"], batch["position_ids"], R)


def test_units_respect_budget_and_rows():
    # group 0: prompt 5, responses 4, 4, 4; group 1: prompt 3, responses 1, 2
    units, tokens = shared_units([[0, 1, 2], [3, 4]], [5, 5, 5, 3, 3], [4, 4, 4, 1, 2], max_token_len=13)
    assert units == [[0, 1], [2], [3, 4]] and tokens == [13, 9, 6]
    assert shared_units([[0, 1, 2]], [5] * 3, [1] * 3, max_rows=2)[0] == [[0, 1], [2]]
    assert pack_units_by_rows([2, 3, 1, 4], 4) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        shared_units([[0]], [5], [9], max_token_len=13)
    assert balance_units_across_ranks([[0, 1], [2, 3], [4]], [5, 5, 3], 2) is None  # unequal sizes: rows
    parts = balance_units_across_ranks([[0, 1], [2, 3], [4, 5], [6, 7]], [9, 3, 3, 9], 2)
    assert sorted(len(p) for p in parts) == [4, 4] and sorted(sum(parts, [])) == list(range(8))


def test_config_needs_remove_padding():
    from rlpad.recipe.load import load_config

    with pytest.raises(ValueError, match="share_prompts=true needs actor_rollout_ref.model.use_remove_padding"):
        load_config("recipes/grpo_tiny.yaml", ["actor_rollout_ref.model.share_prompts=true",
                                               "actor_rollout_ref.model.use_remove_padding=false"])
    with pytest.raises(ValueError, match="critic.model.share_prompts=true needs"):
        load_config("recipes/grpo_tiny.yaml", ["critic.model.share_prompts=true", "critic.model.use_remove_padding=false"])
    assert load_config("recipes/grpo_tiny.yaml", ["actor_rollout_ref.model.share_prompts=true"]).actor_rollout_ref.model.share_prompts


@pytest.mark.parametrize("dynamic", [False, True], ids=["rows", "budget"])
def test_world1_update_equals_rmpad_and_micro_batches_keep_groups(dynamic):
    batch = shared_batch(3, shuffle=True)
    grads, metrics = {}, {}
    for share in (False, True):
        worker = ActorWorker(config(share, dynamic), device="cpu")
        worker.init_model()
        if share:  # the update's micro-batches (ppo_micro_batch_size_per_gpu=4 or ppo_max_token_len_per_gpu=24)
            parts = micro_batches(batch, 4, 24 if dynamic else None, share_prompts=True)
            pieces = [batch.index(p) for p in parts]
            assert len(pieces) >= 2  # several micro-batches
            for piece in pieces:  # each micro-batch holds whole groups (no prompt is split)
                assert sum(len(g) for g in prompt_groups(piece["input_ids"], piece["attention_mask"], None, R)) == len(piece)
            sizes = sorted(len(g) for p in pieces for g in prompt_groups(p["input_ids"], p["attention_mask"], None, R))
            assert sizes == [N] * GROUPS
        out = worker.update_actor(batch, return_grads=True)
        grads[share], metrics[share] = out.pop("grads"), out
        worker.shutdown()
    for k, g in grads[False].items():
        rel = float((grads[True][k] - g).norm() / g.norm())
        assert rel <= FP32_GRAD_REL, f"{k}: relative {rel:.2e}"  # derivations: rlpad/embedded/exactness.py
    assert metrics[True]["actor/pg_loss"] == pytest.approx(metrics[False]["actor/pg_loss"], rel=RUN_REL, abs=RUN_ABS)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def test_two_rank_group_keeps_groups_whole_and_matches_single_process(ray_session):
    group = WorkerGroup(ActorWorker, config(True), role="actor", world_size=2, device="cpu")
    try:
        batch = shared_batch(5, shuffle=True)
        parts = group.split(batch)
        assert sorted(len(p) for p in parts) == [GROUPS * N // 2] * 2
        for rows in parts:  # whole groups on each rank
            sub = batch.index(rows)
            assert sorted(len(g) for g in groups_of(sub)) == [N] * (GROUPS // 2)
        out = group.call_batch("compute_log_prob", batch)
        model = load_causal_lm("tiny:qwen2")
        model.load_state_dict(group.call("full_state_dict")[0])
        with torch.no_grad():
            ref, ref_ent = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                             R, use_remove_padding=True, calculate_entropy=True)  # fmt: skip
        assert (out["old_log_probs"] - ref).abs().max() <= FP32_LOGPROB_TOL
        assert (out["entropy"] - ref_ent).abs().max() <= FP32_LOGPROB_TOL
        metrics = group.call_batch("update_actor", batch, chunk_rows=GROUPS * N)
        assert math.isfinite(metrics["actor/pg_loss"])
    finally:
        group.shutdown()
