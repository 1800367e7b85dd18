"""Record verl's own numbers on rlpad's parity cases: policy losses and the default reward.

Run with an interpreter that has verl installed (its own venv; rlpad is not imported here)::

    /path/to/verl-venv/bin/python scripts/verl_parity.py --out tests/fixtures/verl_parity.json

The cases are defined here, once: random policy-loss inputs (fp64, stored in the output) under every
aggregation a mode honours, with and without rollout weights and with global normalisers, and
reward responses shaped like verl's data sets. tests/test_verl_parity.py compares rlpad against the
recorded file always, and against a live run of this script when ``$RLPAD_VERL_PYTHON`` names a
Python with verl (or verl is importable by the test's own Python).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

B, R = 5, 7
AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")
SEQ_ONLY = ("seq-mean-token-mean",)
# mode -> the aggregations verl honours for it (geo_mean and sapo fix their own)
MODES = {"vanilla": AGGS, "gspo": AGGS, "cispo": AGGS, "kl_cov": AGGS, "dppo_tv": AGGS, "dppo_kl": AGGS,
         "gpg": AGGS, "dro": AGGS, "bypass_mode": AGGS, "sapo": SEQ_ONLY, "geo_mean": SEQ_ONLY}
ACTOR = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
         "tau_pos": 1.0, "tau_neg": 1.05}
POLICY_LOSS = {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5, "dro_beta": 0.7}
# bypass_mode's rollout_correction variants (verl's keys); the first is also run under every aggregation
BYPASS = [
    {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "2.0", "rollout_is_batch_normalize": False},
    {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": "2.0",
     "rollout_is_batch_normalize": False},
    {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.8_1.5",
     "rollout_is_batch_normalize": True},
    {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": "1.5",
     "rollout_is_batch_normalize": True},
    {"loss_type": "reinforce", "rollout_is": None, "rollout_is_threshold": "2.0", "rollout_is_batch_normalize": False},
    {"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": "2.0", "rollout_is_batch_normalize": False},
]
# (seed, with rollout weights, global normalisers: tokens, seqs)
VARIANTS = [(0, False, None, None), (1, True, 29.0, 6.0)]

# data_source, response, ground truth: shapes of verl's data sets' responses
REWARD_CASES = [
    ("openai/gsm8k", "Each box holds 6, so 3 boxes hold 18.\n#### 18", "18"),
    ("openai/gsm8k", "3 boxes of 6 cost 18 dollars.\n#### $18", "18"),
    ("openai/gsm8k", "So the total is 18.\n#### 18.00", "18"),
    ("openai/gsm8k", "A thousand in all.\n#### 1,000", "1000"),
    ("openai/gsm8k", "The answer is 18.", "18"),
    ("openai/gsm8k", "It drops by five.\n#### -5", "-5"),
    ("openai/gsm8k", "####18", "18"),
    ("openai/gsm8k", "#### 17 is close\n#### 18", "18"),
    ("openai/gsm8k", "#### 18\n" + "Checking the work again. " * 14, "18"),
    ("openai/gsm8k", "#### 17", "18"),
    ("lighteval/MATH", "Half of it: $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("lighteval/MATH", "Half of it, so the answer is 1/2.", "\\frac{1}{2}"),
    ("lighteval/MATH", "So $\\boxed{1/2}$.", "\\frac12"),
    ("HuggingFaceH4/MATH-500", "We get $\\boxed{0.5}$", "\\frac{1}{2}"),
    ("HuggingFaceH4/MATH-500", "Hence $\\boxed{x = 3}$.", "3"),
    ("DigitalLearningGmbH/MATH-lighteval", "$\\boxed{10\\%}$", "10"),
    ("lighteval/MATH", "$\\boxed{\\dfrac{3}{4}}$", "\\frac34"),
    ("lighteval/MATH", "The angle is $\\boxed{30^\\circ}$", "30"),
    ("lighteval/MATH", "The answer is \\boxed 5$ in all", "5"),
    ("lighteval/MATH", "So $\\boxed{3", "3"),
    ("lighteval/MATH", "$\\boxed{5\\text{ cm}}$", "5"),
    ("lighteval/MATH", "$\\fbox{7}$", "7"),
    ("math_dapo", "Adding them up gives 34.\nAnswer: 34", "34"),
    ("math_dapo", "Adding them up gives 35.\nAnswer: 35", "34"),
    ("math_dapo", "I could not finish the sum.", "34"),
    ("math_dapo", "Adding them up gives $\\boxed{34}$", "34"),
    ("math", "answer: $34$", "34"),
    ("math", "Answer: 1,000", "1000"),
    ("aime2024", "Answer: 034", "34"),
    ("aime25", "The count is 34 dollars. Answer: 34 dollars", "34"),
    ("math_dapo_reasoning", "Answer: \\frac{1}{2}", "\\frac{1}{2}"),
    ("math_dapo", "So x = 5.\nAnswer: x = 5", "5"),
    ("math_dapo", "Answer: 12\n" + "and then I kept going for a long while. " * 9, "12"),
]


def inputs(seed: int) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, R + 1, (B,), generator=g)
    lengths[-1] = R
    m = (torch.arange(R)[None] < lengths[:, None]).double()
    old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 2.5 - 0.05
    lp = torch.minimum(old + torch.randn(B, R, generator=g, dtype=torch.float64) * 0.4, torch.tensor(-1e-3))
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, R) * m
    adv = adv + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64) * m
    w = (torch.rand(B, R, generator=g, dtype=torch.float64) * 1.5 + 0.25) * m
    return {"old_log_prob": old.tolist(), "log_prob": lp.tolist(), "advantages": adv.tolist(),
            "response_mask": m.tolist(), "rollout_is_weights": w.tolist()}


def actor_config(agg: str, mode: str, bypass: dict | None, tokens: float | None, seqs: float | None):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig
    from verl.trainer.config import RolloutCorrectionConfig

    rc = RolloutCorrectionConfig(**bypass) if bypass else RolloutCorrectionConfig()
    pl = PolicyLossConfig(loss_mode=mode, rollout_correction=rc, **POLICY_LOSS)
    info = {"dp_size": 1}
    if tokens is not None:
        info.update(batch_num_tokens=tokens, global_batch_size=seqs)
    return ActorConfig(strategy="fsdp", rollout_n=1, loss_agg_mode=agg, policy_loss=pl, ppo_micro_batch_size_per_gpu=1,
                       global_batch_info=info, **ACTOR)


def policy_cases() -> list[dict]:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    data = {seed: inputs(seed) for seed, *_ in VARIANTS}
    runs = [(mode, agg, None) for mode, aggs in MODES.items() for agg in aggs if mode != "bypass_mode"]
    runs += [("bypass_mode", agg, BYPASS[0]) for agg in AGGS] + [("bypass_mode", "token-mean", b) for b in BYPASS[1:]]
    out = []
    for mode, agg, bypass in runs:
        for seed, with_w, tokens, seqs in VARIANTS:
            t = {k: torch.tensor(v, dtype=torch.float64) for k, v in data[seed].items()}
            lp = t["log_prob"].clone().requires_grad_(True)
            cfg = actor_config(agg, mode, bypass, tokens, seqs)
            loss, _ = get_policy_loss_fn(mode)(t["old_log_prob"], lp, t["advantages"], t["response_mask"], agg, cfg,
                                               t["rollout_is_weights"] if with_w else None)
            (grad,) = torch.autograd.grad(loss, lp)
            out.append({"mode": mode, "loss_agg_mode": agg, "rollout_correction": bypass, "seed": seed,
                        "with_weights": with_w, "global_tokens": tokens, "global_seqs": seqs,
                        "loss": float(loss.detach()), "grad": grad.tolist()})
    return out


def reward_cases() -> list[dict]:
    from verl.utils.reward_score import default_compute_score

    out = []
    for data_source, response, truth in REWARD_CASES:
        result = default_compute_score(data_source, response, truth)
        score = result["score"] if isinstance(result, dict) else result
        acc = bool(result["acc"]) if isinstance(result, dict) else None
        out.append({"data_source": data_source, "response": response, "ground_truth": truth,
                    "score": float(score), "acc": acc})
    return out


def main() -> None:
    import verl

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write here (default: stdout)")
    args = parser.parse_args()
    record = {"verl_version": verl.__version__, "torch_version": torch.__version__, "generator": "scripts/verl_parity.py",
              "actor": ACTOR, "policy_loss": POLICY_LOSS, "B": B, "R": R,
              "inputs": {str(seed): inputs(seed) for seed, *_ in VARIANTS},
              "policy_losses": policy_cases(), "rewards": reward_cases()}
    text = json.dumps(record, indent=None, separators=(",", ":"))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
