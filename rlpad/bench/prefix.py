"""``rlpad bench prefix``: remove-padding vs shared-prompt log-prob forward on GRPO-shaped batches.

Batches of 8 groups x n=8 (every prompt P tokens, responses of uniform random length in [1, R]),
at P=512/R<=256 and P=128/R<=512. Forward and forward+backward (log-prob + entropy, token-mean
loss, LM head chunked), medians of interleaved repetitions; tokens/s count the valid tokens of the
padded batch (the same work for both paths). FLOP-ideal speedup = rmpad FLOPs / shared FLOPs
(:mod:`rlpad.bench.flops`: decoder linear + attention + LM head; the head is the same for both)
and, for reference, the decoder-only ideal (linear + attention).

* CPU (default): the ``40m`` model in fp32, the whole batch in one call;
* ``--device cuda``: the ``qwen2.5-0.5b`` shape in bf16, micro-batches of whole groups, plus
  TFLOP/s of the FLOPs each path executes and MFU (:mod:`rlpad.bench.mfu`); then ``7b-layers``
  (where the GPU, not the host, is the bottleneck) at P=512 / R<=256, one group per micro-batch
  (:data:`CUDA_MODELS`; ``--models`` picks).

Both paths run the ``rlpad_varlen`` attention (the shared prompt needs it), so the ratio isolates
the prompt sharing.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from rlpad.bench.flops import forward_flops, packed_work, shared_prompt_work
from rlpad.bench.measure import device_peak, interleaved_medians, path_rates, require_cuda
from rlpad.bench.mfu import PEAK_SOURCE
from rlpad.bench.models import bench_model
from rlpad.bench.table import Table, write_json
from rlpad.core.attention import VARLEN_ATTENTION
from rlpad.core.forward import compute_log_probs
from rlpad.core.attn_dispatch import SDPA, choose_kernel, device_kernels
from rlpad.core.shared_prompt import prompt_groups
from rlpad.embedded.synthetic import grpo_batch

__all__ = ["CUDA_MODEL", "CUDA_MODELS", "GROUPS", "N", "SHAPES", "bench_shape", "run", "run_cuda", "tables"]

SHAPES = ((512, 256), (128, 512))  # (prompt length, max response length)
GROUPS, N = 8, 8
CHUNK = 1024  # LM head chunk: the (N, V) logits never exist whole (memory; same for both paths)
CUDA_MODEL = "qwen2.5-0.5b"  # the row of rlpad.bench.models.MODEL_SHAPES that --device cuda runs first
# --device cuda: model row -> (shapes, rows per micro-batch); 7b-layers: issue #54's shared prompts where the GPU
# is the bottleneck (target: >= 0.8 of the FLOP ideal)
CUDA_MODELS = {CUDA_MODEL: (SHAPES, 16), "7b-layers": (((512, 256),), 8)}


def bench_shape(model: torch.nn.Module, prompt: int, response: int, *, reps: int = 3, seed: int = 0,
                groups: int = GROUPS, micro_rows: int | None = None, chunk: int = CHUNK, warmup: bool = False,
                peak_tflops: float | None = None) -> dict[str, Any]:
    """Median seconds of rmpad and shared-prompt forward / forward+backward on one batch shape, on
    the model's device; ``micro_rows`` (a multiple of n, default all rows) rows per call."""
    rows = groups * N
    micro_rows = micro_rows or rows
    if micro_rows % N or rows % micro_rows:
        raise ValueError(f"micro_rows={micro_rows} must be a multiple of n={N} (whole groups) and divide rows={rows}")
    param = next(model.parameters())
    device = param.device
    data = grpo_batch(groups, N, prompt, response, vocab_size=model.config.vocab_size, seed=seed, min_prompt=prompt)
    pieces = [{k: v[i : i + micro_rows].to(device) for k, v in data.items()} for i in range(0, rows, micro_rows)]

    def one_pass(share: bool, backward: bool) -> None:
        for p in pieces:
            with torch.set_grad_enabled(backward):
                lp, ent = compute_log_probs(model, p["input_ids"], p["attention_mask"], p["position_ids"], response,
                                            use_remove_padding=True, share_prompts=share, calculate_entropy=True,
                                            logits_chunk_size=chunk)  # fmt: skip
                if backward:
                    mask = p["response_mask"].float()
                    ((lp + 0.01 * ent) * mask).sum().div(mask.sum().clamp(min=1)).backward()
        model.zero_grad(set_to_none=True)

    passes = {f"{mode}_{path}": (lambda sh=(path == "shared"), bwd=(mode == "fwdbwd"): one_pass(sh, bwd))
              for mode in ("fwd", "fwdbwd") for path in ("rmpad", "shared")}
    seconds = interleaved_medians(passes, reps, device, warmup=warmup)
    # The shared attention's response blocks: causal where a varlen kernel runs them, masked sdpa
    # otherwise (the dispatch both attentions use: rlpad.core.attn_dispatch).
    varlen = choose_kernel(device_kernels(device), param.dtype) != SDPA
    flops = {"rmpad": {}, "shared": {}}
    shared_tokens = 0
    for p in pieces:
        mask = p["attention_mask"].cpu()
        groups_of_rows = prompt_groups(p["input_ids"].cpu(), mask, p["position_ids"].cpu(), response)
        shared = shared_prompt_work(mask, response, groups_of_rows, causal_responses=varlen)
        shared_tokens += shared.tokens
        for path, work in (("rmpad", packed_work(mask, response)), ("shared", shared)):
            for key, value in forward_flops(model.config, work).items():
                flops[path][key] = flops[path].get(key, 0.0) + value
    total = {path: f["total"] for path, f in flops.items()}
    tokens = int(data["attention_mask"].sum())
    decoder = {path: f["linear"] + f["attention"] for path, f in flops.items()}
    result: dict[str, Any] = {
        "prompt": prompt, "max_response": response, "rows": rows, "micro_rows": micro_rows, "groups": groups,
        "valid_tokens": tokens, "shared_tokens": shared_tokens,
        "flop_ideal_speedup": total["rmpad"] / total["shared"],
        "decoder_flop_ideal_speedup": decoder["rmpad"] / decoder["shared"],
        "rmpad_gflop": total["rmpad"] / 1e9, "shared_gflop": total["shared"] / 1e9,
    }
    for mode, factor in (("fwd", 1), ("fwdbwd", 3)):
        result[mode] = path_rates(tokens, {p: seconds[f"{mode}_{p}"] for p in total}, total, base="rmpad",
                                  other="shared", factor=factor, peak_tflops=peak_tflops)
    return result


def tables(result: dict[str, Any]) -> list[Table]:
    """The remove-padding vs shared-prompt table of a :func:`run` / :func:`run_cuda` result, one per model."""
    peak = result.get("peak")
    models = result.get("models") or [{k: result[k] for k in ("model", "params_m", "dtype")}]
    out = []
    for m in models:
        title = (f"log-prob + entropy, {m['model']} ({m['params_m']:.1f}M, {m['dtype']}) on {result['device']}, "
                 f"{result['groups']} groups x n={N}: remove-padding vs shared prompt (median seconds; tokens/s count "
                 "valid tokens; TF/s of the FLOPs each path executes" + (f"; MFU of {peak['bf16_tflops']:.0f} TFLOP/s "
                                                                         "bf16)" if peak else ")"))
        rows = []
        for r in result["shapes"]:
            if r.get("model", m["model"]) != m["model"]:
                continue
            for mode in ("fwd", "fwdbwd"):
                x = r[mode]
                mfus = [f"{x['rmpad_mfu']:.1%}", f"{x['shared_mfu']:.1%}"] if peak and "rmpad_mfu" in x else []
                rows.append([f"{r['prompt']}/{r['max_response']}", mode, f"{x['rmpad_s']:.3f}", f"{x['shared_s']:.3f}",
                             f"{x['rmpad_tok_s']:.0f}", f"{x['shared_tok_s']:.0f}", f"{x['speedup']:.2f}x",
                             f"{r['flop_ideal_speedup']:.2f}x", f"{x['speedup_vs_ideal']:.2f}x",
                             f"{x['rmpad_tflops']:.2f}", f"{x['shared_tflops']:.2f}", *mfus])
        columns = ["P/R<=", "pass", "rmpad s", "shared s", "rmpad tok/s", "shared tok/s", "speedup", "ideal",
                   "of ideal", "rm TF/s", "sh TF/s"] + (["rm MFU", "sh MFU"] if rows and len(rows[0]) == 13 else [])
        out.append(Table(columns, rows, title=title))
    return out


def _run(model: torch.nn.Module, model_name: str, *, reps: int, shapes, groups: int, micro_rows: int | None,
         chunk: int, warmup: bool) -> dict[str, Any]:
    device = next(model.parameters()).device
    name, peak = device_peak(device)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": name,
        "peak": {"label": peak[0], "bf16_tflops": peak[1], "source": PEAK_SOURCE} if peak else None,
        "threads": torch.get_num_threads(), "model": model_name, "dtype": str(next(model.parameters()).dtype),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "groups": groups, "shapes": [],
    }
    for p, r in shapes:
        result["shapes"].append({"model": model_name, **bench_shape(
            model, p, r, reps=reps, groups=groups, micro_rows=micro_rows, chunk=chunk, warmup=warmup,
            peak_tflops=peak[1] if peak else None)})
        print(json.dumps(result["shapes"][-1]), flush=True)
    return result


def run(model_name: str = "40m", *, reps: int = 3, shapes=SHAPES, groups: int = GROUPS,
        out: str | None = None) -> dict[str, Any]:
    """The CPU benchmark (fp32); writes JSON to ``out`` when given (:func:`tables` formats the result). ``groups``
    fewer than 8 shrinks every batch (a busy machine); both paths scale alike per group."""
    torch.set_num_threads(os.cpu_count() or 1)
    model = bench_model(model_name, seed=0).train()
    warm = grpo_batch(2, 2, 16, 16, vocab_size=model.config.vocab_size, seed=1)
    for share in (False, True):  # one-time costs out of the timings
        compute_log_probs(model, warm["input_ids"], warm["attention_mask"], warm["position_ids"], 16,
                          use_remove_padding=True, share_prompts=share)[0].sum().backward()  # fmt: skip
    model.zero_grad(set_to_none=True)
    result = _run(model, model_name, reps=reps, shapes=shapes, groups=groups, micro_rows=None, chunk=CHUNK,
                  warmup=False)
    if out:
        write_json(result, out)
    return result


def run_cuda(*, reps: int = 3, groups: int = GROUPS, micro_rows: int | None = None, shapes=None,
             models: list[str] | None = None, chunk: int = 4096, dry_run: bool = False) -> dict[str, Any]:
    """The CUDA benchmark: each of ``models`` (default every row of :data:`CUDA_MODELS`) in bf16, micro-batches
    of whole groups (``micro_rows``, default the model's), a warm-up round per shape; returns the result (the
    CLI prints :func:`tables`, writes the JSON). ``dry_run``: the same code on the CPU, the ``tiny`` model,
    2 groups, one shape of P = 8, R <= 8."""
    if dry_run:
        model = bench_model("tiny", seed=0, dtype=torch.bfloat16, attn_implementation=VARLEN_ATTENTION)
        return _run(model.train(), "tiny", reps=1, shapes=((8, 8),), groups=2, micro_rows=8, chunk=chunk, warmup=True)
    names = list(models or CUDA_MODELS)
    unknown = [n for n in names if n not in CUDA_MODELS]
    if unknown:
        raise ValueError(f"prefix --device cuda: unknown model(s) {unknown}; choose among {list(CUDA_MODELS)}")
    device = require_cuda()
    merged: dict[str, Any] = {}
    for name in names:
        own_shapes, own_rows = CUDA_MODELS[name]
        model = bench_model(name, seed=0, dtype=torch.bfloat16, device=device, attn_implementation=VARLEN_ATTENTION)
        result = _run(model.train(), name, reps=reps, shapes=shapes or own_shapes, groups=groups,
                      micro_rows=micro_rows or own_rows, chunk=chunk, warmup=True)
        del model
        torch.cuda.empty_cache()
        if not merged:
            merged = {**result, "models": [], "shapes": []}
        merged["models"].append({k: result[k] for k in ("model", "params_m", "dtype")})
        merged["shapes"] += result["shapes"]
    merged["model"] = "+".join(names)
    return merged
