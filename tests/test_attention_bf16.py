"""bf16 on CPU, forward and backward: padded sdpa, remove-padding and shared prompts vs the fp32
oracle (each sequence alone), per token and per gradient; a boundary leak must fail the bounds.

rlpad.embedded.exactness holds the harness and :data:`BF16_BOUNDS`, which the GPU lane
(tests/gpu/test_cuda_exactness.py) applies to the CUDA kernels. Here both sides of the bounds are
checked on CPU: every correct path is within them, and the negative control (the packed row with
one cu_seqlens segment, so attention crosses sequence boundaries) exceeds every bound in
``LEAK_DETECTING`` on every architecture: a test within the bounds cannot hide such a leak.
Measured figures print with ``-s`` (and are quoted next to the bounds).
"""

import pytest
import torch

from rlpad.embedded.exactness import BF16_BOUNDS, LEAK_DETECTING, errors, leaky_packed, oracle, scored, violations
from rlpad.embedded.synthetic import grpo_batch, rollout_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

ARCHS = sorted(ARCHITECTURES)  # qwen2 (GQA, tied), llama (MHA), mistral (sliding window 8), qwen3 (qk-norm)
PROMPT, RESPONSE, VOCAB = 24, 40, 128


def make_batch(kind: str) -> dict[str, torch.Tensor]:
    if kind == "rollout":  # 8 rows, a full-length row and a 1-token response, about half padding
        return rollout_batch(8, PROMPT, RESPONSE, vocab_size=VOCAB, seed=7)
    b = grpo_batch(3, 4, PROMPT, RESPONSE, vocab_size=VOCAB, seed=5, shuffle=True, min_prompt=2)
    return {k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}


def models(arch: str):
    """The bf16 model (rlpad_varlen) and the fp32 oracle model with the SAME bf16-rounded weights."""
    model = tiny_model(arch, vocab_size=VOCAB, seed=1, dtype=torch.bfloat16, attn_implementation="rlpad_varlen")
    model32 = tiny_model(arch, vocab_size=VOCAB, seed=1, dtype=torch.float32, attn_implementation="sdpa")
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return model.train(), model32.train()


@pytest.mark.parametrize("kind", ["rollout", "grpo"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_paths_within_bounds_and_a_leak_outside(arch, kind):
    batch = make_batch(kind)
    mask = batch["attention_mask"][:, -RESPONSE:]
    model, model32 = models(arch)
    ref = oracle(model32, batch, RESPONSE)
    results = {"rmpad": scored(model, batch, RESPONSE, rmpad=True)}
    if kind == "grpo":
        results["shared"] = scored(model, batch, RESPONSE, rmpad=True, share=True)
    leak = errors(leaky_packed(model, batch, RESPONSE), ref, mask)
    model.set_attn_implementation("sdpa")
    results["padded"] = scored(model, batch, RESPONSE, rmpad=False)
    table = {name: errors(r, ref, mask) for name, r in results.items()}
    print(f"\n{arch} {kind} bf16 vs fp32 alone: {table}\n  leak: {leak}")
    for name, r in results.items():
        assert not r.lp[~mask.bool()].any() and not r.ent[~mask.bool()].any(), name  # zero on padding
        assert not violations(table[name]), (name, violations(table[name]))
    missed = [k for k in LEAK_DETECTING if not violations({k: leak[k]})]
    assert not missed, f"the boundary leak stays within {missed}: {leak}"
    # The bf16 error is real, so the oracle is independent of the paths it checks.
    assert table["padded"]["lp_max"] > 1e-4


def test_bounds_name_only_computed_figures():
    batch = make_batch("rollout")
    model, model32 = models("llama")
    assert set(BF16_BOUNDS) == set(errors(scored(model, batch, RESPONSE, rmpad=True), oracle(model32, batch, RESPONSE),
                                          batch["attention_mask"][:, -RESPONSE:]))  # fmt: skip
    assert violations({"lp_max": 1.0, "grad_cos_min": 0.5}) == ["lp_max=1 (bound 0.02)", "grad_cos_min=0.5 (bound 0.998)"]
    nan = float("nan")  # NaN gradients (torch's varlen backward past cu_seqlens[-1]) fail every bound
    assert len(violations({"grad_rel": nan, "grad_cos_min": nan})) == 2
