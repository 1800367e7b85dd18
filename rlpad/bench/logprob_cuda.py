"""``rlpad bench logprob --device cuda``: rlpad's remove-padding beside padded and transformers packing.

Random weights in bf16, one batch shape per row of :data:`CUDA_SHAPES` (a model of
:data:`rlpad.bench.models.MODEL_SHAPES` and a rollout-shaped batch: prompts left-padded,
responses right-padded, about half the tokens valid). On the same tokens, in micro-batches, the
columns of :data:`COLUMNS`:

* ``rmpad``: rlpad's packed row (flash_attention_2 when flash-attn is installed, else
  rlpad_varlen = torch's varlen kernel), rlpad's LM head (the fused Triton kernel on a GPU,
  :mod:`rlpad.core.lm_head`), as the workers run it;
* ``padded``: rlpad's padded path, sdpa with the padding mask;
* ``packed_sdpa`` / ``packed_flex``: transformers packed (:mod:`rlpad.bench.peers`) with sdpa /
  flex_attention: full logits, fp32 log_softmax;
* ``packed_liger``: transformers packed with sdpa on a copy of the model with liger-kernel's fused
  RMSNorm, SwiGLU and rotary (``use_liger``; CUDA with liger-kernel installed, else not run, said
  under ``skipped``);
* ``packed_compiled``: rmpad on a copy of the model whose decoder layers run under
  ``torch.compile(dynamic=True)`` (``compile_decoder_layers``, :mod:`rlpad.core.fused_modules`; inductor on
  a GPU, aot_eager in the CPU dry run). Its compile time is measured apart, before any timing: one
  forward and one forward+backward over the micro-batches (``compile``: seconds and graphs compiled),
  and the graphs compiled during the timed rounds after it (``compile.graphs_after_warmup``, recompiles).
  A failure to compile puts the column under ``skipped`` with the error, the others still run.

Each column, forward and forward+backward (loss: mean log-prob + 0.01 x entropy over the
response tokens): medians of interleaved repetitions (CUDA-synchronised wall time), tokens/s of
valid tokens, achieved TFLOP/s and MFU of the FLOPs the column executes
(:mod:`rlpad.bench.flops`, fwd+bwd = 3x; :mod:`rlpad.bench.mfu`), rmpad's speed-up over it with
the FLOP-ideal one (:func:`rlpad.bench.measure.path_rates`), peak ``torch.cuda.max_memory_allocated``
over the pass (weights included), and the max |log-prob| and |entropy| difference vs rmpad on the valid response
tokens. Then one rmpad micro-batch under torch.profiler, forward and forward+backward: device time
by kernel kind, launches, host vs device time (:mod:`rlpad.bench.kernels`). Memory: LM-head
log-prob + entropy forward+backward on 4096 tokens, full logits vs chunked (:mod:`rlpad.bench.head_memory`).

The same code runs on the CPU at a tiny shape (tests/test_bench_cuda.py); there FlexAttention has
no backward, so ``packed_flex`` is forward only (the result says so under ``skipped``).
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlpad.bench.flops import forward_flops, packed_peer_work, packed_work, padded_work
from rlpad.bench.head_memory import VARIANTS, measure_cuda
from rlpad.bench.kernels import kind_table, profile_pass
from rlpad.bench.measure import device_peak, interleaved_medians, path_rates, require_cuda
from rlpad.bench.mfu import PEAK_SOURCE
from rlpad.bench.models import bench_model, model_shape
from rlpad.bench.peers import PEER_ATTENTION, liger_copy, packed_peer_log_probs
from rlpad.bench.table import Table
from rlpad.core.attn_choice import resolve_attn_implementation
from rlpad.core.forward import backbone_of, compute_log_probs
from rlpad.core.lm_head import choose_head, triton_missing
from rlpad.embedded.synthetic import rollout_batch

__all__ = ["COLUMNS", "COLUMN_SETS", "column_list", "CUDA_SHAPES", "DRY_SHAPES", "cuda_tables", "measure_shape", "run_cuda"]

COLUMNS = ("rmpad", "padded", "packed_sdpa", "packed_flex", "packed_liger", "packed_compiled")
# --columns: named sets; the GPU lane runs "peers", "compiled" and "flex" as three steps, each in its own time
# limit: compilation (inductor for packed_compiled, transformers' compiled flex_attention for packed_flex) is
# what a step can spend unseen (the H200 run of 2026-11-27: the five-column step wrote nothing in 180 s)
COLUMN_SETS = {"all": COLUMNS, "peers": ("rmpad", "padded", "packed_sdpa", "packed_liger"),
               "compiled": ("rmpad", "packed_compiled"), "flex": ("rmpad", "packed_flex")}
# name -> model row of rlpad.bench.models.MODEL_SHAPES and its batch; `make test-gpu` runs both (about 2 minutes
# on an H100, estimated from the 2026-11-24 figures: see docs/development.md#the-gpu-lane).
CUDA_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model="qwen2.5-0.5b", rows=64, prompt=512, response=1024, micro_rows=16),
    "7b-layers": dict(model="7b-layers", rows=32, prompt=512, response=1536, micro_rows=8),
}
DRY_SHAPES = {"tiny": dict(model="tiny", rows=4, prompt=8, response=12, micro_rows=2)}  # the dry run, on the CPU
NO_CPU_BACKWARD = {"packed_flex": "FlexAttention has no backward on the CPU"}


def column_list(spec: str) -> tuple[str, ...]:
    """The columns of ``spec``: a name of :data:`COLUMN_SETS` or a comma list of :data:`COLUMNS` (rmpad first)."""
    if spec in COLUMN_SETS:
        return COLUMN_SETS[spec]
    names = tuple(c.strip() for c in spec.split(",") if c.strip())
    bad = [c for c in names if c not in COLUMNS]
    if bad or "rmpad" not in names:
        raise ValueError(f"--columns {spec!r}: name a set of {sorted(COLUMN_SETS)} or columns among {list(COLUMNS)} "
                         f"including 'rmpad'" + (f"; unknown {bad}" if bad else ""))
    return ("rmpad", *(c for c in names if c != "rmpad"))


def _unavailable(column: str, device: torch.device) -> str | None:
    """Why ``column`` cannot run on ``device`` (None: it can)."""
    if column != "packed_liger":
        return None
    from rlpad.core.fused_modules import liger_missing

    return "liger-kernel's kernels need CUDA" if device.type != "cuda" else liger_missing()


def _compile_backend(device: torch.device) -> str:
    """packed_compiled's torch.compile backend: inductor on a GPU, aot_eager in the CPU dry run."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def _compiled_copy(model, packed_impl: str, device: torch.device):
    """A copy of ``model`` (same weights, ``packed_impl`` attention) with its decoder layers compiled."""
    from rlpad.core.fused_modules import compile_decoder_layers

    compiled = copy.deepcopy(model)
    compiled.set_attn_implementation(packed_impl)
    compile_decoder_layers(compiled, _compile_backend(device))
    return compiled


def _warm_up(fn: Callable, pieces: list[dict], device: torch.device) -> dict[str, float]:
    """Compile ``fn``'s graphs before any timing: one forward (no grad) and one forward+backward over
    ``pieces``; ``{"seconds": wall time of both, "graphs": graphs compiled}``."""
    from rlpad.core.fused_modules import compile_counts

    before = compile_counts()["graphs"]
    start = time.perf_counter()
    with torch.no_grad():
        for p in pieces:
            fn(p)
    for p in pieces:
        _loss(*fn(p), p["response_mask"]).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"seconds": time.perf_counter() - start, "graphs": compile_counts()["graphs"] - before}


def _column(model, column: str, packed_impl: str, response: int, chunk: int) -> tuple[str, Callable]:
    """``(attention implementation, fn(piece) -> (log_probs, entropy) (B, R))`` of ``column`` on one micro-batch."""
    if column == "packed_compiled":
        compiled = _compiled_copy(model, packed_impl, next(model.parameters()).device)

        def compiled_fn(p):
            compiled.zero_grad(set_to_none=True)
            return compute_log_probs(compiled, p["input_ids"], p["attention_mask"], p["position_ids"], response,
                                     use_remove_padding=True, calculate_entropy=True, logits_chunk_size=chunk)
        return packed_impl, compiled_fn
    if column == "packed_liger":
        fused = liger_copy(model)

        def liger_fn(p):
            fused.zero_grad(set_to_none=True)
            return packed_peer_log_probs(fused, p["input_ids"], p["attention_mask"], p["position_ids"], response)
        return PEER_ATTENTION[column], liger_fn
    if column in PEER_ATTENTION:
        return PEER_ATTENTION[column], lambda p: packed_peer_log_probs(
            model, p["input_ids"], p["attention_mask"], p["position_ids"], response)
    rmpad = column == "rmpad"
    return packed_impl if rmpad else "sdpa", lambda p: compute_log_probs(
        model, p["input_ids"], p["attention_mask"], p["position_ids"], response, use_remove_padding=rmpad,
        calculate_entropy=True, logits_chunk_size=chunk)


def _loss(lp: torch.Tensor, ent: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    mask = response_mask.float()
    return ((lp + 0.01 * ent) * mask).sum().div(mask.sum().clamp(min=1))


def measure_shape(device: torch.device, model_name: str, *, rows: int, prompt: int, response: int, micro_rows: int,
                  chunk: int, reps: int, columns: Sequence[str] = COLUMNS, profile: bool = True,
                  seed: int = 0) -> dict[str, Any]:
    """Every column of ``columns`` on one batch of model row ``model_name`` in bf16 on ``device``
    (MFU only on a GPU of the peak table); see the module docstring."""
    model_shape(model_name)  # ValueError naming the rows
    if micro_rows < 1 or rows % micro_rows:
        raise ValueError(f"micro_rows={micro_rows} must be >= 1 and divide rows={rows}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if "rmpad" not in columns or set(columns) - set(COLUMNS):
        raise ValueError(f"columns must include 'rmpad' and be among {COLUMNS}, got {list(columns)}")
    absent = {c: why for c in columns if (why := _unavailable(c, device))}
    columns = [c for c in columns if c not in absent]
    packed_impl = resolve_attn_implementation("auto", device)
    if "packed_flex" in columns:  # transformers compiles flex_attention: each shape starts with dynamo's whole
        torch._dynamo.reset()     # recompile budget (shapes x nnz x grad mode could reach its limit: then eager flex)
    model = bench_model(model_name, seed=seed, dtype=torch.bfloat16, device=device, attn_implementation="sdpa").train()
    data = rollout_batch(rows, prompt, response, vocab_size=model.config.vocab_size, seed=seed, edge_rows=False)
    data = {k: v.to(device) for k, v in data.items()}
    pieces = [{k: v[i : i + micro_rows] for k, v in data.items()} for i in range(0, rows, micro_rows)]
    valid_tokens = int(data["attention_mask"].sum())
    impls, fns = {}, {}
    for c in list(columns):
        try:
            impls[c], fns[c] = _column(model, c, packed_impl, response, chunk)
        except Exception as e:  # noqa: BLE001 - a peer that cannot be built (liger's patch): not run, said why
            if c == "rmpad":
                raise
            absent[c] = f"could not be built: {type(e).__name__}: {str(e)[:160]}"
            columns.remove(c)
    compiled = None
    if "packed_compiled" in columns:
        from rlpad.core.fused_modules import compile_counts

        try:
            compiled = _warm_up(fns["packed_compiled"], pieces, device)
            graphs_before_timing = compile_counts()["graphs"]
        except Exception as e:  # noqa: BLE001 - a compile failure: the column not run, said why
            absent["packed_compiled"] = f"did not compile: {type(e).__name__}: {str(e)[:160]}"
            columns.remove("packed_compiled")
            del fns["packed_compiled"]
    skipped = {f"fwdbwd.{c}": why for c, why in NO_CPU_BACKWARD.items() if c in columns and device.type == "cpu"}
    skipped.update(absent)

    # Agreement first, without gradients: each column's (B, R) numbers vs rmpad's on the valid response tokens.
    got = {}
    with torch.no_grad():
        for c, fn in fns.items():
            model.set_attn_implementation(impls[c])
            got[c] = [fn(p) for p in pieces]
    valid = data["response_mask"].bool()
    diff = {}
    for c in columns:
        lp, ent = (torch.cat([g[i] for g in got[c]]) for i in (0, 1))
        ref_lp, ref_ent = (torch.cat([g[i] for g in got["rmpad"]]) for i in (0, 1))
        diff[c] = {"lp_max_diff": (lp - ref_lp)[valid].abs().max().item(),
                   "ent_max_diff": (ent - ref_ent)[valid].abs().max().item()}
    del got

    peaks: dict[str, float] = {}

    def one_pass(column: str, backward: bool) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model.set_attn_implementation(impls[column])
        for p in pieces:
            with torch.set_grad_enabled(backward):
                lp, ent = fns[column](p)
                if backward:
                    _loss(lp, ent, p["response_mask"]).backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            key = f"{'fwdbwd' if backward else 'fwd'}.{column}"
            peaks[key] = max(peaks.get(key, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)

    passes = {f"{mode}.{c}": (lambda c=c, bwd=(mode == "fwdbwd"): one_pass(c, bwd))
              for mode in ("fwd", "fwdbwd") for c in columns if f"{mode}.{c}" not in skipped}
    seconds = interleaved_medians(passes, reps, device)
    mask = data["attention_mask"].cpu()
    works = {"rmpad": packed_work(mask, response), "padded": padded_work(mask, response),
             "packed_sdpa": packed_peer_work(mask, response, masked=True),
             "packed_flex": packed_peer_work(mask, response, masked=False),
             "packed_liger": packed_peer_work(mask, response, masked=True), "packed_compiled": packed_work(mask, response)}
    flops = {c: forward_flops(model.config, works[c])["total"] for c in columns}
    name, peak = device_peak(device)
    result: dict[str, Any] = {
        "device": name, "peak": {"label": peak[0], "bf16_tflops": peak[1], "source": PEAK_SOURCE} if peak else None,
        "torch": torch.__version__, "model": model_name, "packed_attention": packed_impl,
        "lm_head": choose_head(device.type, torch.bfloat16, torch.bfloat16, valid_tokens, triton_missing() is None),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "layers": model.config.num_hidden_layers,
        "rows": rows, "micro_rows": micro_rows, "prompt": prompt, "response": response,
        "seq_len": prompt + response, "valid_tokens": valid_tokens,
        "valid_fraction": valid_tokens / data["attention_mask"].numel(),
        "tflop": {c: f / 1e12 for c, f in flops.items()}, "skipped": skipped, "agreement": diff,
    }
    if compiled is not None:
        from rlpad.core.fused_modules import compile_counts

        result["compile"] = {**compiled, "graphs_after_warmup": compile_counts()["graphs"] - graphs_before_timing,
                             "backend": _compile_backend(device)}
    for mode, factor in (("fwd", 1), ("fwdbwd", 3)):
        result[mode] = {}
        for c in columns:
            if f"{mode}.{c}" not in seconds:
                continue
            s = {p: seconds[f"{mode}.{p}"] for p in {c, "rmpad"}}
            r = path_rates(valid_tokens, s, flops, base=c, other="rmpad", factor=factor,
                           peak_tflops=peak[1] if peak else None)
            result[mode][c] = {k.removeprefix(f"{c}_"): v for k, v in r.items() if k.startswith(f"{c}_")}
            result[mode][c].update(rmpad_speedup=r["speedup"], flop_ideal_speedup=r["flop_ideal_speedup"],
                                   of_ideal=r["speedup_vs_ideal"], peak_gib=peaks.get(f"{mode}.{c}"))
    if profile:
        first = pieces[0]
        rmpad = fns["rmpad"]
        model.set_attn_implementation(impls["rmpad"])

        def fwd() -> None:
            with torch.no_grad():
                rmpad(first)

        def fwdbwd() -> None:
            _loss(*rmpad(first), first["response_mask"]).backward()
            model.zero_grad(set_to_none=True)

        # An untimed session first: the process's first profiler session sets CUPTI up, and the forward was
        # profiled first (the H200 run of 2026-11-28: 44% of its device time "copy/index", more device time than
        # wall time, against 4.5% in forward+backward; issue #54); then the forward twice, to see it is stable.
        profile_pass(fwd, device)
        result["profile"] = {"micro_rows": micro_rows, "valid_tokens": int(first["attention_mask"].sum()),
                             "fwd": profile_pass(fwd, device, layers=backbone_of(model).layers),
                             "fwd_again": profile_pass(fwd, device),
                             "fwdbwd": profile_pass(fwdbwd, device)}
    return result


def _title(s: dict[str, Any]) -> str:
    peak = s["peak"]
    return (f"{s['device']} (torch {s['torch']}), {s['model']}-shaped bf16 ({s['params_m']:.0f}M, "
            f"{s['layers']} layers), "
            f"{s['rows']} rows, prompts <= {s['prompt']}, responses <= {s['response']}, micro-batches of "
            f"{s['micro_rows']}, {s['valid_fraction']:.0%} valid; rmpad attention: {s['packed_attention']}; rlpad's LM "
            f"head: {s.get('lm_head', '?')}; bf16 peak: "
            + (f"{peak['bf16_tflops']:.0f} TFLOP/s ({peak['label']})" if peak else "unknown device, no MFU"))


def shape_tables(s: dict[str, Any]) -> list[Table]:
    """The column table and the profile table of one :func:`measure_shape` result."""
    rows = []
    for mode in ("fwd", "fwdbwd"):
        for c, m in s[mode].items():
            rows.append([mode, c, f"{m['s']:.3f}", f"{m['tok_s']:.0f}", f"{m['tflops']:.1f}",
                         f"{m['mfu']:.1%}" if "mfu" in m else "-",
                         f"{m['peak_gib']:.1f}" if m.get("peak_gib") is not None else "-",
                         "" if c == "rmpad" else f"{m['rmpad_speedup']:.2f}x",
                         "" if c == "rmpad" else f"{m['flop_ideal_speedup']:.2f}x",
                         "" if c == "rmpad" else f"{m['of_ideal']:.2f}",
                         f"{s['agreement'][c]['lp_max_diff']:.2g}" if c != "rmpad" else ""])
    notes = [f"not run: {k} ({why})" for k, why in s["skipped"].items()]
    if "compile" in s:
        c = s["compile"]
        notes.append(f"packed_compiled: decoder layers under torch.compile(dynamic=True, {c['backend']}); compile "
                     f"(warm-up: one fwd + one fwd+bwd over the micro-batches, untimed) {c['seconds']:.1f} s, "
                     f"{c['graphs']} graphs; graphs compiled during the timed rounds: {c['graphs_after_warmup']}")
    notes.insert(0, "s: seconds of the whole batch (median); tok/s: valid tokens; TF/s and MFU: the FLOPs the column "
                    "executes; peak GiB: torch.cuda.max_memory_allocated over the pass, weights included; rmpad "
                    "speed-up: the column's seconds / rmpad's, next to its FLOPs / rmpad's (FLOP ratio) and their "
                    "ratio (of ideal); lp max diff: max |log-prob - rmpad's| over the valid response tokens")
    out = [Table(["pass", "column", "s", "tok/s", "TF/s", "MFU", "peak GiB", "rmpad speed-up", "FLOP ratio",
                  "of ideal", "lp max diff"], rows, title=_title(s), align="ll" + "r" * 9, notes=notes)]
    if "profile" in s:
        p = s["profile"]
        shown = {"fwd": p["fwd"], **({"fwd again": p["fwd_again"]} if "fwd_again" in p else {}), "fwd+bwd": p["fwdbwd"]}
        columns, rows = kind_table(shown)

        def longest(prof: dict, n: int, kind: str | None = None) -> str:
            top = [t for t in prof["top"] if kind is None or t["kind"] == kind][:n]
            return "; ".join(f"{t['name'][:60]} ({t['kind']}) {t['ms']:.1f} ms x{t['count']}" for t in top) or "none"
        out.append(Table(columns, rows, title=(
            f"{s['model']}: one rmpad micro-batch ({p['micro_rows']} rows, {p['valid_tokens']} tokens) under "
            "torch.profiler: device time by kind, ms (units of work)"), notes=[
            "fwd+bwd, the longest: " + longest(p["fwdbwd"], 4), "fwd, the longest: " + longest(p["fwd"], 4),
            "fwd, the longest copy/index among the top 8: " + longest(p["fwd"], 4, "copy/index")]))
    return out


def cuda_tables(result: dict[str, Any]) -> list[Table]:
    """Each shape's tables, then the LM-head memory line, of a :func:`run_cuda` result."""
    out = [t for s in result["shapes"] for t in shape_tables(s)]
    mem = {m["variant"]: m for m in result.get("memory", [])}
    if "full" in mem and "chunked" in mem:
        out.append(Table(notes=[
            f"LM-head log-prob + entropy fwd+bwd, {mem['full']['tokens']} tokens x vocab {mem['full']['vocab']}, "
            f"bf16, torch.cuda.max_memory_allocated above the inputs: full {mem['full']['peak_gib']:.2f} GiB, "
            f"chunked {mem['chunked']['peak_gib']:.2f} GiB ({mem['chunked']['peak_gib'] / mem['full']['peak_gib']:.3f})"]))
    return out


def run_cuda(*, reps: int = 3, memory: bool = True, shapes: Sequence[str] | None = None, micro_rows: int | None = None,
             chunk: int = 4096, dry_run: bool = False, columns: str = "all",
             on_shape: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The whole CUDA benchmark over ``shapes`` (names of :data:`CUDA_SHAPES`, default all); ``micro_rows``
    overrides each shape's own. ``dry_run``: the same code on the CPU over :data:`DRY_SHAPES`, no memory
    part. ``columns``: see :func:`column_list`. ``on_shape(result so far)`` after each shape (the CLI
    writes the JSON then, so a run cut short keeps the shapes it finished). Returns the result (the CLI
    prints :func:`cuda_tables` and writes the JSON)."""
    chosen = column_list(columns)  # ValueError before any compute
    table = DRY_SHAPES if dry_run else CUDA_SHAPES
    names = list(shapes or table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown CUDA benchmark shape(s) {unknown}; choose among {list(table)}")
    device = torch.device("cpu") if dry_run else require_cuda()
    memory = memory and not dry_run
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "shapes": [], "dry_run": dry_run}
    for n in names:
        spec = dict(table[n])
        if micro_rows is not None:
            spec["micro_rows"] = micro_rows
        result["shapes"].append(measure_shape(device, spec.pop("model"), chunk=chunk, reps=reps, columns=chosen, **spec))
        if on_shape is not None:
            on_shape(result)
        gc.collect()  # the shape's model, batch and closures are gone: give their memory back before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["memory"] = [measure_cuda(v, device) for v in VARIANTS] if memory else []
    return result
