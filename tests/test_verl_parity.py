"""rlpad against verl 0.9.1's own functions: every policy-loss mode verl registers (loss and gradient,
fp64, every aggregation it honours, with and without rollout weights, global normalisers) and the
default reward on responses shaped like verl's data sets.

verl's numbers come from scripts/verl_parity.py (run in verl's own environment): recorded in
tests/fixtures/verl_parity.json (always compared) and re-run live when ``$RLPAD_VERL_PYTHON`` names a
Python with verl installed, or verl is importable here (then compared too; without verl the live
test is skipped, the recorded one still runs).
"""

from __future__ import annotations


import pytest
import torch

from rlpad.algorithms.policy_loss import POLICY_LOSSES, get_policy_loss
from rlpad.config.schema import ActorConfig, BypassCorrectionConfig, PolicyLossConfig
from rlpad.rewards import rules, verl_default
from rlpad.rewards.rules import load_reward_fn
from verl_peer import RecordedPeer

BOUND = 1e-12


PEER = RecordedPeer("verl_parity.json", "verl_parity.py")
record, recorded, sources = PEER.record, PEER.recorded, PEER.sources


# ----------------------------------------------------------------------------- policy losses


def rlpad_loss(rec: dict, case: dict, mode: str | None = None, **actor_changes) -> tuple[torch.Tensor, torch.Tensor]:
    """rlpad's loss and d loss / d log_prob on the case's inputs (fp64); ``mode`` overrides the case's."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in rec["inputs"][str(case["seed"])].items()}
    lp = t["log_prob"].clone().requires_grad_(True)
    rc = BypassCorrectionConfig(**case["rollout_correction"]) if case["rollout_correction"] else BypassCorrectionConfig()
    pl = PolicyLossConfig(loss_mode=mode or case["mode"], rollout_correction=rc, **rec["policy_loss"])
    actor = ActorConfig(loss_agg_mode=case["loss_agg_mode"], policy_loss=pl, **{**rec["actor"], **actor_changes})
    loss, _ = get_policy_loss(pl.loss_mode)(
        t["old_log_prob"], lp, t["advantages"], t["response_mask"], actor, global_tokens=case["global_tokens"],
        global_seqs=case["global_seqs"], rollout_is_weights=t["rollout_is_weights"] if case["with_weights"] else None)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def verl_numbers(rec: dict, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's loss and gradient for the case. geo_mean: verl divides by the piece's rows and ignores the
    global count; rlpad's deliberate difference is the mini-batch's count (``global_seqs``), so verl's
    numbers are rescaled by rows / global_seqs (exact in fp64 up to one rounding)."""
    loss, grad = (torch.tensor(case[k], dtype=torch.float64) for k in ("loss", "grad"))
    if case["mode"] == "geo_mean" and case["global_seqs"] is not None:
        scale = len(rec["inputs"][str(case["seed"])]["response_mask"]) / case["global_seqs"]
        loss, grad = loss * scale, grad * scale
    return loss, grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def case_id(c: dict) -> str:
    rc = c["rollout_correction"]
    extra = "" if not rc else f"-{rc['loss_type']}-{rc['rollout_is']}-{rc['rollout_is_threshold']}" + (
        "-norm" if rc["rollout_is_batch_normalize"] else "")
    return f"{c['mode']}{extra}-{c['loss_agg_mode']}-{'w' if c['with_weights'] else 'now'}-seed{c['seed']}"


def test_the_record_covers_every_verl_mode_and_aggregation():
    """Every mode verl 0.9.1 registers except clip_cov (verl draws its tokens from the global RNG: compared
    in tests/test_loss_modes.py by formula) is recorded, each under every aggregation rlpad admits for it."""
    rec = recorded()
    assert rec["verl_version"] == "0.9.1"
    seen: dict[str, set] = {}
    for c in rec["policy_losses"]:
        seen.setdefault(c["mode"], set()).add(c["loss_agg_mode"])
    assert set(seen) == set(POLICY_LOSSES) - {"clip_cov"}
    for mode, aggs in seen.items():
        assert aggs == set(POLICY_LOSSES[mode].agg_modes), mode
    assert {c["with_weights"] for c in rec["policy_losses"]} == {True, False}


@pytest.mark.exactness
@pytest.mark.parametrize("source", sources())
def test_each_policy_loss_equals_verls_function(source):
    rec = record(source)
    if source == "live":  # the live run reproduces the record (same verl, same cases)
        assert [c["loss"] for c in rec["policy_losses"]] == pytest.approx(
            [c["loss"] for c in recorded()["policy_losses"]], rel=BOUND, abs=1e-15)
    worst = 0.0
    for case in rec["policy_losses"]:
        loss, grad = rlpad_loss(rec, case)
        ref_loss, ref_grad = verl_numbers(rec, case)
        err = max(rel(loss, ref_loss), rel(grad, ref_grad))
        worst = max(worst, err)
        assert err <= BOUND, (case_id(case), err)
        if case["mode"] == "vanilla" or (case["mode"] == "bypass_mode" and not case["with_weights"]
                                         and case["rollout_correction"]["loss_type"] == "ppo_clip"):
            continue  # bypass ppo_clip without weights IS vanilla, in verl too
        van_loss, van_grad = rlpad_loss(rec, case, mode="vanilla")
        assert rel(loss, van_loss) > 1e-3 or rel(grad, van_grad) > 1e-3, ("same as vanilla", case_id(case))
    print(f"{len(rec['policy_losses'])} cases, worst relative error {worst:.2e}")


# a slightly wrong variant of each mode: (actor changes, policy_loss changes)
PERTURBED = {"kl_cov": ({}, {"ppo_kl_coef": 0.5001}), "dppo_tv": ({"clip_ratio_c": 1.5}, {}),
             "dppo_kl": ({"clip_ratio_c": 1.5}, {}), "sapo": ({"tau_pos": 1.001}, {}), "dro": ({}, {"dro_beta": 0.7001})}


@pytest.mark.exactness
def test_negative_control_a_perturbed_loss_fails_the_bound():
    """The bound can fail: each mode with one key moved slightly (clip_ratio_high 0.28 -> 0.2801 unless
    ``PERTURBED`` says otherwise; bypass reinforce: its IS threshold; gpg, which has no key: another
    aggregation) is caught on at least one recorded case."""
    rec = recorded()
    caught = set()
    for case in rec["policy_losses"]:
        actor_changes, pl_changes = PERTURBED.get(case["mode"], ({"clip_ratio_high": 0.2801}, {}))
        rc = case["rollout_correction"]
        if case["mode"] == "gpg":
            other = "token-mean" if case["loss_agg_mode"] != "token-mean" else "seq-mean-token-sum"
            loss, grad = rlpad_loss(rec, {**case, "loss_agg_mode": other})
        elif rc and rc["loss_type"] == "reinforce":
            moved = dict(rc, rollout_is_threshold="1.01") if rc["rollout_is"] else dict(rc, rollout_is="token")
            loss, grad = rlpad_loss(rec, {**case, "rollout_correction": moved})
        else:
            loss, grad = rlpad_loss({**rec, "policy_loss": {**rec["policy_loss"], **pl_changes}}, case, **actor_changes)
        ref_loss, ref_grad = verl_numbers(rec, case)
        if max(rel(loss, ref_loss), rel(grad, ref_grad)) > BOUND:
            caught.add(case["mode"])
    assert caught == {c["mode"] for c in rec["policy_losses"]}


# ----------------------------------------------------------------------------- the default reward


def _score(result) -> tuple[float, float | None]:
    if isinstance(result, dict):
        return float(result["score"]), float(result["acc"])
    return float(result), None


@pytest.mark.exactness
@pytest.mark.parametrize("source", sources())
def test_default_reward_equals_verls_default_compute_score(source):
    rec = record(source)
    cases = rec["rewards"]
    assert len(cases) >= 18 and {c["data_source"] for c in cases} >= {
        "openai/gsm8k", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math_dapo", "math", "aime2024"}
    default = load_reward_fn(None)
    assert default is verl_default.compute_score
    for c in cases:
        score, acc = _score(default(data_source=c["data_source"], solution_str=c["response"],
                                    ground_truth=c["ground_truth"], extra_info=None))
        assert score == c["score"], c
        assert acc == (None if c["acc"] is None else float(c["acc"])), c


def test_negative_control_the_lenient_verifier_differs_from_verl():
    """rlpad's lenient verifier (reward.fn=rlpad.rewards.rules:compute_score) gives another reward on the
    shapes the issue lists: ``#### $18``, ``#### 18.00``, an unboxed ``1/2``, a wrong or missing DAPO answer."""
    lenient = load_reward_fn("rlpad.rewards.rules:compute_score")
    assert lenient is rules.compute_score
    differs = [c for c in recorded()["rewards"]
               if _score(lenient(data_source=c["data_source"], solution_str=c["response"],
                                 ground_truth=c["ground_truth"]))[0] != c["score"]]
    shapes = {(c["data_source"], c["response"].splitlines()[-1]) for c in differs}
    assert {("openai/gsm8k", "#### $18"), ("openai/gsm8k", "#### 18.00"),
            ("lighteval/MATH", "Half of it, so the answer is 1/2."), ("math_dapo", "Answer: 35"),
            ("math_dapo", "I could not finish the sum.")} <= shapes, shapes


def test_names_verl_scores_otherwise_are_refused_by_name():
    for name in ("numina_olympiads", "hiyouga/geometry3k", "searchR1_nq"):  # code sources run: test_code_parity.py
        with pytest.raises(ValueError, match=f"data_source '{name}': verl scores it with its"):
            verl_default.compute_score(name, "x", "y")
    with pytest.raises(ValueError, match="no default reward for data_source 'gsm8k'.*rules:compute_score"):
        verl_default.compute_score("gsm8k", "#### 1", "1")
    for response, truth in (("12", "12"), ("13", "12")):  # rlpad's toy tasks keep their own scorer
        assert verl_default.compute_score("rlpad/toy_add", response, truth) == rules.compute_score(
            "rlpad/toy_add", response, truth)


def test_the_record_names_its_generator_and_verl_version():
    rec = recorded()
    assert rec["generator"] == "scripts/verl_parity.py" and PEER.recorder.is_file()
    assert rec["verl_version"] == "0.9.1" and rec["torch_version"].startswith("2.13")
