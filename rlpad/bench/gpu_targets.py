"""The GPU run's targets (issue #34) and the 2026-11-24 H100 baseline, read out of the GPU report
(scripts/gpu_report.py ``build``: the benchmarks' JSON, the tests' figures, the wall time).

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


def _prompt(p: int, *keys: str) -> Callable[[dict], Any]:
    return _shape("prefix", lambda s: s.get("prompt") == p, *keys)


def _host_syncs(r: dict) -> Any:
    fig = _path(r, "figures", "test_no_host_sync_per_layer_bf16", "synchronizing_calls")
    return max(fig.values()) if isinstance(fig, dict) and fig else None


class Target:
    """A figure of the report: ``get(report) -> value or None``, ``value OP target``, the baseline."""

    def __init__(self, name: str, get: Callable[[dict], Any], op: str, target: float, baseline: float | None = None,
                 note: str = ""):
        self.name, self.get, self.op, self.target, self.baseline, self.note = name, get, op, target, baseline, note

    def met(self, value: Any) -> bool | None:
        if not isinstance(value, (int, float)):
            return None
        return {"<=": operator.le, ">=": operator.ge, "==": operator.eq}[self.op](value, self.target)


VERL = "verl's kernel 2.3x"
TARGETS = (
    Target("head 19000 tokens: fwd+bwd / three-GEMM floor", _head_row(19000, "fwdbwd_vs_floor"), "<=", 1.5, note=VERL),
    Target("head 19000 tokens: best sweep point fwd+bwd / floor", _sweep_best(19000), "<=", 1.5),
    Target("head 19000 tokens: peak GiB above the inputs", _head_row(19000, "peak_gib"), "<=", 10.5),
    Target("head 19000 tokens: log-prob max error vs fp64", _head_row(19000, "lp_err"), "<=", 5e-5),
    Target("head 19000 tokens: entropy max error vs fp64", _head_row(19000, "ent_err"), "<=", 5e-5),
    Target("head 4800 tokens: fwd+bwd / three-GEMM floor", _head_row(4800, "fwdbwd_vs_floor"), "<=", 1.7),
    Target("head 4800 tokens: best sweep point fwd+bwd / floor", _sweep_best(4800), "<=", 1.7),
    Target("7b-layers fwd+bwd: rmpad speed-up over packed flex_attention",
           _model("7b-layers", "fwdbwd", "packed_flex", "rmpad_speedup"), ">=", 1.3),
    Target("7b-layers fwd+bwd: rmpad speed-up over packed sdpa",
           _model("7b-layers", "fwdbwd", "packed_sdpa", "rmpad_speedup"), ">=", 1.6),
    Target("7b-layers fwd+bwd: rmpad speed-up over packed + liger",
           _model("7b-layers", "fwdbwd", "packed_liger", "rmpad_speedup"), ">=", 1.1),
    Target("7b-layers fwd+bwd: speed-up over padded / FLOP ideal",
           _model("7b-layers", "fwdbwd", "padded", "of_ideal"), ">=", 0.9),
    Target("7b-layers fwd: speed-up over padded / FLOP ideal", _model("7b-layers", "fwd", "padded", "of_ideal"), ">=", 0.95),
    Target("7b-layers fwd+bwd: rmpad MFU", _model("7b-layers", "fwdbwd", "rmpad", "mfu"), ">=", 0.40),
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
    Target("the run's wall time, s", lambda r: r.get("wall_s"), "<=", 480, 151, note="baseline: the lane alone"),
    Target("host syncs per forward (bf16, worker path)", _host_syncs, "==", 0, 56, note="baseline: rmpad 11, shared 56"),
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
