"""rlpad.algorithms.losses and rlpad.algorithms.estimators against hand-worked numbers and independent plain-Python loops."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
import torch

from rlpad.algorithms.estimators import compute_gae_advantages, compute_grpo_advantages
from rlpad.algorithms.losses import (
    agg_loss,
    batch_normalizers,
    compute_policy_loss,
    compute_value_loss,
    kl_penalty,
    masked_mean,
    masked_whiten,
)

F64 = torch.float64
# verl's group of one: std is a float32 tensor(1.0), so 1 + 1e-6 is rounded to float32.
ONE_EPS = float(np.float32(1.0) + np.float32(1e-6))


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def outcome_rewards(scores, lengths, width):
    """Score on the last valid token of each row (design.md step 3)."""
    r = torch.zeros(len(scores), width, dtype=F64)
    m = torch.zeros(len(scores), width, dtype=torch.int64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        m[i, :n] = 1
        if n:
            r[i, n - 1] = s
    return r, m


# ----------------------------------------------------------------------------- GRPO


def test_grpo_hand_example_mixed_ids_and_group_of_one():
    # group "a": scores 1, 0, 1 -> mean 2/3, unbiased std sqrt(1/3); group 7: a single row.
    rewards, mask = outcome_rewards([1.0, 0.0, 0.5, 1.0], [3, 2, 1, 4], width=4)
    ids = np.array(["a", "a", 7, "a"], dtype=object)
    adv, ret = compute_grpo_advantages(rewards, mask, ids)
    std = math.sqrt(1 / 3)
    expected_row = [(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), 0.5 / ONE_EPS, (1 / 3) / (std + 1e-6)]
    for i, (a, n) in enumerate(zip(expected_row, [3, 2, 1, 4])):
        assert adv[i, :n].tolist() == pytest.approx([a] * n, abs=1e-12)
        assert adv[i, n:].abs().sum() == 0
    assert torch.equal(adv, ret)


def test_grpo_all_equal_scores_give_zero():
    rewards, mask = outcome_rewards([0.7] * 4, [2, 3, 1, 4], width=4)
    adv, _ = compute_grpo_advantages(rewards, mask, [0, 0, 0, 0])
    assert adv.abs().max() == 0


def test_grpo_dr_grpo_no_std():
    rewards, mask = outcome_rewards([3.0, 1.0, 2.0, 10.0, 0.0], [1, 1, 1, 2, 2], width=2)
    adv, _ = compute_grpo_advantages(rewards, mask, [1, 1, 1, 2, 2], norm_adv_by_std=False)
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 5.0, -5.0], abs=1e-12)
    assert adv[3:, 1].tolist() == pytest.approx([5.0, -5.0], abs=1e-12)


def test_grpo_empty_mask_row_counts_in_group_but_gets_no_advantage():
    rewards = t([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 1], [0, 0]])
    adv, _ = compute_grpo_advantages(rewards, mask, ["g", "g", "g"])
    mean, std = 1 / 3, statistics.stdev([1.0, 0.0, 0.0])
    assert adv[0].tolist() == pytest.approx([(1 - mean) / (std + 1e-6), 0.0])
    assert adv[1].tolist() == pytest.approx([-mean / (std + 1e-6)] * 2)
    assert adv[2].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["list", "numpy", "tensor"])
def test_grpo_matches_plain_loop(kind):
    rng = random.Random(0)
    n_rows, width = 24, 5
    gids = [rng.randrange(6) for _ in range(n_rows)]
    rewards = torch.tensor([[rng.uniform(-1, 1) for _ in range(width)] for _ in range(n_rows)], dtype=F64)
    mask = torch.tensor([[int(c < rng.randrange(width + 1)) for c in range(width)] for _ in range(n_rows)])
    ids = {"list": gids, "numpy": np.array(gids), "tensor": torch.tensor(gids)}[kind]
    for norm in (True, False):
        adv, _ = compute_grpo_advantages(rewards, mask, ids, norm_adv_by_std=norm, epsilon=1e-6)
        scores = [sum(row) for row in rewards.tolist()]
        for i in range(n_rows):
            group = [scores[j] for j in range(n_rows) if gids[j] == gids[i]]
            mean = statistics.fmean(group) if len(group) > 1 else 0.0
            std_eps = statistics.stdev(group) + 1e-6 if len(group) > 1 else ONE_EPS
            a = (scores[i] - mean) / std_eps if norm else scores[i] - mean
            assert adv[i].tolist() == pytest.approx([a * m for m in mask[i].tolist()], abs=1e-9)


def test_grpo_bad_input():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0], [1, 1, 1], width=2)
    with pytest.raises(ValueError, match="group 'b' has 1 rows, expected 2"):
        compute_grpo_advantages(rewards, mask, ["a", "a", "b"], expected_group_size=2)
    bad = rewards.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"token_level_rewards contains NaN or inf \(rows \[1\]\)"):
        compute_grpo_advantages(bad, mask, [0, 0, 0])
    bad[1, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        compute_grpo_advantages(bad, mask, [0, 0, 0])
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        compute_grpo_advantages(rewards, mask, [0, 0])
    with pytest.raises(ValueError, match="mismatched shapes"):
        compute_grpo_advantages(rewards, mask[:, :1], [0, 0, 0])
    with pytest.raises(TypeError, match="not hashable"):
        compute_grpo_advantages(rewards, mask, [[0], [0], [1]])
    with pytest.raises(TypeError, match="token_level_rewards must be a torch.Tensor"):
        compute_grpo_advantages(rewards.tolist(), mask, [0, 0, 0])
    with pytest.raises(TypeError, match="group_ids"):
        compute_grpo_advantages(rewards, mask, 5)


# ----------------------------------------------------------------------------- GAE / whitening


def test_gae_hand_example():
    # One row, the last token is padding. gamma 0.9, lam 0.8.
    # t=1: delta = 1 - 0.2 = 0.8 -> A1 = 0.8.  t=0: delta = 0.9*0.2 - 0.5 = -0.32 -> A0 = -0.32 + 0.72*0.8.
    rewards, values, mask = t([[0.0, 1.0, 0.0]]), t([[0.5, 0.2, 9.0]]), torch.tensor([[1, 1, 0]])
    adv, ret = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    raw = [-0.32 + 0.72 * 0.8, 0.8, 0.0]
    assert ret[0].tolist() == pytest.approx([raw[0] + 0.5, 1.0, 0.0], abs=1e-12)  # 0 off the mask
    mean = (raw[0] + raw[1]) / 2
    var = ((raw[0] - mean) ** 2 + (raw[1] - mean) ** 2) / (2 - 1)
    assert adv[0].tolist() == pytest.approx([(x - mean) / math.sqrt(var + 1e-8) for x in raw[:2]] + [0.0], abs=1e-9)
    assert adv[0, 2].item() == 0.0 and ret[0, 2].item() == 0.0


def gae_plain(rewards, values, mask, gamma, lam):
    """Independent per-row loop: masked tokens (padding, multi-turn tool output) are skipped and 0."""
    adv_rows, ret_rows = [], []
    for r, v, m in zip(rewards, values, mask):
        adv = [0.0] * len(r)
        next_v, last = 0.0, 0.0
        for i in reversed(range(len(r))):
            a = r[i] + gamma * next_v - v[i] + gamma * lam * last
            if m[i]:
                next_v, last = v[i], a
            adv[i] = last
        adv_rows.append(adv)
        ret_rows.append([a + x for a, x in zip(adv, v)])
    valid = [a for row, mr in zip(adv_rows, mask) for a, mm in zip(row, mr) if mm]
    mean, var = statistics.fmean(valid), statistics.variance(valid)
    white = [[(a - mean) / math.sqrt(var + 1e-8) * mm for a, mm in zip(row, mr)] for row, mr in zip(adv_rows, mask)]
    return white, [[x * mm for x, mm in zip(row, mr)] for row, mr in zip(ret_rows, mask)]


# An int mask makes the whitening counts float32 (torch's default dtype), as in verl.
@pytest.mark.parametrize("mask_dtype, rel", [(F64, 1e-8), (torch.int64, 1e-6)])
def test_gae_matches_plain_loop_with_interior_gaps(mask_dtype, rel):
    rng = random.Random(1)
    rows, width = 6, 8
    rewards = [[rng.uniform(-1, 1) for _ in range(width)] for _ in range(rows)]
    values = [[rng.uniform(-1, 1) for _ in range(width)] for _ in range(rows)]
    mask = [[int(rng.random() < 0.7) for _ in range(width)] for _ in range(rows)]
    mask[2] = [0] * width  # an empty row
    adv, ret = compute_gae_advantages(t(rewards), t(values), t(mask, mask_dtype), gamma=0.95, lam=0.9)
    exp_adv, exp_ret = gae_plain(rewards, values, mask, 0.95, 0.9)
    assert adv.tolist() == [pytest.approx(row, rel=rel, abs=1e-12) for row in exp_adv]
    assert ret.tolist() == [pytest.approx(row, abs=1e-12) for row in exp_ret]


def test_gae_bad_input():
    r, v, m = t([[1.0, 2.0]]), t([[0.0, 0.0]]), torch.tensor([[1, 0]])
    with pytest.raises(ValueError, match="at least 2 valid entries"):
        compute_gae_advantages(r, v, m, 1.0, 1.0)
    with pytest.raises(ValueError, match="values contains NaN"):
        compute_gae_advantages(r, t([[0.0, float("nan")]]), m, 1.0, 1.0)
    with pytest.raises(ValueError, match="mismatched shapes"):
        compute_gae_advantages(r, t([[0.0]]), m, 1.0, 1.0)
    with pytest.raises(TypeError, match="gamma"):
        compute_gae_advantages(r, v, m, "0.9", 1.0)


def test_masked_mean_and_whiten_hand():
    x, m = t([[1.0, 2.0, 100.0], [3.0, 4.0, -7.0]]), torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_mean(x, m).item() == pytest.approx(2.5)
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 3.5])
    w = masked_whiten(x, m)
    sd = math.sqrt(5 / 3 + 1e-8)  # unbiased var of 1, 2, 3, 4 is 5/3
    assert w[:, :2].flatten().tolist() == pytest.approx([-1.5 / sd, -0.5 / sd, 0.5 / sd, 1.5 / sd])
    assert masked_whiten(x, m, shift_mean=False)[0, 0].item() == pytest.approx(-1.5 / sd + 2.5)


# ----------------------------------------------------------------------------- policy loss


def test_policy_loss_hand_example_with_dual_clip():
    # A = +1, +1, -1, -1; ratios 1.5 (clipped to 1.2), 0.9 (inside), 0.5 (clipped to 0.8),
    # 4.0 (PPO keeps 4, dual clip caps it at c = 3).
    old = torch.zeros(1, 4, dtype=F64)
    logp = torch.log(t([[1.5, 0.9, 0.5, 4.0]])).requires_grad_()
    adv, mask = t([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4)
    loss, metrics = compute_policy_loss(old, logp, adv, mask, 0.2, 0.2, 3.0)
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 0.8 + 3.0) / 4)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(1.5 * 0.9 * 0.5 * 4.0) / 4)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    loss.backward()
    # Only the unclipped token has a gradient: d(-A * ratio)/dlogp / 4 = -0.9 / 4.
    assert logp.grad.tolist() == [pytest.approx([0.0, -0.9 / 4, 0.0, 0.0])]


def test_policy_loss_asymmetric_clip_and_ratio_clamp():
    old = torch.zeros(1, 3, dtype=F64)
    logp = t([[math.log(1.25), 50.0, math.log(0.7)]])
    adv, mask = t([[1.0, 1.0, -1.0]]), torch.ones(1, 3)
    loss, m = compute_policy_loss(old, logp, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.28)
    # 1.25 < 1.28 not clipped; exp(clamp(50)) = e^20 clipped to 1.28; 0.7 clipped up to 0.9 for A < 0.
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.9) / 3)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)
    assert m["ppo_kl"].item() == pytest.approx(-(math.log(1.25) + 20.0 + math.log(0.7)) / 3)


def test_policy_loss_ignores_masked_tokens_even_nan_log_probs():
    old, adv = torch.zeros(2, 2, dtype=F64), t([[1.0, 5.0], [2.0, 3.0]])
    logp = t([[0.0, float("nan")], [0.0, 0.0]]).requires_grad_()
    mask = torch.tensor([[1, 0], [1, 1]])
    loss, m = compute_policy_loss(old, logp, adv, mask)
    assert loss.item() == pytest.approx(-(1 + 2 + 3) / 3)
    assert m["pg_clipfrac"].item() == 0.0
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_policy_loss_bad_input():
    z, mask = torch.zeros(2, 3), torch.ones(2, 3)
    adv = torch.zeros(2, 3)
    adv[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"advantages contains NaN or inf \(rows \[1\]\)"):
        compute_policy_loss(z, z, adv, mask)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(z, z, z, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token-max'"):
        compute_policy_loss(z, z, z, mask, loss_agg_mode="token-max")
    with pytest.raises(ValueError, match="mismatched shapes: log_prob"):
        compute_policy_loss(z, torch.zeros(2, 4), z, mask)
    with pytest.raises(TypeError, match="advantages must be a torch.Tensor"):
        compute_policy_loss(z, z, [[0.0] * 3] * 2, mask)
    with pytest.raises(ValueError, match="global_tokens must be > 0"):
        compute_policy_loss(z, z, z, mask, global_tokens=0)
    with pytest.raises(TypeError, match="global_seqs"):
        compute_policy_loss(z, z, z, mask, global_seqs="3")


# ----------------------------------------------------------------------------- agg_loss


LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # the last row is empty: it never counts


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, (1 + 2 + 4) / 3),
        ("token-mean", {"global_tokens": 10}, 7 / 10),
        ("seq-mean-token-sum", {}, (3 + 4) / 2),
        ("seq-mean-token-sum", {"global_seqs": 7}, 7 / 7),
        ("seq-mean-token-mean", {}, (1.5 + 4) / 2),
        ("seq-mean-token-mean", {"global_seqs": 5.5}, 5.5 / 5.5),
        ("seq-mean-token-sum-norm", {}, (3 + 4) / 2 / 3),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 7}, (3 + 4) / 2 / 7),
        ("seq-mean-token-sum-norm", {"global_seqs": 4, "loss_scale_factor": 7}, (3 + 4) / 4 / 7),
        ("token-sum", {}, 1 + 2 + 4),
        ("token-sum", {"global_tokens": 10, "global_seqs": 4}, 1 + 2 + 4),  # no normaliser
    ],
)
def test_agg_loss_hand(mode, kwargs, expected):
    assert agg_loss(t(LOSS), torch.tensor(MASK), mode, **kwargs).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                                  "token-sum"])
def test_agg_loss_all_masked_is_zero_and_masked_nan_is_dropped(mode):
    loss = t(LOSS)
    loss[2, 2] = float("nan")
    assert agg_loss(loss, torch.zeros(3, 3), mode).item() == 0.0
    assert math.isfinite(agg_loss(loss, torch.tensor(MASK), mode).item())


def test_agg_loss_bad_mode_and_tensor_normaliser():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        agg_loss(t(LOSS), torch.tensor(MASK), "mean")
    # A normaliser may be a (reduced) tensor, as an all-reduce leaves it.
    assert agg_loss(t(LOSS), torch.tensor(MASK), "token-mean", global_tokens=t(14.0)).item() == pytest.approx(0.5)


# ----------------------------------------------------------------------------- value loss


def test_value_loss_hand():
    # c = 0.2 around 0.5: clip to [0.3, 0.7]. Token 0: (1-1)^2 = 0 vs (0.7-1)^2 = 0.09 -> clipped wins.
    values = t([[1.0, 2.0, 0.0]]).requires_grad_()
    old, ret, mask = t([[0.5, 0.5, 0.5]]), t([[1.0, 0.0, 3.0]]), torch.ones(1, 3)
    loss, m = compute_value_loss(values, old, ret, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.09 + 4.0 + 9.0) / 3)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # Token 0's loss comes from the clipped value: no gradient; others 0.5 * 2 (v - R) / 3.
    assert values.grad.tolist() == [pytest.approx([0.0, 2.0 / 3, -3.0 / 3])]
    loss_sum, _ = compute_value_loss(values, old, ret, mask, 0.2, "seq-mean-token-sum")
    assert loss_sum.item() == pytest.approx(0.5 * 13.09)


def test_value_loss_bad_input():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="returns contains NaN"):
        compute_value_loss(z, z, t([[0.0, float("inf")]], torch.float32), z + 1, 0.2)
    with pytest.raises(ValueError, match="mismatched shapes: old_values"):
        compute_value_loss(z, torch.zeros(2, 2), z, z, 0.2)


# ----------------------------------------------------------------------------- KL


LP, REF = [-1.0, 0.5, 0.0, -40.0], [-0.5, -0.5, 30.0, 0.0]


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (("kl", "k1"), [-0.5, 1.0, -30.0, -40.0]),
        (("abs",), [0.5, 1.0, 30.0, 40.0]),
        (("mse", "k2"), [0.125, 0.5, 450.0, 800.0]),
        # exp(x) - x - 1 of x = ref - lp, x clamped to [-20, 20], result clamped to [-10, 10].
        (("low_var_kl", "k3"), [math.exp(0.5) - 1.5, math.exp(-1.0), 10.0, 10.0]),
    ],
)
def test_kl_kinds_hand(kinds, expected):
    for kind in kinds:
        assert kl_penalty(t(LP), t(REF), kind).tolist() == pytest.approx(expected)


def test_kl_low_var_clamps_and_straight_through():
    lp = t([-3.0, 0.0, 2.0]).requires_grad_()
    ref = t([0.0, -25.0, 2.5])
    out = kl_penalty(lp, ref, "k3+")
    # x = ref - lp = 3 -> e^3 - 4 = 16.1 -> 10; x = -25 -> -20 -> e^-20 + 19 -> 10; x = 0.5 stays.
    assert out.tolist() == pytest.approx([10.0, 10.0, math.exp(0.5) - 1.5])
    out.sum().backward()
    assert lp.grad.tolist() == pytest.approx((lp - ref).tolist())  # the k2 gradient
    with pytest.raises(ValueError, match="unknown kl kind 'full'"):
        kl_penalty(lp, ref, "full")
    with pytest.raises(ValueError, match="mismatched shapes"):
        kl_penalty(lp, ref[:2], "kl")
    with pytest.raises(TypeError):
        kl_penalty(lp, ref, 3)


# ----------------------------------------------------------------------------- loss scaling


def make_batch(seed=0, rows=12, width=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[3] = 0  # an empty row
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return {
        "old": torch.randn(rows, width, generator=g, dtype=F64) * 0.3,
        "logp": torch.randn(rows, width, generator=g, dtype=F64) * 0.3,
        "adv": torch.randn(rows, width, generator=g, dtype=F64),
        "mask": mask,
        "values": torch.randn(rows, width, generator=g, dtype=F64),
        "returns": torch.randn(rows, width, generator=g, dtype=F64),
    }


SPLITS = [
    [list(range(12))],  # the full batch
    [[0, 5], [1, 2, 3, 4], [6], [7, 8, 9, 10, 11]],  # four uneven micro-batches
    [[11, 3], [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]],  # out of order, one holding the empty row
]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                                  "token-sum"])
@pytest.mark.parametrize("split", SPLITS[1:])
def test_micro_batches_with_global_normalisers_sum_to_full_batch(mode, split):
    b = make_batch()
    norm = batch_normalizers(b["mask"])
    assert norm == {"global_tokens": float(b["mask"].sum()), "global_seqs": float((b["mask"].sum(-1) > 0).sum())}

    def run(pieces):
        logp = b["logp"].clone().requires_grad_()
        values = b["values"].clone().requires_grad_()
        total, metrics = 0.0, {}
        for idx in pieces:
            idx = torch.tensor(idx)
            piece_norm = {k: sum(batch_normalizers(b["mask"][torch.tensor(p)])[k] for p in pieces) for k in norm}
            assert piece_norm == norm  # summing the pieces' counts gives the global ones
            pg, m = compute_policy_loss(
                b["old"][idx], logp[idx], b["adv"][idx], b["mask"][idx], 0.2, 0.28, 3.0, mode, **piece_norm
            )
            vf, vm = compute_value_loss(
                values[idx], b["old"][idx], b["returns"][idx], b["mask"][idx], 0.5, mode, **norm
            )
            kl = agg_loss(kl_penalty(logp[idx], b["old"][idx], "low_var_kl"), b["mask"][idx], mode, **norm)
            loss = pg + 0.5 * vf + 0.1 * kl
            loss.backward()
            total = total + loss.detach()
            for k, v in {**m, **vm}.items():  # shares sum over the pieces, *_max metrics take the max
                metrics[k] = torch.maximum(metrics[k], v) if k.endswith("_max") and k in metrics else (
                    v if k.endswith("_max") else metrics.get(k, 0.0) + v)
        return total, logp.grad, values.grad, metrics

    full_loss, full_g, full_vg, full_m = run(SPLITS[0])
    loss, g, vg, m = run(split)
    assert loss.item() == pytest.approx(full_loss.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(g, full_g, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(vg, full_vg, rtol=1e-12, atol=1e-15)
    for k in full_m:
        assert m[k].item() == pytest.approx(full_m[k].item(), rel=1e-6)  # clip fractions are float32
    # The full batch with global normalisers equals the plain (local) full-batch loss.
    local, _ = compute_policy_loss(b["old"], b["logp"], b["adv"], b["mask"], 0.2, 0.28, 3.0, mode)
    glob, _ = compute_policy_loss(b["old"], b["logp"], b["adv"], b["mask"], 0.2, 0.28, 3.0, mode, **norm)
    assert glob.item() == pytest.approx(local.item(), rel=1e-12)


def test_local_normalisation_would_depend_on_split():
    """Sanity: without the global counts, averaging micro-batch means gives another gradient."""
    b = make_batch()
    grads = []
    for pieces in (SPLITS[0], SPLITS[1]):
        logp = b["logp"].clone().requires_grad_()
        for idx in map(torch.tensor, pieces):
            pg, _ = compute_policy_loss(b["old"][idx], logp[idx], b["adv"][idx], b["mask"][idx])
            (pg / len(pieces)).backward()
        grads.append(logp.grad)
    assert not torch.allclose(grads[0], grads[1])
