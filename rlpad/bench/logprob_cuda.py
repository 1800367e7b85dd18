"""``rlpad bench logprob --device cuda``: padded sdpa vs remove-padding on a Qwen2.5-0.5B-shaped model.

Random weights in bf16, row ``qwen2.5-0.5b`` of :data:`rlpad.bench.models.MODEL_SHAPES`; a
rollout-shaped batch of 64 rows, prompts <= 512 left-padded, responses <= 1024 right-padded, about
half the tokens valid.

* speed: padded (sdpa with the padding mask) vs packed (flash_attention_2 when flash-attn is
  installed, else rlpad_varlen = torch's varlen kernel), forward and forward+backward, in
  micro-batches of ``micro_rows`` rows and with the LM head chunked, as the workers run them;
  medians of interleaved repetitions (CUDA-synchronised wall time); tokens/s of valid tokens,
  speedup next to the FLOP-ideal one (:mod:`rlpad.bench.flops`), and achieved TFLOP/s and MFU of
  the FLOPs each path executes (fwd+bwd = 3x forward) against the device's dense bf16 peak
  (:mod:`rlpad.bench.mfu`), all through :func:`rlpad.bench.measure.path_rates`;
* memory: LM-head log-prob + entropy forward+backward on 4096 tokens, full logits vs chunked,
  peak ``torch.cuda.max_memory_allocated`` above what the inputs hold (:mod:`rlpad.bench.head_memory`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlpad.bench.flops import padded_and_packed_flops
from rlpad.bench.head_memory import VARIANTS, measure_cuda
from rlpad.bench.measure import device_peak, interleaved_medians, path_rates, require_cuda
from rlpad.bench.mfu import PEAK_SOURCE
from rlpad.bench.models import bench_model
from rlpad.bench.table import Table
from rlpad.core.attn_choice import resolve_attn_implementation
from rlpad.core.forward import compute_log_probs
from rlpad.embedded.synthetic import rollout_batch

__all__ = ["CUDA_MODEL", "cuda_tables", "measure_speed", "run_cuda"]

CUDA_MODEL = "qwen2.5-0.5b"  # the row of rlpad.bench.models.MODEL_SHAPES


def measure_speed(device: torch.device, model_name: str, *, rows: int, prompt: int, response: int,
                  micro_rows: int, chunk: int, reps: int, seed: int = 0) -> dict[str, Any]:
    """Padded sdpa vs packed, forward and forward+backward, for table row ``model_name`` in bf16 on
    any ``device`` (MFU only on a GPU of the peak table)."""
    if micro_rows < 1 or rows % micro_rows:
        raise ValueError(f"micro_rows={micro_rows} must be >= 1 and divide rows={rows}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    packed_impl = resolve_attn_implementation("auto", device)
    model = bench_model(model_name, seed=seed, dtype=torch.bfloat16, device=device, attn_implementation="sdpa").train()
    data = rollout_batch(rows, prompt, response, vocab_size=model.config.vocab_size, seed=seed, edge_rows=False)
    data = {k: v.to(device) for k, v in data.items()}
    pieces = [{k: v[i : i + micro_rows] for k, v in data.items()} for i in range(0, rows, micro_rows)]
    valid_tokens = int(data["attention_mask"].sum())

    def one_pass(rmpad: bool, backward: bool) -> None:
        model.set_attn_implementation(packed_impl if rmpad else "sdpa")
        for p in pieces:
            with torch.set_grad_enabled(backward):
                lp, ent = compute_log_probs(model, p["input_ids"], p["attention_mask"], p["position_ids"], response,
                                            use_remove_padding=rmpad, calculate_entropy=True, logits_chunk_size=chunk)
                if backward:
                    mask = p["response_mask"].float()
                    ((lp + 0.01 * ent) * mask).sum().div(mask.sum().clamp(min=1)).backward()
        model.zero_grad(set_to_none=True)

    passes = {f"{mode}_{path}": (lambda rm=(path == "rmpad"), bwd=(mode == "fwdbwd"): one_pass(rm, bwd))
              for mode in ("fwd", "fwdbwd") for path in ("padded", "rmpad")}
    seconds = interleaved_medians(passes, reps, device)
    padded, packed = padded_and_packed_flops(model.config, data["attention_mask"].cpu(), response)  # = sum of pieces
    flops = {"padded": padded["total"], "rmpad": packed["total"]}
    name, peak = device_peak(device)
    result: dict[str, Any] = {
        "device": name, "peak": {"label": peak[0], "bf16_tflops": peak[1], "source": PEAK_SOURCE} if peak else None,
        "torch": torch.__version__, "model": model_name, "packed_attention": packed_impl, "padded_attention": "sdpa",
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "rows": rows, "micro_rows": micro_rows,
        "seq_len": prompt + response, "valid_tokens": valid_tokens,
        "valid_fraction": valid_tokens / data["attention_mask"].numel(),
        "flop_ideal_speedup": flops["padded"] / flops["rmpad"],
        "padded_tflop": flops["padded"] / 1e12, "rmpad_tflop": flops["rmpad"] / 1e12,
    }
    for mode, factor in (("fwd", 1), ("fwdbwd", 3)):
        result[mode] = path_rates(valid_tokens, {p: seconds[f"{mode}_{p}"] for p in flops}, flops, base="padded",
                                  other="rmpad", factor=factor, peak_tflops=peak[1] if peak else None)
    return result


def cuda_tables(result: dict[str, Any]) -> list[Table]:
    """The speed table and the LM-head memory line of a :func:`run_cuda` result."""
    s = result["speed"]
    peak = s["peak"]
    rows = []
    for mode in ("fwd", "fwdbwd"):
        m = s[mode]
        mfus = [f"{m['padded_mfu']:.1%}", f"{m['rmpad_mfu']:.1%}"] if "rmpad_mfu" in m else ["-", "-"]
        rows.append([mode, f"{m['padded_s']:.3f}", f"{m['rmpad_s']:.3f}", f"{m['rmpad_tok_s']:.0f}", f"{m['speedup']:.2f}x",
                     f"{m['flop_ideal_speedup']:.2f}x", f"{m['speedup_vs_ideal']:.2f}x", f"{m['padded_tflops']:.1f}",
                     f"{m['rmpad_tflops']:.1f}", *mfus])
    title = (f"{s['device']} (torch {s['torch']}), {s['model']}-shaped bf16 ({s['params_m']:.0f}M), {s['rows']} rows "
             f"x {s['seq_len']} (micro-batches of {s['micro_rows']}), {s['valid_fraction']:.0%} valid; packed attention: "
             f"{s['packed_attention']}; bf16 peak: " + (f"{peak['bf16_tflops']:.0f} TFLOP/s ({peak['label']})" if peak
                                                        else "unknown device, no MFU"))
    out = [Table(["pass", "padded s", "rmpad s", "rmpad tok/s", "speedup", "ideal", "of ideal", "pad TF/s", "rm TF/s",
                  "pad MFU", "rm MFU"], rows, title=title)]
    mem = {m["variant"]: m for m in result.get("memory", [])}
    if "full" in mem and "chunked" in mem:
        out.append(Table(notes=[
            f"LM-head log-prob + entropy fwd+bwd, {mem['full']['tokens']} tokens x vocab {mem['full']['vocab']}, "
            f"bf16, torch.cuda.max_memory_allocated above the inputs: full {mem['full']['peak_gib']:.2f} GiB, "
            f"chunked {mem['chunked']['peak_gib']:.2f} GiB ({mem['chunked']['peak_gib'] / mem['full']['peak_gib']:.3f})"]))
    return out


def run_cuda(*, reps: int = 3, memory: bool = True, micro_rows: int = 16, rows: int = 64, prompt: int = 512,
             response: int = 1024, chunk: int = 4096) -> dict[str, Any]:
    """The whole CUDA benchmark; returns the result (the CLI prints :func:`cuda_tables` and writes the JSON)."""
    device = require_cuda()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "speed": measure_speed(device, CUDA_MODEL, rows=rows, prompt=prompt, response=response, micro_rows=micro_rows,
                               chunk=chunk, reps=reps),
        "memory": [measure_cuda(v, device) for v in VARIANTS] if memory else [],
    }
    return result
