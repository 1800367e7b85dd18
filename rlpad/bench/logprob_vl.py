"""``rlpad bench logprob --vl``: log-probs of a vision-language batch, padded vs remove-padding vs shared prompts.

A GRPO-shaped VL batch (:func:`rlpad.embedded.vl_synthetic.vl_rollout_batch`: prompts with images,
n responses each, left-padded prompts, right-padded responses) on a random Qwen2.5-VL of one row of
:data:`VL_SHAPES`. Per path (``padded``, ``rmpad``, ``shared``), forward and forward+backward
(loss: mean log-prob + 0.01 x entropy): medians of interleaved repetitions, tokens/s of valid
tokens, the speed-up over padded beside the FLOP-ideal one (the language model's FLOPs of the
path, :mod:`rlpad.bench.flops`, plus the vision tower's on the images the path runs: every row's
for padded and rmpad, each prompt's once for shared), and the vision tower's share: its own time
on the same images (``tower_s``, the tower alone) over the path's, and its FLOP share.

Rows: ``tiny-vl`` on the CPU (the tiny model; ``tiny-vl-dry``, its two image layouts in 4 rows, is the
GPU lane's dry run); ``7b-vl-layers`` on CUDA in bf16:
Qwen2.5-VL-7B's language shape (4 of its 28 decoder layers, as ``7b-layers``) and its whole 32-block
vision tower (the FLOP share is also given for the 28-layer model: ``vision_flop_share_full``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlpad.bench.flops import forward_flops, packed_work, padded_work, shared_prompt_work, vision_flops
from rlpad.bench.measure import interleaved_medians, path_rates, require_cuda
from rlpad.bench.table import Table
from rlpad.core.forward import backbone_of, compute_log_probs
from rlpad.core.shared_prompt import prompt_groups
from rlpad.core.vision import image_features, row_images

__all__ = ["PATHS", "VL_SHAPES", "run_vl", "vl_tables"]

PATHS = {"padded": dict(use_remove_padding=False), "rmpad": dict(use_remove_padding=True),
         "shared": dict(use_remove_padding=True, share_prompts=True)}
_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=4, head_dim=128, num_key_value_heads=4,
                intermediate_size=18944, max_position_embeddings=32768)
_7B_VISION = dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=3584,
                  window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
# name -> the model (tiny_vl_config arguments), the batch (prompts x n rows; the image grids of each prompt
# in patches of 14 px, cycled; text and response lengths) and the device it is meant for
VL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-vl": dict(model=dict(arch="qwen2_5_vl"), prompts=4, n=4, grids=[[(1, 8, 8)], [(1, 4, 8), (1, 4, 4)]],
                    max_text=24, response=48, device="cpu"),
    "7b-vl-layers": dict(model=dict(arch="qwen2_5_vl", vision=_7B_VISION, vision_depth=32, vision_width=1280,
                                    **_7B_TEXT),
                         prompts=2, n=8, grids=[[(1, 32, 32)], [(1, 24, 40), (1, 16, 16)]], max_text=128,
                         response=1024, device="cuda"),  # 16 rows of up to ~1.8k tokens, 1024-1216 patches per prompt
}
VL_SHAPES["tiny-vl-dry"] = {**VL_SHAPES["tiny-vl"], "prompts": 2, "n": 2}  # the dry run's glue check: 4 rows
FULL_7B_LAYERS = 28  # Qwen2.5-VL-7B's decoder layers: the FLOP share of the whole model


def _batch(shape: dict[str, Any], seed: int):
    from rlpad.embedded.vl_synthetic import vl_rollout_batch

    grids = [shape["grids"][g % len(shape["grids"])] for g in range(shape["prompts"])]
    return vl_rollout_batch(grids, shape["response"], n=shape["n"], seed=seed, max_text=shape["max_text"])


def measure_vl(name: str, *, reps: int = 3, seed: int = 0) -> dict[str, Any]:
    """One row of :data:`VL_SHAPES`: seconds, rates and FLOPs of every path and of the tower alone."""
    from rlpad.embedded.tiny_vl import tiny_vl_model

    shape = VL_SHAPES[name]
    device = torch.device(shape["device"])
    spec = dict(shape["model"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = tiny_vl_model(spec.pop("arch"), seed=seed, dtype=dtype, device=device, **spec).train()
    tensors, mm = _batch(shape, seed)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    response = shape["response"]
    mask = tensors["response_mask"].float()
    args = (model, tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"], response)
    backbone = backbone_of(model)
    images = row_images(backbone, mm, len(mm))
    groups = prompt_groups(tensors["input_ids"].cpu(), tensors["attention_mask"].cpu(), None, response, mm)
    tower_rows = {"padded": list(range(len(mm))), "rmpad": list(range(len(mm))), "shared": [g[0] for g in groups]}

    def forward(path: str, backward: bool) -> None:
        with torch.set_grad_enabled(backward):
            lp, ent = compute_log_probs(*args, calculate_entropy=True, multi_modal_inputs=mm, **PATHS[path])
            if backward:
                ((lp + 0.01 * ent) * mask).sum().div(mask.sum()).backward()
                model.zero_grad(set_to_none=True)

    def tower(rows: list[int], backward: bool) -> None:
        with torch.set_grad_enabled(backward):
            out = image_features(backbone, images, rows, device)
            if backward:
                out.float().sum().backward()
                model.zero_grad(set_to_none=True)

    passes = {f"{mode}_{p}": (lambda p=p, b=(mode == "fwdbwd"): forward(p, b)) for mode in ("fwd", "fwdbwd") for p in PATHS}
    passes.update({f"{mode}_tower_{p}": (lambda p=p, b=(mode == "fwdbwd"): tower(tower_rows[p], b))
                   for mode in ("fwd", "fwdbwd") for p in ("rmpad", "shared")})
    seconds = interleaved_medians(passes, reps, device)
    text = model.config.get_text_config()
    am = tensors["attention_mask"].cpu()
    works = {"padded": padded_work(am, response), "rmpad": packed_work(am, response),
             "shared": shared_prompt_work(am, response, groups, causal_responses=device.type == "cuda")}
    grid = {p: torch.cat([images.grids[r] for r in rows if len(images.grids[r])]) for p, rows in tower_rows.items()}
    vis = {p: vision_flops(model.config.vision_config, grid[p])["total"] for p in PATHS}
    lm = {p: forward_flops(text, w)["total"] for p, w in works.items()}
    flops = {p: lm[p] + vis[p] for p in PATHS}
    full = {p: lm[p] * FULL_7B_LAYERS / text.num_hidden_layers + vis[p] for p in PATHS}
    valid = int(am.sum())
    result: dict[str, Any] = {
        "model": name, "device": device.type, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "vision_params_m": sum(p.numel() for p in backbone.visual.parameters()) / 1e6,
        "rows": len(mm), "images": int(sum(len(g) for g in images.grids)), "patches": sum(images.patches()),
        "valid_tokens": valid, "valid_fraction": valid / am.numel(), "gflop": {p: f / 1e9 for p, f in flops.items()},
        "vision_flop_share": {p: vis[p] / flops[p] for p in PATHS},
        "vision_flop_share_full": {p: vis[p] / full[p] for p in PATHS} if name.startswith("7b") else None,
    }
    for mode, factor in (("fwd", 1), ("fwdbwd", 3)):
        result[mode] = {"padded_s": seconds[f"{mode}_padded"]}
        for p in ("rmpad", "shared"):
            rates = path_rates(valid, {q: seconds[f"{mode}_{q}"] for q in ("padded", p)}, flops, base="padded",
                               other=p, factor=factor)
            tower_s = seconds[f"{mode}_tower_{p}"]
            result[mode][p] = {"s": rates[f"{p}_s"], "tok_s": rates[f"{p}_tok_s"], "speedup": rates["speedup"],
                               "ideal": rates["flop_ideal_speedup"], "tower_s": tower_s,
                               "tower_share": tower_s / rates[f"{p}_s"]}
    del model
    return result


def run_vl(shapes: list[str] | None = None, *, reps: int = 3, dry_run: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Every asked row of :data:`VL_SHAPES` (default: ``device``'s; ``dry_run``: ``tiny-vl-dry`` on the CPU).
    ValueError (before any compute) for an unknown row, or CUDA asked where torch sees none."""
    if shapes is None:
        shapes = ["tiny-vl-dry"] if dry_run else ["tiny-vl"] if device == "cpu" else ["7b-vl-layers"]
    bad = [s for s in shapes if s not in VL_SHAPES]
    if bad:
        raise ValueError(f"unknown VL shape(s) {bad}; choose from {sorted(VL_SHAPES)}")
    if any(VL_SHAPES[s]["device"] == "cuda" for s in shapes):
        require_cuda()
    return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "shapes": [measure_vl(s, reps=reps) for s in shapes]}


def vl_tables(result: dict[str, Any]) -> list[Table]:
    """One table per shape: each path's seconds, speed-up over padded beside its FLOP ideal, the tower's share."""
    out = []
    for r in result["shapes"]:
        rows = []
        for mode in ("fwd", "fwdbwd"):
            m = r[mode]
            rows.append([mode, "padded", f"{m['padded_s']:.3f}", "1.00x", "1.00x", "", f"{r['vision_flop_share']['padded']:.1%}"])
            for p in ("rmpad", "shared"):
                rows.append([mode, p, f"{m[p]['s']:.3f}", f"{m[p]['speedup']:.2f}x", f"{m[p]['ideal']:.2f}x",
                             f"{m[p]['tower_share']:.1%}", f"{r['vision_flop_share'][p]:.1%}"])
        notes = [f"{r['rows']} rows, {r['images']} images ({r['patches']} patches), {r['valid_tokens']} valid tokens "
                 f"({r['valid_fraction']:.0%}); {r['params_m']:.1f}M parameters, vision tower {r['vision_params_m']:.1f}M",
                 "tower time: the vision tower alone on the path's images (each row's for rmpad, each prompt's once for "
                 "shared) over the path's time; tower FLOPs: its share of the path's FLOPs"]
        if r.get("vision_flop_share_full"):
            notes.append("with all 28 decoder layers of Qwen2.5-VL-7B the tower's FLOP share would be " + ", ".join(
                f"{p} {v:.1%}" for p, v in r["vision_flop_share_full"].items()))
        out.append(Table(["pass", "path", "median s", "speedup", "FLOP ideal", "tower time", "tower FLOPs"], rows,
                         notes=notes, title=f"VL log-prob + entropy, {r['model']} on {r['device']}"))
    return out
