"""Rollout-vs-actor mismatch metrics and the token_tis / seq_mask corrections: hand-worked examples,
side by side with an independent re-implementation of verl's rollout-correction formulas on random
inputs, the policy-loss weighting, and input errors. The real-rollout checks are in test_rollout.py."""

import math

import numpy as np
import pytest
import torch

from rlpad.algorithms.losses import compute_policy_loss
from rlpad.recipe.load import load_config
from rlpad.algorithms.rollout_correction import (CORRECTION_MODES, apply_rollout_correction, log_prob_mismatch, seq_mask,
                                      token_tis_weights)

LN = math.log


def rows(*ds, base=-1.5, width=4):
    """(old, rollout, mask) with ``old - rollout = d`` on the given tokens of each row, padding after."""
    old = torch.zeros(len(ds), width, dtype=torch.float64)
    roll = torch.zeros_like(old)
    mask = torch.zeros(len(ds), width, dtype=torch.long)
    for i, d in enumerate(ds):
        for t, x in enumerate(d):
            roll[i, t] = base - 0.1 * t
            old[i, t] = roll[i, t] + x
            mask[i, t] = 1
    old[mask == 0] = float("nan")  # never read on padding
    return old, roll, mask


# ----------------------------------------------------------------------------- hand-worked examples


def test_mismatch_hand_example():
    old, roll, mask = rows([0.1, -0.2], [0.3])
    m = log_prob_mismatch(old, roll, mask)
    assert m["tokens"] == 3
    assert m["abs_diff_mean"] == pytest.approx(0.2, abs=1e-12)
    assert m["abs_diff_max"] == pytest.approx(0.3, abs=1e-12)
    # k3 = exp(d) - 1 - d: 0.005170918, 0.018730753, 0.049858808 -> mean 0.024586826
    assert m["k3_kl"] == pytest.approx(0.024586826, abs=1e-8)
    assert m["k3_kl"] > 0


def test_mismatch_pearson_and_edge_cases():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.ones(1, 3)
    assert log_prob_mismatch(old, old - 0.1, mask)["pearson"] == pytest.approx(1.0)
    assert log_prob_mismatch(old, old.flip(1), mask)["pearson"] == pytest.approx(-1.0)
    same = log_prob_mismatch(old, old.clone(), mask)
    assert same["abs_diff_max"] == 0 and same["k3_kl"] == 0 and same["pearson"] == pytest.approx(1.0)
    const = torch.full((1, 3), -2.0)
    assert log_prob_mismatch(const, const.clone(), mask)["pearson"] == 1.0
    assert log_prob_mismatch(const, const - 1, mask)["pearson"] == 0.0
    empty = log_prob_mismatch(old, old, torch.zeros(1, 3))
    assert empty["tokens"] == 0 and empty["abs_diff_max"] == 0


def test_token_tis_hand_example():
    # weights min(exp(d), 2): exp(ln 3)=3 -> 2 (clipped), 0.5, 1; row 2: 1.5
    old, roll, mask = rows([LN(3), LN(0.5), 0.0], [LN(1.5)])
    w, m = token_tis_weights(old, roll, mask, 2.0)
    expected = torch.tensor([[2.0, 0.5, 1.0, 0.0], [1.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(w, expected, atol=1e-12)
    assert m["clipped_token_frac"] == pytest.approx(1 / 4)
    assert m["weight_mean"] == pytest.approx((2 + 0.5 + 1 + 1.5) / 4)


def test_seq_mask_hand_example():
    # geometric-mean ratios exp(mean d): 3 (drop), 1 (keep), 0.4 (drop), 2 ** 0.9 (keep), exactly 2 (keep: inclusive)
    old, roll, mask = rows([LN(3), LN(3)], [LN(4), -LN(4)], [LN(0.16), 0.0], [0.9 * LN(2)], [LN(2)], [])
    new_mask, m = seq_mask(old, roll, mask, 2.0)
    assert new_mask.dtype == mask.dtype
    assert new_mask.sum(1).tolist() == [0, 2, 0, 1, 1, 0]
    assert torch.equal(new_mask[1], mask[1]) and torch.equal(new_mask[3], mask[3])
    assert m["masked_seq_frac"] == pytest.approx(2 / 5)  # of the 5 rows with a valid token
    assert m["masked_token_frac"] == pytest.approx(4 / 8)
    assert m["weight_mean"] == pytest.approx(4 / 8)
    assert m["seq_ratio_max"] == pytest.approx(3.0) and m["seq_ratio_min"] == pytest.approx(0.4)


def test_apply_modes():
    old, roll, mask = rows([LN(3), 0.0], [LN(0.3)])
    assert apply_rollout_correction(old, roll, mask, "none", 2.0) == (None, mask, {})
    w, m_tis, metrics = apply_rollout_correction(old, roll, mask, "token_tis", 2.0)
    assert m_tis is mask and w[0, 0] == 2.0 and "clipped_token_frac" in metrics
    w, m_seq, metrics = apply_rollout_correction(old, roll, mask, "seq_mask", 2.0)
    assert w is None and m_seq.sum(1).tolist() == [2, 0] and "masked_seq_frac" in metrics


# ----------------------------------------------------------------------------- against the anchor (verl)


def verl_token_is(old, roll, mask, c):
    """verl rollout_is="token": w = exp(clamp(old - rollout, -20, 20)) * mask, truncated at c (per token)."""
    out = np.zeros(old.shape)
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[i, t]:
                out[i, t] = min(math.exp(max(-20.0, min(20.0, old[i, t] - roll[i, t]))), c)
    return out


def verl_geometric_rs(old, roll, mask, c):
    """verl rollout_rs="geometric": w_seq = exp(clamp(masked mean of old - rollout, +-20)); keep
    a row iff 1/c <= w_seq <= c; the response mask is multiplied by the keep flag."""
    out = np.array(mask, dtype=np.float64)
    for i in range(old.shape[0]):
        ds = [old[i, t] - roll[i, t] for t in range(old.shape[1]) if mask[i, t]]
        mean = sum(ds) / (len(ds) + 1e-8) if ds else 0.0  # verl's masked_mean divides by count + 1e-8
        w = math.exp(max(-20.0, min(20.0, mean)))
        out[i] *= float(1.0 / c <= w <= c)
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("c", [1.2, 2.0, 5.0])
def test_against_verl_formulas_on_random_inputs(seed, c):
    gen = torch.Generator().manual_seed(seed)
    b, r = 16, 12
    roll = -torch.rand(b, r, generator=gen, dtype=torch.float64) * 4
    scale = torch.tensor([0.01, 0.3, 1.0, 30.0], dtype=torch.float64).repeat(4)[:, None]  # some rows past +-20
    old = roll + torch.randn(b, r, generator=gen, dtype=torch.float64) * scale
    lengths = torch.randint(1, r + 1, (b,), generator=gen)
    mask = (torch.arange(r) < lengths[:, None]).long()
    old_np, roll_np, mask_np = old.numpy(), roll.numpy(), mask.numpy()

    w, _ = token_tis_weights(old, roll, mask, c)
    np.testing.assert_allclose(w.numpy(), verl_token_is(old_np, roll_np, mask_np, c), rtol=1e-12, atol=0)
    new_mask, m = seq_mask(old, roll, mask, c)
    expected = verl_geometric_rs(old_np, roll_np, mask_np, c)
    assert np.array_equal(new_mask.numpy(), expected), "kept rows differ from verl's geometric rejection"
    assert 0 < m["masked_seq_frac"] < 1 or c == 5.0  # both outcomes occur for the tighter caps


# ----------------------------------------------------------------------------- the policy loss


def test_policy_loss_multiplies_each_token_term_by_detached_weights():
    gen = torch.Generator().manual_seed(0)
    b, r = 4, 6
    old = -torch.rand(b, r, generator=gen) * 3
    lp = (old + torch.randn(b, r, generator=gen) * 0.3).requires_grad_(True)
    adv = torch.randn(b, r, generator=gen)
    mask = (torch.arange(r) < torch.tensor([6, 3, 1, 4])[:, None]).float()
    w = (torch.rand(b, r, generator=gen) * 2).requires_grad_(True)
    loss_w, metrics = compute_policy_loss(old, lp, adv, mask, rollout_is_weights=w)
    # per-token PPO term, written out (low = high = 0.2, dual clip 3)
    ratio = torch.exp(lp - old)
    term = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    term = torch.where(adv < 0, torch.minimum(term, -adv * 3.0), term)
    expected = (term * w.detach() * mask).sum() / mask.sum()
    assert torch.allclose(loss_w, expected, atol=1e-6)
    loss_w.backward()
    assert w.grad is None  # the weights are not a gradient path
    g_lp = lp.grad.clone()
    lp.grad = None
    expected.backward()
    assert torch.allclose(g_lp, lp.grad, atol=1e-7)
    assert metrics["log_ratio_abs_max"] == pytest.approx(float(((lp.detach() - old).abs() * mask).max()))
    # unit weights give the uncorrected loss
    plain, _ = compute_policy_loss(old, lp, adv, mask)
    ones, _ = compute_policy_loss(old, lp, adv, mask, rollout_is_weights=torch.ones(b, r))
    assert torch.equal(plain, ones)


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_raise_before_compute():
    old, roll, mask = rows([0.1, 0.2])
    with pytest.raises(ValueError, match="unknown rollout correction mode 'tis'"):
        apply_rollout_correction(old, roll, mask, "tis", 2.0)
    with pytest.raises(ValueError, match="threshold must be > 1"):
        token_tis_weights(old, roll, mask, 1.0)
    with pytest.raises(TypeError, match="threshold must be a number"):
        seq_mask(old, roll, mask, "2")
    with pytest.raises(ValueError, match="mismatched shapes"):
        log_prob_mismatch(old, roll[:, :2], mask)
    with pytest.raises(TypeError, match="rollout_log_probs must be a torch.Tensor"):
        log_prob_mismatch(old, roll.tolist(), mask)
    bad = roll.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"rollout_log_probs contains NaN or inf on valid response tokens \(rows \[0\]\)"):
        token_tis_weights(old, bad, mask, 2.0)
    with pytest.raises(ValueError, match="rollout_is_weights contains NaN"):
        compute_policy_loss(old.nan_to_num(), roll, torch.zeros_like(roll), mask.float(),
                            rollout_is_weights=torch.full_like(roll, float("nan")))
    assert CORRECTION_MODES == ("none", "token_tis", "seq_mask")


def test_config_keys_validated():
    cfg = load_config(None, ["algorithm.rollout_correction.mode=token_tis", "algorithm.rollout_correction.threshold=3"])
    assert cfg.algorithm.rollout_correction.threshold == 3.0
    assert cfg.actor_rollout_ref.actor.old_log_prob_layout == "update"
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction.mode='icepop' is not valid"):
        load_config(None, ["algorithm.rollout_correction.mode=icepop"])
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction.threshold=0.5 must be > 1"):
        load_config(None, ["algorithm.rollout_correction.threshold=0.5"])
    with pytest.raises(ValueError, match=r"old_log_prob_layout='rows' is not valid"):
        load_config(None, ["actor_rollout_ref.actor.old_log_prob_layout=rows"])
