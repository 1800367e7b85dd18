"""Where a pass spends its time: kernels by kind, launches, host vs device time (torch.profiler).

:func:`kernel_kind` is a pure function of a kernel's name (and the input dtypes of the op that
launched it, for GEMM kernels whose names carry none, e.g. cuBLAS's ``nvjet_*``):

=====================  ==================================================================
kind                   names (lower case, first rule that matches)
=====================  ==================================================================
LM head (Triton)       rlpad's fused LM head kernels (:data:`HEAD_KERNELS`)
attention              flash, fmha, attention, attn, sdpa, flex
bf16 GEMM / fp32 GEMM  gemm, gemv, nvjet, cublas, xmma, cutlass, and the aten matmul ops;
                       bf16/fp16 in the name -> bf16, else sgemm / f32 / simt -> fp32, else
                       the launching op's input dtypes; "GEMM, dtype unknown" when none
copy/index             memcpy, memset, copy, index, gather, scatter, cat, embedding, ...
elementwise/reduce     triton_* fused kernels (before copy/index: their names list the fused
                       ops), elementwise, reduce, softmax, norm, aten
                       pointwise / reduction ops
other                  the rest
=====================  ==================================================================

:func:`profile_pass` runs a callable once under the profiler and folds its events: on CUDA the
device events (kernels, memcpy, memset: one launch each) with their device time; on the CPU,
where there are no kernels, the aten ops (views and allocations aside) with their self time:
the same code path, CPU numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import DeviceType

__all__ = ["HEAD_KERNELS", "KINDS", "LAYER_RANGE", "kernel_kind", "kind_table", "profile_pass"]

BF16_GEMM, FP32_GEMM, GEMM_UNKNOWN = "bf16 GEMM", "fp32 GEMM", "GEMM, dtype unknown"
ATTENTION, ELEMENTWISE, COPY, OTHER = "attention", "elementwise/reduce", "copy/index", "other"
HEAD = "LM head (Triton)"
KINDS = (BF16_GEMM, FP32_GEMM, GEMM_UNKNOWN, HEAD, ATTENTION, ELEMENTWISE, COPY, OTHER)

# rlpad's fused LM head (rlpad/core/lm_head_triton.py): its @triton.jit kernels, each bf16 tensor-core GEMM
# tiles with the log-sum-exp / entropy statistics or the logits' gradient fused in (the profiler names a
# Triton kernel by its function; tests/test_bench_cuda.py reads these names from that file)
HEAD_KERNELS = ("_stats_kernel", "_dz_kernel")

_ATTENTION = ("flash", "fmha", "attention", "attn", "sdpa", "flex")
_GEMM = ("gemm", "gemv", "nvjet", "cublas", "xmma", "cutlass")
_ATEN_GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation",
              "aten::mv", "aten::addmv", "aten::dot"}
_HALF = ("bf16", "bfloat16", "f16", "fp16", "half", "hgemm")
_FP32 = ("sgemm", "f32", "fp32", "simt", "float")
_COPY = ("memcpy", "memset", "copy", "index", "gather", "scatter", "cat", "embedding", "nonzero", "clone", "stack",
         "repeat", "flip", "roll", "pad")
_ELEMENTWISE = ("elementwise", "reduce", "softmax", "norm", "mul", "add", "sub", "div", "exp", "log",
                "sum", "mean", "max", "min", "pow", "sqrt", "silu", "sigmoid", "neg", "clamp", "tanh", "cos",
                "sin", "fill", "zero", "abs", "where")
# aten ops that launch nothing themselves (views, allocation, ops that only call others): not work on the CPU
_NO_WORK = {"aten::linear", "aten::matmul", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::type_as",
            "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::_unsafe_view",
            "aten::as_strided", "aten::transpose", "aten::t", "aten::reshape", "aten::_reshape_alias", "aten::expand",
            "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::detach",
            "aten::alias", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::resolve_conj",
            "aten::resolve_neg", "aten::lift_fresh", "aten::narrow", "aten::view_as", "aten::unflatten",
            "aten::flatten", "aten::chunk", "aten::detach_", "aten::result_type", "aten::set_"}


def _gemm_dtype(name: str, dtypes: Sequence[str]) -> str:
    if any(m in name for m in _HALF):
        return BF16_GEMM
    if any(m in name for m in _FP32):
        return FP32_GEMM
    lowered = [d.lower() for d in dtypes]
    if any(("bfloat16" in d or "half" in d) for d in lowered):
        return BF16_GEMM
    if any(d in ("float", "c10::float", "float32") for d in lowered):
        return FP32_GEMM
    return GEMM_UNKNOWN


def kernel_kind(name: str, dtypes: Sequence[str] = ()) -> str:
    """The kind (one of :data:`KINDS`) of the kernel or op called ``name``; ``dtypes``: the input
    dtypes of the op that launched it (``c10::BFloat16``, ``float``, ...), read only for GEMMs."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    lowered = name.lower()
    if name in HEAD_KERNELS:
        return HEAD
    if any(m in lowered for m in _ATTENTION):
        return ATTENTION
    if lowered in _ATEN_GEMM or any(m in lowered for m in _GEMM):
        return _gemm_dtype(lowered, dtypes)
    if lowered.startswith("triton_") and "_tem_" not in lowered:  # inductor's fused pointwise / reductions
        return ELEMENTWISE
    if any(m in lowered for m in _COPY):
        return COPY
    if any(m in lowered for m in _ELEMENTWISE):
        return ELEMENTWISE
    return OTHER


LAYER_RANGE = "rlpad.decoder_layer"  # the profiler range around each decoder layer's forward (profile_pass(layers=...))


def _in_layer(event) -> bool:
    while event is not None:
        if event.name == LAYER_RANGE:
            return True
        event = event.cpu_parent
    return False


def _ops(events) -> list:
    """The host-side events of the ops and ranges (not the CUDA runtime calls, whose ids are CUPTI's:
    a kernel's ``linked_correlation_id`` is the id of the op that launched it)."""
    return [e for e in events if e.device_type == DeviceType.CPU and not getattr(e, "linked_correlation_id", 0)]


def _dtypes_of(prof) -> Callable[[Any], Sequence[str]]:
    """``op -> its input dtypes`` (recorded with ``record_shapes``): the event's ``input_dtypes`` where
    this torch's FunctionEvent has them, else the profiler's raw (kineto) event of the same id."""
    raw: dict[int, Sequence[str]] | None = None

    def dtypes(op) -> Sequence[str]:
        nonlocal raw
        if op is None:
            return ()
        if hasattr(op, "input_dtypes"):
            return op.input_dtypes or ()
        if raw is None:
            results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
            raw = {e.correlation_id(): e.dtypes() for e in results.events()} if results is not None else {}
        return raw.get(op.id, ())
    return dtypes


def _work_events(prof, device: torch.device) -> list[tuple[str, Sequence[str], float, bool]]:
    """``(name, launching op's input dtypes, microseconds, launched inside a decoder layer)`` of every
    unit of work of a profile."""
    events = prof.events()
    _dtypes = _dtypes_of(prof)
    if device.type == "cuda":
        ops = {e.id: e for e in _ops(events)}
        out = []
        for e in events:
            if e.device_type == DeviceType.CUDA:
                op = ops.get(getattr(e, "linked_correlation_id", None))
                out.append((e.name, _dtypes(op), e.time_range.elapsed_us(), _in_layer(op)))
        return out
    return [(e.name, _dtypes(e), e.self_cpu_time_total, _in_layer(e)) for e in events
            if e.device_type == DeviceType.CPU and e.name.startswith("aten::") and e.name not in _NO_WORK]


def _layer_ranges(layers: Sequence[torch.nn.Module]) -> list:
    """Forward hooks opening a profiler range :data:`LAYER_RANGE` around each of ``layers``; returns the handles."""
    from torch.autograd.profiler import record_function

    open_ranges: list = []

    def enter(*_):
        open_ranges.append(record_function(LAYER_RANGE))
        open_ranges[-1].__enter__()

    def leave(*_):
        open_ranges.pop().__exit__(None, None, None)

    return [h for m in layers for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]


def profile_pass(fn: Callable[[], object], device: torch.device, *, layers: Sequence[torch.nn.Module] = (),
                 top: int = 8) -> dict[str, Any]:
    """Run ``fn()`` once under torch.profiler (after the caller's warm-up) and fold what it ran.

    Returns ``wall_ms`` (synchronised, profiler on), ``host_ms`` (time inside PyTorch ops on the
    host: the sum of the top-level ops' CPU time), ``device_ms`` (the units of work's time: kernel
    time on CUDA), ``launches`` (their number: kernels + memcpy + memset on CUDA, aten ops on the
    CPU), ``kinds`` ({kind: {"ms", "count"}} over :data:`KINDS`, zeros kept) and ``top`` (the
    ``top`` names by time: name, kind, ms, count). With ``layers`` (the decoder layers), also
    ``layer_calls`` (their forwards) and ``launches_per_layer``: the launches made inside one
    layer's forward, on average (a backward runs outside these ranges: count forwards only).
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    hooks = _layer_ranges(layers)
    try:
        with profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            fn()
            sync()
            wall = time.perf_counter() - start
    finally:
        for h in hooks:
            h.remove()
    work = _work_events(prof, device)
    kinds = {k: {"ms": 0.0, "count": 0} for k in KINDS}
    by_name: dict[str, list] = {}
    for name, dtypes, us, _ in work:
        kind = kernel_kind(name, dtypes)
        kinds[kind]["ms"] += us / 1e3
        kinds[kind]["count"] += 1
        entry = by_name.setdefault(name, [kind, 0.0, 0])
        entry[1] += us / 1e3
        entry[2] += 1
    host_us = sum(e.cpu_time_total for e in _ops(prof.events()) if e.cpu_parent is None)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    out = {"wall_ms": wall * 1e3, "host_ms": host_us / 1e3, "device_ms": sum(k["ms"] for k in kinds.values()),
           "launches": len(work), "kinds": kinds,
           "top": [{"name": n[:120], "kind": k, "ms": ms, "count": c} for n, (k, ms, c) in ranked]}
    if layers:
        calls = sum(e.name == LAYER_RANGE for e in prof.events())
        out.update(layer_calls=calls, launches_per_layer=sum(w[3] for w in work) / max(calls, 1))
    return out


def kind_table(profiles: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """``(columns, rows)``: one row per kind (ms and share of device time) for each profile named in
    ``profiles``, then the launches, device, host and wall time."""
    names = list(profiles)
    columns = ["kind"] + [f"{n} {what}" for n in names for what in ("ms", "share")]
    rows = []
    for kind in KINDS:
        if not any(p["kinds"][kind]["count"] for p in profiles.values()):
            continue
        row = [kind]
        for p in profiles.values():
            k = p["kinds"][kind]
            row += [f"{k['ms']:.1f} ({k['count']})", f"{k['ms'] / p['device_ms']:.0%}" if p["device_ms"] else "-"]
        rows.append(row)
    for label, key in (("launches", "launches"), ("launches per decoder layer (fwd)", "launches_per_layer"),
                       ("device ms", "device_ms"), ("host ms (in ops)", "host_ms"), ("wall ms (profiled)", "wall_ms")):
        row = [label]
        for p in profiles.values():
            row += ["-" if key not in p else f"{p[key]:.0f}" if "launches" in key else f"{p[key]:.1f}", ""]
        rows.append(row)
    return columns, rows
