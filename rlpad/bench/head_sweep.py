"""``rlpad bench head --sweep``: the fused head's tile configurations timed one by one, each
checked against fp64, beside the HBM model of its grid order; what the tile table
(:data:`rlpad.core.lm_head_plan.TILE_TABLE`) is chosen from.

Per token count (random inputs of the 7B head's shape, bf16 on CUDA): the three-GEMM floor, then
every configuration of :data:`SWEEP` (BLOCK_N x BLOCK_V x BLOCK_K x warps x stages x grid order):
forward and forward+backward seconds (medians of interleaved repetitions), their ratio to the
floor, max |log-prob| / |entropy| error against fp64 on the first ``err_tokens`` tokens (``ok``:
both within :data:`~rlpad.embedded.head_exactness.HEAD_LP_BOUND`, or within 1.25x of what fp32 logits
from torch's own GEMM of the same bf16 inputs reach: at 4800 tokens on the H200 of 2026-11-27 every
configuration and torch's fp32 head itself were at 5.5e-5, the fp32 rounding of those rows, not a
fault of a tile choice), and the model's HBM gigabytes of
the forward launch. The fastest ``ok`` configuration per token count is marked. A configuration
that fails to compile or run (shared memory, registers) is a row with its error.

On the CPU it runs Triton's interpreter (``TRITON_INTERPRET=1`` with Triton importable: the side
install of scripts/setup_cpu.sh on PYTHONPATH) in fp32 at tiny shapes over :data:`DRY_SWEEP`:
the GPU command's dry run, no timing meaning.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from rlpad.bench.measure import device_peak, interleaved_medians, require_cuda
from rlpad.bench.table import Table
from rlpad.core.lm_head import triton_missing
from rlpad.core.lm_head_plan import GPUS, GRID_ORDERS, TILE_TABLE, Tiles, device_gpu, forward_traffic
from rlpad.embedded.head_exactness import FP32_SLACK, HEAD_LP_BOUND, fp64_head, head_bounds, head_inputs

__all__ = ["DRY_SWEEP", "SWEEP", "run_sweep", "sweep_tables"]


def _sweep() -> tuple[Tiles, ...]:
    """The table's entries (vocab_fastest, promoted), the same unpromoted (the promotion's price), the
    unpromoted winner of 2026-11-27 (256x128x32 w8 s4) and the table's at promote 512 and 1024 (fewer adds,
    more truncation), then the shapes around them and the table's in the other two orders: the most telling
    first, as a time budget may cut the tail."""
    table = sorted({t for entries in TILE_TABLE.values() for _, t in entries}, key=lambda t: t.name)
    plain = [dataclasses.replace(t, promote=0) for t in table] + [Tiles(256, 128, 32, 8, 4)]
    coarser = [dataclasses.replace(t, promote=p) for p in (512, 1024) for t in table if t.promote]
    extra = [Tiles(bn, bv, bk, w, st) for bn, bv in ((64, 256), (128, 64), (256, 128)) for bk in (32, 64)
             for w, st in ((4, 3), (8, 4))]
    others = [dataclasses.replace(t, order=o) for o in GRID_ORDERS if o != "vocab_fastest" for t in table]
    seen: dict[Tiles, None] = dict.fromkeys(table + plain + coarser + extra + others)
    return tuple(seen)


SWEEP = _sweep()
DRY_SWEEP = tuple(Tiles(16, 32, 16, 1, 1, order=o, group=2) for o in GRID_ORDERS) + (
    Tiles(32, 16, 32, 1, 1), Tiles(16, 32, 16, 1, 1, promote=16))
# device -> (token counts, hidden, vocab, err_tokens)
DEFAULTS = {"cuda": ((4800, 19000), 3584, 152064, 256), "cpu": ((20, 33), 24, 100, 33)}


def _interpreter_problem() -> str | None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET=1 is not set"
    return triton_missing()


def run_sweep(device: str = "cuda", *, tokens: tuple[int, ...] | None = None, hidden: int | None = None,
              vocab: int | None = None, reps: int = 2, configs: tuple[Tiles, ...] | None = None,
              budget_s: float | None = None) -> dict[str, Any]:
    """Every configuration of ``configs`` (default :data:`SWEEP` on CUDA, :data:`DRY_SWEEP` on the CPU),
    each compiled once and measured at every token count before the next; past ``budget_s`` seconds
    the configurations left are rows saying so (the sweep must leave its JSON inside its time limit)."""
    if device == "cuda":
        dev = require_cuda()
    else:
        dev = torch.device("cpu")
        problem = _interpreter_problem()
        if problem:
            raise ValueError(f"the sweep on the CPU runs Triton's interpreter: {problem} (run with TRITON_INTERPRET=1 "
                             "and <venv>/triton-interpreter on PYTHONPATH)")
    d_tokens, d_hidden, d_vocab, err_tokens = DEFAULTS[dev.type]
    tokens, hidden, vocab = tokens or d_tokens, hidden or d_hidden, vocab or d_vocab
    configs = configs or (SWEEP if dev.type == "cuda" else DRY_SWEEP)
    if min(tokens) < 1 or hidden < 1 or vocab < 2 or reps < 1:
        raise ValueError(f"need tokens, hidden, reps >= 1 and vocab >= 2; got tokens={tokens}, hidden={hidden}, "
                         f"vocab={vocab}, reps={reps}")
    from rlpad.core.lm_head_triton import triton_log_probs_and_entropy

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter's bf16 dot is meaningless
    gpu = device_gpu(dev)[0] if dev.type == "cuda" else GPUS["H100"]
    name, _ = device_peak(dev)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": name, "torch": torch.__version__,
                              "dtype": str(dtype).split(".")[-1], "hidden": hidden, "vocab": vocab, "reps": reps,
                              "err_tokens": err_tokens, "model_gpu": gpu.name, "rows": [], "best": {}, "bounds": {}}
    inputs, floors, refs = {}, {}, {}
    for n in tokens:
        x = inputs[n] = head_inputs(n, hidden, vocab, dtype=dtype, device=dev, seed=n)
        h, w = x["hidden"], x["weight"]
        e = min(n, err_tokens)
        refs[n] = (e, *fp64_head(h[:e], w, x["labels"][:e]))
        result["bounds"][str(n)] = head_bounds(h[:e], w, x["labels"][:e], *refs[n][1:])

        def floor(backward: bool, h=h, w=w) -> None:
            logits = h @ w.t()
            if backward:
                torch.mm(logits, w), torch.mm(logits.t(), h)

        floors[n] = interleaved_medians({"fwd": lambda: floor(False), "fwdbwd": lambda: floor(True)}, reps, dev)
    start = time.perf_counter()
    for i, tiles in enumerate(configs):  # the first always runs
        spent = budget_s is not None and i > 0 and time.perf_counter() - start > budget_s
        for n in tokens:
            x = inputs[n]
            row: dict[str, Any] = {"tokens": n, "tiles": tiles.name, **dataclasses.asdict(tiles),
                                   "hbm_gb": forward_traffic(n, hidden, vocab, tiles, gpu, elem=x["hidden"].element_size())["total_gb"]}
            if spent:
                row["error"] = f"not run: the sweep's time budget ({budget_s:g} s) was spent"
                result["rows"].append(row)
                continue
            try:
                row.update(_measure(triton_log_probs_and_entropy, x, tiles, reps, dev, *refs[n]))
                lp_bound, ent_bound = result["bounds"][str(n)]
                row["ok"] = row["lp_err"] < lp_bound and row["ent_err"] < ent_bound
                row["fwd_vs_floor"] = row["fwd_s"] / floors[n]["fwd"]
                row["fwdbwd_vs_floor"] = row["fwdbwd_s"] / floors[n]["fwdbwd"]
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or fit: its row says why
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            result["rows"].append(row)
    result["rows"].sort(key=lambda r: tokens.index(r["tokens"]))  # per token count, in the sweep's order
    for n in tokens:
        good = [r for r in result["rows"] if r["tokens"] == n and r.get("ok")]
        result["best"][str(n)] = min(good, key=lambda r: r["fwdbwd_s"])["tiles"] if good else None
    result["floor"] = {str(n): f for n, f in floors.items()}
    result["budget_s"] = budget_s
    return result


def _measure(head, x, tiles, reps, dev, e, ref_lp, ref_ent) -> dict[str, Any]:
    h, w, y = x["hidden"], x["weight"], x["labels"]

    def one(backward: bool):
        h.requires_grad_(backward)
        w.requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            lp, ent = head(h, w, y, chunk_size=h.shape[0], tiles=tiles)
            if backward:
                ((lp * x["g_lp"]).sum() + (ent * x["g_ent"]).sum()).backward()
        h.grad = w.grad = None
        return lp.detach(), ent.detach()

    lp, ent = one(False)
    lp_err = (lp[:e].double() - ref_lp).abs().max().item()
    ent_err = (ent[:e].double() - ref_ent).abs().max().item()
    seconds = interleaved_medians({"fwd": lambda: one(False), "fwdbwd": lambda: one(True)}, reps, dev)
    return {"fwd_s": seconds["fwd"], "fwdbwd_s": seconds["fwdbwd"], "lp_err": lp_err, "ent_err": ent_err}



def sweep_tables(result: dict[str, Any]) -> list[Table]:
    """One table: a row per (tokens, configuration), the fastest exact one starred."""
    rows = []
    for r in result["rows"]:
        star = " *" if result["best"].get(str(r["tokens"])) == r["tiles"] else ""
        if "error" in r:
            rows.append([str(r["tokens"]), r["tiles"], f"{r['hbm_gb']:.1f}", r["error"], "-", "-", "-", "-", "-"])
            continue
        rows.append([str(r["tokens"]), r["tiles"] + star, f"{r['hbm_gb']:.1f}", f"{r['fwd_s'] * 1e3:.2f}",
                     f"{r['fwd_vs_floor']:.2f}x", f"{r['fwdbwd_s'] * 1e3:.2f}", f"{r['fwdbwd_vs_floor']:.2f}x",
                     f"{r['lp_err']:.1e} / {r['ent_err']:.1e}", "yes" if r["ok"] else "NO"])
    title = (f"LM head tile sweep, {result['device']} (torch {result['torch']}), {result['dtype']}, hidden "
             f"{result['hidden']}, vocab {result['vocab']}; medians of {result['reps']}")
    notes = [f"HBM GB: the forward launch's traffic by rlpad.core.lm_head_plan.forward_traffic on {result['model_gpu']}; "
             f"errors: max |x - fp64| of log-prob / entropy over the first {result['err_tokens']} tokens, ok: both < "
             f"{HEAD_LP_BOUND:g} or {FP32_SLACK:g}x torch's fp32-logits head (lp / ent bounds: "
             + ", ".join(f"{n}: {a:.1e} / {b:.1e}" for n, (a, b) in result.get("bounds", {}).items())
             + "); *: the fastest ok configuration (fwd+bwd) per token count."]
    return [Table(["tokens", "tiles", "HBM GB", "fwd ms", "/ floor", "fwd+bwd ms", "/ floor", "lp / ent err", "ok"],
                  rows, title=title, notes=notes, align="rlrrrrrrl")]
