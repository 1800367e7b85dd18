"""The ``rms_norm`` fused modules (rlpad/core/fused_modules.py): every transformers RMSNorm of a model on
aten's ``_fused_rms_norm``. On the CPU torch runs its composite of the same arithmetic: in fp32 the
forward and backward equal the plain model's (the same numbers), in bf16 the one rounding per norm
(transformers rounds twice) stays within the bf16 bounds of the fp32 oracle and moves the numbers
(the hook ran). Negative control: a norm of another formula (Gemma's ``1 + weight``) is left alone.
On CUDA it is one kernel each way; the GPU run measures it (``rlpad bench host --device cuda``)."""

import pytest
import torch
from torch import nn

from rlpad.core.fused_modules import FUSED_MODULES
from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL, errors, oracle, scored, violations
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

PROMPT, RESPONSE, VOCAB = 10, 8, 64
NORMS = {"qwen2": 5, "llama": 5, "mistral": 5, "qwen3": 9}  # 2 per layer + the final one (+ q/k norms)


def batch():
    return rollout_batch(4, PROMPT, RESPONSE, vocab_size=VOCAB, seed=3)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_fp32_equals_the_plain_model(arch):
    b = batch()
    plain = tiny_model(arch, vocab_size=VOCAB, seed=1).train()
    fused = tiny_model(arch, vocab_size=VOCAB, seed=1).train()
    assert len(FUSED_MODULES["rms_norm"](fused)) == NORMS[arch]
    ref, got = scored(plain, b, RESPONSE, rmpad=True), scored(fused, b, RESPONSE, rmpad=True)
    errs = errors(got, ref, b["attention_mask"][:, -RESPONSE:])
    assert errs["lp_max"] <= FP32_LOGPROB_TOL and errs["ent_max"] <= FP32_LOGPROB_TOL, errs
    assert errs["grad_rel"] <= FP32_GRAD_REL, errs


def test_bf16_one_rounding_within_the_bounds_and_not_the_plain_numbers():
    b = batch()
    model32 = tiny_model("qwen2", vocab_size=VOCAB, seed=1).train()
    plain = tiny_model("qwen2", vocab_size=VOCAB, seed=1, dtype=torch.bfloat16).train()
    fused = tiny_model("qwen2", vocab_size=VOCAB, seed=1, dtype=torch.bfloat16).train()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # norm weights != 1, else both roundings of transformers' forward are exact
        for name, p in plain.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    for m in (model32, fused):
        m.load_state_dict({k: v.to(next(m.parameters()).dtype) for k, v in plain.state_dict().items()})
    FUSED_MODULES["rms_norm"](fused)
    mask = b["attention_mask"][:, -RESPONSE:]
    ref = oracle(model32, b, RESPONSE)
    got, before = scored(fused, b, RESPONSE, rmpad=True), scored(plain, b, RESPONSE, rmpad=True)
    assert not violations(errors(got, ref, mask)), errors(got, ref, mask)
    assert errors(got, before, mask)["lp_max"] > 0  # the hook ran: the bf16 numbers moved


class GemmaLikeRMSNorm(nn.Module):
    """``(1 + weight) * x / rms(x)``: another formula under an RMSNorm name."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        x32 = x.float()
        rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1 + self.weight.float()) * x32 * rms).to(x.dtype)


def test_another_formula_is_left_alone():
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    model.model.norm = GemmaLikeRMSNorm(model.config.hidden_size)
    replaced = FUSED_MODULES["rms_norm"](model)
    assert "model.norm" not in replaced and len(replaced) == NORMS["qwen2"] - 1
    assert "forward" not in vars(model.model.norm)
