"""Policy-loss modes (actor_rollout_ref.actor.policy_loss.loss_mode): each equals verl 0.9.1's formula,
re-derived here in fp64 from verl's core_algos (compute_policy_loss_<mode>), on random inputs; each
differs from vanilla (so a fall-back to vanilla fails); the config refuses what does not compose; the
actor worker runs the configured mode."""

import dataclasses

import pytest
import torch

from rlpad.config.schema import ActorConfig, ActorRolloutRefConfig, BypassCorrectionConfig, PolicyLossConfig
from rlpad.recipe.load import load_config
from rlpad.embedded.synthetic import ppo_batch
from rlpad.algorithms.policy_loss import POLICY_LOSSES, get_policy_loss
from workers.actor import ActorWorker

B, R = 7, 11
LOW, HIGH, C = 0.2, 0.28, 3.0


# ----------------------------------------------------------------------------- the references (fp64)


def _msum(x, m, dim=None):
    return (x * m).sum() if dim is None else (x * m).sum(dim=dim)


def _mmean(x, m):
    return _msum(x, m) / (m.sum() + 1e-8)


def ref_agg(mat, m, mode, tokens=None, seqs=None):
    """verl's agg_loss with dp_size 1 (batch_num_tokens / global_batch_size = the given counts);
    seq-mean-token-sum-norm as rlpad defines it (seq-mean / R: Dr.GRPO, verl <= 0.6 omitted the seq-mean)."""
    rows = (m.sum(-1) > 0).double()
    if mode == "token-sum":
        return _msum(mat, m)
    if mode == "token-mean":
        return _msum(mat, m) / (m.sum() if tokens is None else tokens)
    if mode == "seq-mean-token-sum":
        return (_msum(mat, m, -1) * rows).sum() / (rows.sum() if seqs is None else seqs)
    if mode == "seq-mean-token-mean":
        return (_msum(mat, m, -1) / (m.sum(-1) + 1e-8) * rows).sum() / (rows.sum() if seqs is None else seqs)
    return (_msum(mat, m, -1) * rows).sum() / (rows.sum() if seqs is None else seqs) / m.shape[-1]


def ref_vanilla(old, lp, adv, m, pl, agg, w, **norms):
    r = torch.exp(torch.clamp(lp - old, -20, 20))
    l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - LOW, 1 + HIGH)
    mx = torch.maximum(l1, l2)
    loss = torch.where(adv < 0, torch.minimum(-adv * C, mx), mx)
    return ref_agg(loss * (1 if w is None else w), m, agg, **norms)


def ref_gspo(old, lp, adv, m, pl, agg, w, **norms):
    seq = ((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    s = torch.exp(torch.clamp(lp - lp.detach() + seq.detach()[:, None], max=10.0))
    loss = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - LOW, 1 + HIGH))
    return ref_agg(loss * (1 if w is None else w), m, agg, **norms)


def ref_cispo(old, lp, adv, m, pl, agg, w, **norms):
    r = torch.exp(torch.clamp(lp - old, -20, 20))
    loss = -torch.clamp(r, 1 - LOW, 1 + HIGH).detach() * adv * lp
    return ref_agg(loss * (1 if w is None else w), m, agg, **norms)


def ref_geo_mean(old, lp, adv, m, pl, agg, w, tokens=None, seqs=None):
    d = lp - old
    sg = torch.sign(adv)
    dmin = sg * torch.minimum(sg * d, sg * torch.clamp(d, -LOW, HIGH))
    n = m.sum(-1)
    row = -((adv * m).sum(-1) / (n + 1e-8)) * torch.exp((dmin * m).sum(-1) / (n + 1e-8))
    if w is not None:
        row = row * torch.exp((torch.log(w + 1e-10) * m).sum(-1) / (n + 1e-8))
    return row.sum() / (len(row) if seqs is None else seqs)  # torch.mean over the micro-batch's rows


def ref_clip_cov(old, lp, adv, m, pl, agg, w, **norms):
    r = torch.exp(lp - old)
    l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - LOW, 1 + HIGH)
    cov = (adv - _mmean(adv, m)) * (lp - _mmean(lp.detach(), m))
    cov = cov.detach().clone()
    cov[m == 0] = -torch.inf
    cov[(l2 > l1) & (m > 0)] = -torch.inf
    k = max(int(pl.clip_cov_ratio * m.sum().item()), 1)
    idx = torch.nonzero((cov < pl.clip_cov_ub) & (cov > pl.clip_cov_lb) & (m > 0))
    corr = torch.ones_like(adv)
    if len(idx):
        idx = idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(7))[:min(k, len(idx))]]
        corr[idx[:, 0], idx[:, 1]] = 0
    return ref_agg(torch.maximum(l1, l2) * corr * (1 if w is None else w), m, agg, **norms)


def ref_kl_cov(old, lp, adv, m, pl, agg, w, **norms):
    d = lp - old
    loss = -adv * torch.exp(d)
    loss_kl = loss + pl.ppo_kl_coef * d.abs()
    valid = m > 0
    a, p = adv[valid].detach(), lp[valid].detach()
    cov = (a - a.mean()) * (p - p.mean())
    top = torch.topk(cov, max(1, int(len(cov) * pl.kl_cov_ratio))).indices
    flat = torch.nonzero(valid.reshape(-1))[:, 0][top]
    pick = torch.zeros(adv.numel(), dtype=torch.bool)
    pick[flat] = True
    out = torch.where(pick.view_as(adv), loss_kl, loss)
    return ref_agg(out * (1 if w is None else w), m, agg, **norms)


REFS = {"vanilla": ref_vanilla, "gspo": ref_gspo, "cispo": ref_cispo, "geo_mean": ref_geo_mean,
        "clip_cov": ref_clip_cov, "kl_cov": ref_kl_cov}
PARAMS = PolicyLossConfig(clip_cov_ratio=0.1, clip_cov_lb=0.2, clip_cov_ub=3.0, kl_cov_ratio=0.1, ppo_kl_coef=0.5,
                          dro_beta=0.7, rollout_correction=BypassCorrectionConfig(loss_type="reinforce", rollout_is="token"))


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, R + 1, (B,), generator=g)
    m = (torch.arange(R)[None] < lengths[:, None]).double()
    old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3 - 0.05
    lp = (old + torch.randn(B, R, generator=g, dtype=torch.float64) * 0.4).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, R) * m  # a sequence-level advantage
    adv = adv + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64) * m
    w = (torch.rand(B, R, generator=g, dtype=torch.float64) * 1.5 + 0.25) * m
    return old, lp, adv, m, w


def run(fn, mode, agg, with_w, norms, seed):
    old, lp, adv, m, w = inputs(seed)
    actor = ActorConfig(clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C, loss_agg_mode=agg,
                        policy_loss=dataclasses.replace(PARAMS, loss_mode=mode))
    kw = dict(global_tokens=norms.get("tokens"), global_seqs=norms.get("seqs"),
              rollout_is_weights=w if with_w else None, generator=torch.Generator().manual_seed(7))
    if fn is None:
        loss, metrics = get_policy_loss(mode)(old, lp, adv, m, actor, **kw)
    else:
        loss, metrics = fn(old, lp, adv, m, actor.policy_loss, agg, w if with_w else None, **norms), {}
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


# the modes with a formula here; every mode verl registers is also compared with verl's own function
# (tests/test_verl_parity.py), clip_cov only here (verl draws its tokens from the global RNG)
CASES = [(mode, agg) for mode, entry in POLICY_LOSSES.items() for agg in entry.agg_modes if mode in REFS]


@pytest.mark.parametrize("mode,agg", CASES)
def test_each_mode_equals_verls_formula(mode, agg):
    for seed, with_w, norms in ((0, False, {}), (1, True, {}), (2, True, {"tokens": 53.0, "seqs": 9.0})):
        loss, grad, metrics = run(None, mode, agg, with_w, norms, seed)
        ref_loss, ref_grad, _ = run(REFS[mode], mode, agg, with_w, norms, seed)
        assert rel(loss, ref_loss) <= 1e-12 and rel(grad, ref_grad) <= 1e-12, (mode, agg, seed)
        assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "log_ratio_abs_max"}
        if mode in ("clip_cov", "kl_cov"):  # the covariance selection picked tokens (else it is vanilla-like)
            assert metrics["pg_clipfrac"] > 0
        if mode != "vanilla":  # a fall-back to vanilla would fail here: the loss or its gradient differ
            van_loss, van_grad, _ = run(None, "vanilla", agg, with_w, norms, seed)
            assert rel(loss, van_loss) > 1e-3 or rel(grad, van_grad) > 1e-3, (mode, agg, seed)


def test_negative_control_a_perturbed_reference_is_caught():
    """The 1e-12 check can fail: each reference with clip_ratio_high 0.28 -> 0.2801 is caught, and
    clip_cov's choice depends on its random draw."""
    global HIGH
    for mode in ("vanilla", "gspo", "cispo", "geo_mean"):
        agg = POLICY_LOSSES[mode].agg_modes[-1]
        loss, grad, _ = run(None, mode, agg, False, {}, 0)
        HIGH, saved = 0.2801, HIGH
        try:
            ref, ref_grad, _ = run(REFS[mode], mode, agg, False, {}, 0)
        finally:
            HIGH = saved
        assert rel(loss, ref) > 1e-12 or rel(grad, ref_grad) > 1e-12, mode
    old, lp, adv, m, _ = inputs(0)
    actor = ActorConfig(clip_ratio_low=LOW, clip_ratio_high=HIGH,
                        policy_loss=dataclasses.replace(PARAMS, loss_mode="clip_cov", clip_cov_ratio=0.03))
    draws = {float(get_policy_loss("clip_cov")(old, lp, adv, m, actor, generator=torch.Generator().manual_seed(s))[0].detach())
             for s in range(6)}
    assert len(draws) > 1


def test_config_names_the_modes_and_refuses_what_does_not_compose():
    with pytest.raises(ValueError, match="policy_loss.loss_mode='ppo' is not valid; choose one of vanilla, gspo, "
                                         "cispo, geo_mean, clip_cov, kl_cov, dppo_tv, dppo_kl, sapo, gpg, dro, "
                                         "bypass_mode"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=ppo"])
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"):  # gspo: any, as verl
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                           f"actor_rollout_ref.actor.loss_agg_mode={agg}"])
    for mode in ("geo_mean", "sapo"):
        with pytest.raises(ValueError, match=f"loss_mode={mode} aggregates per sequence: set "
                                             "actor_rollout_ref.actor.loss_agg_mode to seq-mean-token-mean"):
            load_config(None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"])
        load_config(None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
                           "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                           "algorithm.rollout_correction.mode=seq_mask"])
    with pytest.raises(ValueError, match="policy_loss.clip_cov_lb=6.0 must be < clip_cov_ub=5.0"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.clip_cov_lb=6"])
    with pytest.raises(ValueError, match=r"policy_loss.kl_cov_ratio=0.0 must be a fraction in \(0, 1\]"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0"])
    with pytest.raises(ValueError, match="policy_loss.dro_beta=None must be > 0 with loss_mode=dro"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=dro"])
    load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"])
    bypass = "actor_rollout_ref.actor.policy_loss.rollout_correction"
    with pytest.raises(ValueError, match=f"unknown config key '{bypass}.rollout_rs'"):  # verl's rejection sampling: not here
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", f"{bypass}.rollout_rs=token"])
    with pytest.raises(ValueError, match=f"{bypass}.rollout_is_threshold='2_1': need 0 < L <= U"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", f"{bypass}.rollout_is_threshold=2_1"])
    with pytest.raises(ValueError, match=f"{bypass}.loss_type='ppo' is not valid"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", f"{bypass}.loss_type=ppo"])
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.tau_neg=0.0 must be > 0"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=0",
                           "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"])


def test_the_actor_worker_runs_the_configured_mode():
    """One update of a tiny actor per mode: its pg_loss is the mode's function on the worker's own
    log-probs (one mini-batch, one micro-batch), and differs from the vanilla worker's. bypass_mode reads
    the rollout's log-probs as the old policy's (verl's bypass), not ``old_log_probs``."""
    batch = ppo_batch(8, 8, 10, vocab_size=128, seed=3)
    noise = torch.randn(batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(5)) * 0.3
    batch["rollout_log_probs"] = (batch["old_log_probs"] + noise) * batch["response_mask"]
    losses = {}
    for mode in POLICY_LOSSES:
        cfg = ActorRolloutRefConfig()
        cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.rollout.n = 8, 8, 1
        cfg.actor.clip_ratio_high = HIGH
        cfg.actor.policy_loss = dataclasses.replace(PARAMS, loss_mode=mode, clip_cov_lb=0.0)
        if POLICY_LOSSES[mode].agg_modes != POLICY_LOSSES["vanilla"].agg_modes:
            cfg.actor.loss_agg_mode = "seq-mean-token-mean"
        w = ActorWorker(cfg, device="cpu")
        w.init_model()
        lp = w.compute_log_prob(batch, update_layout=True)["old_log_probs"].double()
        m = batch["response_mask"].double()
        generator = torch.Generator().manual_seed(w.seed * 1_000_003 + w.update_steps)
        old = batch["rollout_log_probs" if mode == "bypass_mode" else "old_log_probs"].double()
        expected, _ = get_policy_loss(mode)(old, lp, batch["advantages"].double(), m, cfg.actor, generator=generator)
        losses[mode] = w.update_actor(batch)["actor/pg_loss"]
        assert losses[mode] == pytest.approx(float(expected), rel=1e-5, abs=1e-7), mode
        if mode == "bypass_mode":  # negative control: with old_log_probs as the old policy the loss differs
            wrong, _ = get_policy_loss(mode)(batch["old_log_probs"].double(), lp, batch["advantages"].double(), m,
                                             cfg.actor)
            assert losses[mode] != pytest.approx(float(wrong), rel=1e-3)
    assert all(abs(losses[m] - losses["vanilla"]) > 1e-4 * abs(losses["vanilla"]) for m in losses if m != "vanilla")
