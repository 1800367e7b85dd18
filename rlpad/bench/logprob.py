"""``rlpad bench logprob``: padded vs remove-padding log-prob forward, and LM-head memory.

Speed: a rollout-shaped batch (16 rows, prompt <= 256 left-padded, response <= 256
right-padded, about half valid) on two model sizes (rlpad/bench/models.py); forward-only and
forward+backward; medians of interleaved repetitions; measured speedup next to the FLOP-ideal one
(padded FLOPs / remove-padding FLOPs, :mod:`rlpad.bench.flops`). Memory: log-prob + entropy
forward+backward at vocab 151936 and 4096 tokens, full logits vs chunked LM head, each variant in
its own process (peak RSS growth, :mod:`rlpad.bench.head_memory`); the bytes a distillation teacher
hands on per step, jagged vs padded (:mod:`rlpad.bench.teacher_bytes`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from rlpad.bench.flops import padded_and_packed_flops
from rlpad.bench.head_memory import DISTILL_TOPK, DISTILL_VARIANTS, VARIANTS, measure_in_subprocess
from rlpad.bench.measure import interleaved_medians, path_rates
from rlpad.bench.models import bench_model
from rlpad.bench.table import Table, write_json
from rlpad.bench.teacher_bytes import run_teacher_bytes
from rlpad.core.forward import compute_log_probs
from rlpad.embedded.synthetic import rollout_batch

__all__ = ["DEFAULT_MODELS", "bench_speed", "run", "tables"]

DEFAULT_MODELS = ("tiny", "40m")  # rows of rlpad.bench.models.MODEL_SHAPES


def bench_speed(model_name: str, *, batch: int = 16, prompt: int = 256, response: int = 256,
                reps: int = 3, seed: int = 0) -> dict[str, Any]:
    """Median seconds of padded and rmpad forward / forward+backward, tokens/s and FLOP-ideal ratio."""
    model = bench_model(model_name, seed=seed).train()
    data = rollout_batch(batch, prompt, response, vocab_size=model.config.vocab_size, seed=seed, edge_rows=False)
    mask = data["response_mask"].float()
    args = (model, data["input_ids"], data["attention_mask"], data["position_ids"], response)

    def forward(rmpad: bool) -> None:
        with torch.no_grad():
            compute_log_probs(*args, use_remove_padding=rmpad, calculate_entropy=True)

    def forward_backward(rmpad: bool) -> None:
        lp, ent = compute_log_probs(*args, use_remove_padding=rmpad, calculate_entropy=True)
        ((lp + 0.01 * ent) * mask).sum().div(mask.sum()).backward()
        model.zero_grad(set_to_none=True)

    passes = {f"{mode}_{path}": (lambda fn=fn, rm=(path == "rmpad"): fn(rm))
              for mode, fn in (("fwd", forward), ("fwdbwd", forward_backward)) for path in ("padded", "rmpad")}
    seconds = interleaved_medians(passes, reps, torch.device("cpu"))
    padded_flops, packed_flops = padded_and_packed_flops(model.config, data["attention_mask"], response)
    flops = {"padded": padded_flops["total"], "rmpad": packed_flops["total"]}
    valid_tokens = int(data["attention_mask"].sum())
    result: dict[str, Any] = {
        "model": model_name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "rows": batch, "seq_len": prompt + response, "valid_tokens": valid_tokens,
        "valid_fraction": valid_tokens / data["attention_mask"].numel(),
        "flop_ideal_speedup": flops["padded"] / flops["rmpad"],
        "padded_gflop": flops["padded"] / 1e9, "rmpad_gflop": flops["rmpad"] / 1e9,
    }
    for mode, factor in (("fwd", 1), ("fwdbwd", 3)):
        result[mode] = path_rates(valid_tokens, {p: seconds[f"{mode}_{p}"] for p in flops}, flops,
                                  base="padded", other="rmpad", factor=factor)
    return result


def tables(result: dict[str, Any]) -> list[Table]:
    """The speed table and the LM-head memory lines of a :func:`run` result."""
    rows = []
    for r in result["speed"]:
        for mode in ("fwd", "fwdbwd"):
            m = r[mode]
            rows.append([r["model"], mode, f"{m['padded_s']:.3f}", f"{m['rmpad_s']:.3f}", f"{m['rmpad_tok_s']:.0f}",
                         f"{m['speedup']:.2f}x", f"{r['flop_ideal_speedup']:.2f}x", f"{m['speedup_vs_ideal']:.2f}x"])
    out = [Table(["model", "pass", "padded s", "rmpad s", "rmpad tok/s", "speedup", "ideal", "of ideal"], rows,
                 title="log-prob + entropy, padded vs remove-padding (median seconds; tokens/s counts valid tokens)")]
    mem = {m["variant"]: m for m in result.get("memory", [])}
    if mem:
        first = next(iter(mem.values()))
        rows = [[name, f"+{m['peak_gib']:.2f}", f"{m['seconds']:.1f}"] for name, m in mem.items()]
        notes = ([f"chunked / full peak memory: {mem['chunked']['peak_gib'] / mem['full']['peak_gib']:.3f}"]
                 if "full" in mem and "chunked" in mem else [])
        out.append(Table(["LM head", "peak GiB", "s"], rows, notes=notes,
                         title=f"LM-head log-prob + entropy, fwd+bwd, {first['tokens']} tokens x vocab {first['vocab']}"))
    distill = {m["variant"]: m for m in result.get("distill_memory", [])}
    if distill:
        first = next(iter(distill.values()))
        rows = [[name, f"+{m['peak_gib']:.2f}", f"{m['seconds']:.1f}"] for name, m in distill.items()]
        notes = [f"{what} chunked / full peak memory: {distill[c]['peak_gib'] / distill[f]['peak_gib']:.3f}"
                 for what, f, c in (("teacher top-k", "topk_full", "topk_chunked"),
                                    ("student at k ids", "at_ids_full", "at_ids_chunked"))
                 if f in distill and c in distill and distill[f]["peak_gib"] > 0]
        out.append(Table(["distillation head", "peak GiB", "s"], rows, notes=notes,
                         title=f"distillation (forward_kl_topk, k = {DISTILL_TOPK}): the teacher's top-k (fwd) and "
                               f"the student's log-probs at them (fwd+bwd), {first['tokens']} tokens x vocab "
                               f"{first['vocab']}"))
    tb = result.get("teacher_bytes")
    if tb:
        rows = [[layout, f"{tb[layout]['bytes'] / 2**20:.1f}", f"{tb[layout]['pickled'] / 2**20:.1f}",
                 f"{tb[layout]['step_gb']:.2f}"] for layout in ("padded", "jagged")]
        step = tb["step"]
        out.append(Table(["layout", "MiB held", "MiB pickled", f"GB per step (B {step['rows']}, R {step['response']})"],
                         rows, notes=[f"jagged / padded: {tb['ratio']:.3f}"],
                         title=f"distillation: the teacher's top-k (k = {tb['topk']}) per step, {tb['rows']} rows x "
                               f"{tb['response']} response positions, {tb['scored']} scored"))
    return out


def run(models: Sequence[str] | None = None, *, reps: int = 3, memory: bool = True, out: str | None = None) -> dict[str, Any]:
    """The whole benchmark; writes JSON to ``out`` when given (:func:`tables` formats the result)."""
    torch.set_num_threads(os.cpu_count() or 1)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "speed": [bench_speed(name, reps=reps) for name in (models or DEFAULT_MODELS)],
        "memory": [measure_in_subprocess(v) for v in VARIANTS] if memory else [],
        "distill_memory": [measure_in_subprocess(v) for v in DISTILL_VARIANTS] if memory else [],
        "teacher_bytes": run_teacher_bytes() if memory else None,
    }
    if out:
        write_json(result, out)
    return result
