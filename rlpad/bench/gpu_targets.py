"""The GPU run's targets (issues #34 and #54) and the 2026-11-24 H100 baseline, read out of the GPU report
(scripts/gpu_report.py ``build``: the benchmarks' JSON, the tests' figures, the wall time). Issue #54's
figures of the H200 run of 2026-11-28 are in the notes ("11-28: ...").

:data:`TARGETS` is the one list: each figure, where the report holds it, the comparison, the target
and the baseline (None where the 2026-11-24 run did not measure it). :func:`target_rows` reads a
report into rows; the report prints them as one table, "not measured" where a figure is missing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

__all__ = ["TARGETS", "Target", "target_rows"]


def _path(obj: Any, *keys: Any) -> Any:
    for k in keys:
        if callable(k):
            obj = k(obj) if obj is not None else None
        elif isinstance(obj, dict):
            obj = obj.get(k)
        else:
            return None
    return obj


def _bench(name: str) -> Callable[[dict], Any]:
    return lambda r: _path(r, "bench", name, "json")


def _head_row(tokens: int, key: str, variant: str = "head") -> Callable[[dict], Any]:
    def get(r: dict) -> Any:
        rows = _path(_bench("head")(r), "rows") or []
        row = next((x for x in rows if x.get("tokens") == tokens and x.get("variant") == variant), None)
        return None if row is None else row.get(key)
    return get


def _sweep_best(tokens: int) -> Callable[[dict], Any]:
    def get(r: dict) -> Any:
        result = _bench("head_sweep")(r) or {}
        best = _path(result, "best", str(tokens))
        row = next((x for x in result.get("rows", []) if x.get("tokens") == tokens and x.get("tiles") == best), None)
        return None if row is None else row.get("fwdbwd_vs_floor")
    return get


def _shape(bench: str, match: Callable[[dict], bool], *keys: str) -> Callable[[dict], Any]:
    def get(r: dict) -> Any:
        shape = next((s for s in _path(_bench(bench)(r), "shapes") or [] if match(s)), None)
        return _path(shape, *keys)
    return get


def _model(name: str, *keys: str) -> Callable[[dict], Any]:
    """A figure of model ``name`` from the lane's logprob steps (peers, flex, compiled: rmpad runs in each),
    the first that has it."""
    gets = [_shape(bench, lambda s: s.get("model") == name, *keys) for bench in ("logprob", "flex", "compiled")]
    return lambda r: next((v for v in (g(r) for g in gets) if v is not None), None)


def _prompt(p: int, *keys: str, model: str = "qwen2.5-0.5b") -> Callable[[dict], Any]:
    """A figure of ``rlpad bench prefix --device cuda`` at prompt length ``p`` for ``model`` (its JSON before
    issue #54 held the 0.5B shape alone, without a model key)."""
    return _shape("prefix", lambda s: s.get("prompt") == p and s.get("model", "qwen2.5-0.5b") == model, *keys)


def _host(p: int, run: str, key: str) -> Callable[[dict], Any]:
    """A figure of one micro-batch forward of ``rlpad bench host --device cuda`` (``run``: path/variant)."""
    return _shape("host", lambda s: s.get("prompt") == p, "runs", run, key)


def _shared_vs_rmpad(p: int) -> Callable[[dict], Any]:
    """Shared prompts' forward wall over rmpad's on the same micro-batch (issue #54: <= 1 wherever shared's
    device time is the lower, which it is at both shapes)."""
    def get(r: dict) -> Any:
        shared, rmpad = _host(p, "shared/plain", "wall_ms")(r), _host(p, "rmpad/plain", "wall_ms")(r)
        return shared / rmpad if isinstance(shared, (int, float)) and isinstance(rmpad, (int, float)) and rmpad else None
    return get


def _copy_share(model: str) -> Callable[[dict], Any]:
    """The copy / index kernels' share of one rmpad micro-batch's forward device time (logprob's profile)."""
    def get(r: dict) -> Any:
        fwd = _model(model, "profile", "fwd")(r)
        if not isinstance(fwd, dict) or not fwd.get("device_ms"):
            return None
        return fwd["kinds"]["copy/index"]["ms"] / fwd["device_ms"]
    return get


def _lane_failures(r: dict) -> Any:
    s = r.get("summary") or {}
    return s["failed"] + s["error"] if "failed" in s and "error" in s and r.get("tests") else None


def _host_syncs(host_copy: bool) -> Callable[[dict], Any]:
    """The most synchronising calls of one bf16 forward in the lane's count, as the workers call the core
    (``host_copy``: the batch's host copy given) or without it (one read of the batch)."""
    def get(r: dict) -> Any:
        fig = _path(r, "figures", "test_no_host_sync_per_layer_bf16", "synchronizing_calls")
        if not isinstance(fig, dict):
            return None
        values = [v for k, v in fig.items() if k.endswith("/forward, host copy given" if host_copy else "/forward")]
        return max(values) if values else None
    return get


class Target:
    """A figure of the report: ``get(report) -> value or None``, ``value OP target``, the baseline."""

    def __init__(self, name: str, get: Callable[[dict], Any], op: str, target: float, baseline: float | None = None,
                 note: str = ""):
        self.name, self.get, self.op, self.target, self.baseline, self.note = name, get, op, target, baseline, note

    def met(self, value: Any) -> bool | None:
        if not isinstance(value, (int, float)):
            return None
        return {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "<": operator.lt}[self.op](value, self.target)


VERL = "verl's kernel 2.3x; 11-28: 1.68"
TARGETS = (
    Target("the lane's tests failed or in error", _lane_failures, "==", 0, note="11-28: 2 (the bf16 sync count, "
           "the 19000-token head)"),
    Target("head 19000 tokens: fwd+bwd / three-GEMM floor", _head_row(19000, "fwdbwd_vs_floor"), "<=", 1.5, note=VERL),
    Target("head 19000 tokens: best sweep point fwd+bwd / floor", _sweep_best(19000), "<=", 1.5),
    Target("head 19000 tokens: peak GiB above the inputs", _head_row(19000, "peak_gib"), "<=", 10.5),
    Target("head 19000 tokens: log-prob max error vs fp64", _head_row(19000, "lp_err"), "<=", 5e-5),
    Target("head 19000 tokens: entropy max error vs fp64", _head_row(19000, "ent_err"), "<=", 5e-5),
    Target("head 4800 tokens: fwd+bwd / three-GEMM floor", _head_row(4800, "fwdbwd_vs_floor"), "<=", 1.6,
           note="11-28: 1.73 (verl 2.21)"),
    Target("head 4800 tokens: best sweep point fwd+bwd / floor", _sweep_best(4800), "<=", 1.6),
    Target("7b-layers fwd+bwd: rmpad speed-up over packed flex_attention",
           _model("7b-layers", "fwdbwd", "packed_flex", "rmpad_speedup"), ">=", 1.3,
           note="11-28: 1.15; not in the lane since issue #54: `bench logprob --columns flex` apart"),
    Target("7b-layers fwd+bwd: rmpad speed-up over packed sdpa",
           _model("7b-layers", "fwdbwd", "packed_sdpa", "rmpad_speedup"), ">=", 1.6, note="11-28: 1.51"),
    Target("7b-layers fwd+bwd: rmpad speed-up over packed + liger",
           _model("7b-layers", "fwdbwd", "packed_liger", "rmpad_speedup"), ">=", 1.1),
    Target("7b-layers fwd+bwd: speed-up over padded / FLOP ideal",
           _model("7b-layers", "fwdbwd", "padded", "of_ideal"), ">=", 0.9),
    Target("7b-layers fwd: speed-up over padded / FLOP ideal", _model("7b-layers", "fwd", "padded", "of_ideal"), ">=", 0.95),
    Target("7b-layers fwd+bwd: rmpad MFU", _model("7b-layers", "fwdbwd", "rmpad", "mfu"), ">=", 0.55,
           note="11-28: 0.46"),
    Target("7b-layers rmpad micro-batch fwd: copy/index share of device time", _copy_share("7b-layers"), "<", 0.05,
           note="11-28: 0.44 (fwd+bwd 0.045)"),
    Target("qwen2.5-0.5b fwd+bwd: rmpad speed-up over packed flex_attention",
           _model("qwen2.5-0.5b", "fwdbwd", "packed_flex", "rmpad_speedup"), ">=", 1.2),
    Target("qwen2.5-0.5b fwd: rmpad MFU", _model("qwen2.5-0.5b", "fwd", "rmpad", "mfu"), ">=", 0.30, 0.1806),
    Target("qwen2.5-0.5b fwd: speed-up over padded / FLOP ideal", _model("qwen2.5-0.5b", "fwd", "padded", "of_ideal"),
           ">=", 0.95, 0.8414),
    Target("qwen2.5-0.5b fwd+bwd: speed-up over padded / FLOP ideal",
           _model("qwen2.5-0.5b", "fwdbwd", "padded", "of_ideal"), ">=", 0.9, 0.7711),
    Target("shared prompts P=512 fwd: speed-up / FLOP ideal", _prompt(512, "fwd", "speedup_vs_ideal"), ">=", 0.8, 0.2398),
    Target("shared prompts P=512 fwd+bwd: speed-up / FLOP ideal", _prompt(512, "fwdbwd", "speedup_vs_ideal"), ">=", 0.7,
           0.3103),
    Target("shared prompts P=128 fwd: speed-up over rmpad", _prompt(128, "fwd", "speedup"), ">=", 1.0,
           note="or the threshold falls back"),
    Target("shared prompts P=128 fwd+bwd: speed-up over rmpad", _prompt(128, "fwdbwd", "speedup"), ">=", 1.0),
    Target("shared prompts 7b-layers P=512 fwd: speed-up / FLOP ideal",
           _prompt(512, "fwd", "speedup_vs_ideal", model="7b-layers"), ">=", 0.8, note="where the GPU is the bottleneck"),
    Target("0.5B 16-row micro-batch P=512: rmpad fwd wall / kernels", _host(512, "rmpad/plain", "wall_vs_device"),
           "<=", 1.1, note="11-28: 38.5 / 29.6 ms = 1.30 (profiled)"),
    Target("0.5B 16-row micro-batch P=512: shared fwd wall / rmpad's", _shared_vs_rmpad(512), "<=", 1.0,
           note="11-28: 48.0 / 38.5 = 1.25, for 13.1 vs 29.6 ms of kernels"),
    Target("0.5B 16-row micro-batch P=128: rmpad fwd wall / kernels", _host(128, "rmpad/plain", "wall_vs_device"),
           "<=", 1.1, note="11-28: 29.8 / 18.7 ms = 1.59"),
    Target("0.5B 16-row micro-batch P=128: shared fwd wall / rmpad's", _shared_vs_rmpad(128), "<=", 1.0,
           note="11-28: 33.7 / 29.8 = 1.13, for 15.0 vs 18.7 ms of kernels"),
    Target("the run's wall time, s", lambda r: r.get("wall_s"), "<=", 480, 151, note="baseline: the lane alone"),
    Target("host syncs per forward (bf16, worker path)", _host_syncs(True), "==", 0, 56,
           note="baseline: rmpad 11, shared 56"),
    Target("host syncs per forward (bf16, no host copy)", _host_syncs(False), "<=", 1, note="the batch's one read"),
)


def target_rows(report: dict) -> list[dict[str, Any]]:
    """``{name, value, op, target, met, baseline, note}`` per target (value None: not measured)."""
    rows = []
    for t in TARGETS:
        try:
            value = t.get(report)
        except Exception:  # noqa: BLE001 - a partial or older JSON: not measured
            value = None
        rows.append({"name": t.name, "value": value, "op": t.op, "target": t.target, "met": t.met(value),
                     "baseline": t.baseline, "note": t.note})
    return rows
