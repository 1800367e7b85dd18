"""Run by tests/test_lm_head.py in a subprocess with TRITON_INTERPRET=1 and the side install of
Triton on PYTHONPATH: the fused Triton head on the CPU against the fp64 reference. Prints one JSON
line: {case name: head_errors(...)}, and the fp16-rounded-logits control per dtype."""

import json
import os
import sys

import torch

from rlpad.core.lm_head_triton import triton_log_probs_and_entropy
from rlpad.embedded.head_exactness import fp64_head, head_errors, head_inputs

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
BLOCKS = (16, 32, 16)  # tokens, vocabulary, hidden per tile: the shapes below cross every boundary
# name: (dtype, tokens, hidden, vocab, bias, temperature, chunk_size, splits, lp_grad, entropy_grad)
CASES = {
    "fp16_T1_one_slice": (torch.float16, 37, 40, 83, False, 1.0, 100, 2, True, True),
    "fp16_T0.7_bias_3_slices": (torch.float16, 37, 40, 83, True, 0.7, 5, 3, True, True),
    "fp16_T1.6_lp_grad_only": (torch.float16, 20, 32, 70, True, 1.6, 8, 1, True, False),
    "fp16_ent_grad_only": (torch.float16, 20, 32, 70, False, 1.0, 8, 2, False, True),
    "fp16_one_token": (torch.float16, 1, 24, 45, True, 0.9, 1, 2, True, True),
    "fp32_T0.7_bias_3_slices": (torch.float32, 37, 40, 83, True, 0.7, 5, 3, True, True),
    "fp32_T1_one_slice": (torch.float32, 33, 48, 64, False, 1.0, 64, 2, True, True),
}

out = {}
for name, (dtype, n, h, v, bias, temp, chunk, splits, lp_grad, ent_grad) in CASES.items():
    x = head_inputs(n, h, v, dtype=dtype, bias=bias, seed=len(out))

    def head(hidden, weight, labels, b, temperature, chunk=chunk, splits=splits):
        return triton_log_probs_and_entropy(hidden, weight, labels, bias=b, temperature=temperature, chunk_size=chunk,
                                            calculate_entropy=True, blocks=BLOCKS, splits=splits)

    out[name] = head_errors(head, x, temp, lp_grad=lp_grad, entropy_grad=ent_grad)
    out[name]["label_v_minus_1"] = int(x["labels"][-1]) == v - 1
for dtype in (torch.float16,):  # negative control: the same inputs with logits rounded to the dtype
    x = head_inputs(37, 40, 83, dtype=dtype, seed=0)
    lp, ent = fp64_head(x["hidden"], x["weight"], x["labels"])
    lp_r, ent_r = fp64_head(x["hidden"], x["weight"], x["labels"], round_logits_to=dtype)
    out[f"control_{str(dtype).split('.')[-1]}_rounded_logits"] = {"lp_max": (lp - lp_r).abs().max().item(),
                                                                  "ent_max": (ent - ent_r).abs().max().item()}
print(json.dumps(out))
sys.exit(0)
