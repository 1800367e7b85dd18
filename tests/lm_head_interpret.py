"""Run by tests/test_lm_head.py in a subprocess with TRITON_INTERPRET=1 and the side install of
Triton on PYTHONPATH: the fused Triton head on the CPU against the fp64 reference. Prints one JSON
line: ``cases`` {name: head_errors(...)} for every case x grid order and every tile configuration
of the table x grid order; ``budget`` (the dz slice count a byte budget gives, and the errors then);
``large_offsets`` (h, W and dz rows past 2^31 elements); the fp16-rounded-logits ``control``."""

import dataclasses
import json
import os
import sys

import torch

from rlpad.core.lm_head_plan import GRID_ORDERS, TILE_TABLE, Tiles, dz_columns
from rlpad.core.lm_head_triton import head_stats, launch_dz, triton_log_probs_and_entropy
from rlpad.embedded.head_exactness import fp64_head, head_errors, head_inputs

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
TINY = Tiles(16, 32, 16, 1, 1, group=2)  # tokens, vocabulary, hidden per tile: the shapes below cross every boundary
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
TABLE_SHAPE = (torch.float32, 150, 72, 300, True, 0.8, 40, None, True, True)  # several tiles of the table's sizes


def errors(spec, tiles, seed, dz_budget=1 << 30):
    dtype, n, h, v, bias, temp, chunk, splits, lp_grad, ent_grad = spec
    x = head_inputs(n, h, v, dtype=dtype, bias=bias, seed=seed)

    def head(hidden, weight, labels, b, temperature):
        return triton_log_probs_and_entropy(hidden, weight, labels, bias=b, temperature=temperature, chunk_size=chunk,
                                            tiles=tiles, splits=splits, dz_budget=dz_budget)

    out = head_errors(head, x, temp, lp_grad=lp_grad, entropy_grad=ent_grad)
    out["label_v_minus_1"] = int(x["labels"][-1]) == v - 1
    return out


def large_offsets():
    """h (5 rows) and W (40 rows) as views with row strides that put their last rows past 2^31
    elements (storage reserved, only the used rows touched), forward + backward against fp64; then
    dz of those inputs written into rows past 2^31 of a NaN-filled view, against the same kernel's
    contiguous output (a 32-bit offset would wrap: the rows would keep their NaN or crash)."""
    n, h, v = 5, 24, 40
    x = head_inputs(n, h, v, dtype=torch.float16, seed=7)
    views = {}
    for name, rows in (("hidden", n), ("weight", v)):
        stride = 2**31 // (rows - 1) + 64
        view = torch.empty((rows - 1) * stride + h, dtype=torch.float16).as_strided((rows, h), (stride, 1))
        views[name] = view.copy_(x[name]).requires_grad_()
    lp, ent = triton_log_probs_and_entropy(views["hidden"], views["weight"], x["labels"], tiles=TINY)
    ((lp * x["g_lp"]).sum() + (ent * x["g_ent"]).sum()).backward()
    h64, w64 = x["hidden"].double().requires_grad_(), x["weight"].double().requires_grad_()
    lp64, ent64 = fp64_head(h64, w64, x["labels"])
    ((lp64 * x["g_lp"]).sum() + (ent64 * x["g_ent"]).sum()).backward()
    rel = lambda g, g64: ((g.double() - g64).norm() / g64.norm()).item()  # noqa: E731
    out = {"max_h_offset": (n - 1) * views["hidden"].stride(0), "max_w_offset": (v - 1) * views["weight"].stride(0),
           "lp_max": (lp.double() - lp64).abs().max().item(), "ent_max": (ent.double() - ent64).abs().max().item(),
           "grad_hidden": rel(views["hidden"].grad, h64.grad), "grad_weight": rel(views["weight"].grad, w64.grad)}
    hv, wv = views["hidden"].detach(), views["weight"].detach()
    _, _, lse, mean_z = head_stats(hv, wv, None, x["labels"], 1.0, tiles=TINY)
    stride = 2**31 // (n - 1) + 64
    far = torch.empty((n - 1) * stride + v, dtype=torch.float16).as_strided((n, v), (stride, 1)).fill_(float("nan"))
    near = torch.empty(n, v, dtype=torch.float16)
    for buf in (far, near):
        launch_dz(buf, 0, hv, wv, None, x["labels"], lse, mean_z, x["g_lp"], x["g_ent"], 1.0, TINY)
    out.update(max_dz_offset=(n - 1) * stride, dz_equal=bool(torch.equal(far, near)), dz_nan=bool(far.isnan().any()))
    return out


cases = {}
for order in GRID_ORDERS:
    tiny = dataclasses.replace(TINY, order=order)
    for name, spec in CASES.items():
        cases[f"{order}/{name}"] = errors(spec, tiny, seed=len(cases))
cases["grouped_L2_group/fp32_T0.7_bias_3_slices"] = errors(CASES["fp32_T0.7_bias_3_slices"],
                                                           dataclasses.replace(TINY, group=None), seed=1)
for promote in (16, 32):  # partial sums moved out every 1 / 2 of the K blocks (hidden 40: 3 blocks of 16)
    for name in ("fp16_T0.7_bias_3_slices", "fp32_T0.7_bias_3_slices"):
        cases[f"promote{promote}/{name}"] = errors(CASES[name], dataclasses.replace(TINY, promote=promote), seed=2)
table = {t for entries in TILE_TABLE.values() for _, t in entries}
for t in sorted(table, key=lambda t: t.name):
    for order in GRID_ORDERS:
        tiles = dataclasses.replace(t, order=order)
        cases[f"table {tiles.name}"] = errors(TABLE_SHAPE, tiles, seed=len(cases))

# The dz slice follows the byte budget: 37 tokens x 32 fp32 columns = 4736 bytes -> 83 columns in 3 slices.
budget = 37 * 32 * 4
spec = (torch.float32, 37, 40, 83, True, 0.9, 10**6, 2, True, True)
columns = dz_columns(37, 83, TINY.block_v, 10**6, 4, budget)
budget_case = {"columns": columns, "slices": -(-83 // columns), "errors": errors(spec, TINY, seed=3, dz_budget=budget)}

x = head_inputs(37, 40, 83, dtype=torch.float16, seed=0)  # negative control: logits rounded to fp16
lp, ent = fp64_head(x["hidden"], x["weight"], x["labels"])
lp_r, ent_r = fp64_head(x["hidden"], x["weight"], x["labels"], round_logits_to=torch.float16)
control = {"lp_max": (lp - lp_r).abs().max().item(), "ent_max": (ent - ent_r).abs().max().item()}
print(json.dumps({"cases": cases, "budget": budget_case, "large_offsets": large_offsets(), "control": control}))
sys.exit(0)
