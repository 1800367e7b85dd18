"""The GPU lane's report (scripts/test_gpu.sh): results/gpu/report.md + report.json.

Folds together what the lane left in OUT: the device and versions (read here), the steps and their
exit codes (steps.tsv), every test's outcome and one-line reason (junit.xml), the figures the tests
recorded (parts/*.json) and the benchmarks' JSON (bench_*.json, read defensively: whatever keys
they hold), and on top every target of issue #34 beside its figure and the 2026-11-24 baseline
(rlpad/bench/gpu_targets.py). Each benchmark's JSON is shown as the benchmark's own tables (its formatter in
:data:`TABLES`, imported from rlpad) and, where that fails, as its numbers key by key. Standard
library + torch (+ rlpad's formatters when they import). Exit status 1 when OUT holds no test results.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

# the benchmarks the lane runs (bench_NAME.json / .log): name -> "module:function" turning its JSON into Tables
TABLES = {"head_sweep": "rlpad.bench.head_sweep:sweep_tables", "head": "rlpad.bench.head:tables",
          "logprob": "rlpad.bench.logprob_cuda:cuda_tables", "prefix": "rlpad.bench.prefix:tables",
          "compiled": "rlpad.bench.logprob_cuda:cuda_tables",  # logprob's rmpad + packed_compiled, a step of its own
          "flex": "rlpad.bench.logprob_cuda:cuda_tables",  # logprob's rmpad + packed_flex, likewise
          "logprob_vl": "rlpad.bench.logprob_vl:vl_tables"}  # a VL batch: Qwen2.5-VL-7B's shape, its vision tower
COMMANDS = {"head_sweep": "head --sweep", "compiled": "logprob --columns compiled",  # name -> `rlpad bench` args
            "flex": "logprob --columns flex", "logprob_vl": "logprob --vl"}
ERROR_KEYS = ("lp_max", "lp_mean", "ent_max", "ent_mean", "grad_rel", "grad_cos_min")


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                        memory_gib=round(p.total_memory / 2**30, 1))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a report with what could be read
        info["torch_error"] = repr(e)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        info["transformers_error"] = repr(e)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def read_steps(out: str) -> list[dict[str, Any]]:
    path = os.path.join(out, "steps.tsv")
    if not os.path.isfile(path):
        return []
    rows = []
    for line in open(path):
        name, rc, seconds = line.rstrip("\n").split("\t")
        rows.append({"name": name, "rc": int(rc), "seconds": int(seconds), "timed_out": int(rc) in (124, 137)})
    return rows


def read_tests(out: str) -> list[dict[str, Any]]:
    path = os.path.join(out, "junit.xml")
    if not os.path.isfile(path):
        return []
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = (node.get("message") or node.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        tests.append({"name": name, "outcome": outcome, "seconds": round(float(case.get("time") or 0), 2),
                      "message": message})  # fmt: skip
    return tests


def read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"unreadable": f"{path}: {e}"}


def tail(path: str, lines: int = 5) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip() for line in f.readlines()[-lines:]]
    except OSError:
        return []


def numeric_leaves(obj: Any, prefix: str = "", limit: int = 60) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of the numbers and short strings in a JSON value, depth first."""
    out: list[tuple[str, Any]] = []

    def walk(node: Any, key: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list) and len(node) <= 16:
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")
        elif isinstance(node, (bool, int, float)) or (isinstance(node, str) and len(node) <= 80):
            out.append((key, node))

    walk(obj, prefix)
    return out


def bench_tables(name: str, result: Any) -> list[str] | None:
    """The Markdown lines of bench ``name``'s own tables of ``result``; None when they cannot be made."""
    try:
        import importlib

        from rlpad.bench.table import format_markdown

        module, function = TABLES[name].split(":")
        return format_markdown(getattr(importlib.import_module(module), function)(result)).splitlines()
    except Exception:  # noqa: BLE001 - an old or partial JSON: the key/value view below
        return None


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def targets(report: dict[str, Any]) -> list[dict[str, Any]] | None:
    """rlpad.bench.gpu_targets' rows of ``report`` (None when rlpad does not import)."""
    try:
        from rlpad.bench.gpu_targets import target_rows
    except Exception:  # noqa: BLE001 - the report without the targets table
        return None
    return target_rows(report)


def build(out: str, wall_s: float | None, dry_run: bool = False) -> dict[str, Any]:
    parts = {os.path.splitext(os.path.basename(p))[0]: read_json(p)
             for p in sorted(glob.glob(os.path.join(out, "parts", "*.json")))}  # fmt: skip
    bench = {}
    for name in TABLES:  # the benchmarks the lane runs
        step = next((s for s in read_steps(out) if s["name"] == f"bench_{name}"), None)
        path = os.path.join(out, f"bench_{name}.json")
        bench[name] = {"step": step, "json": read_json(path) if os.path.isfile(path) else None,
                       "log_tail": tail(os.path.join(out, f"bench_{name}.log"))}  # fmt: skip
    tests = read_tests(out)
    summary = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wall_s": wall_s, "dry_run": dry_run,
              "device": device_info(), "steps": read_steps(out), "summary": summary, "tests": tests, "figures": parts,
              "bench": bench}
    report["targets"] = targets(report)
    return report


def markdown(r: dict[str, Any]) -> str:
    d = r["device"]
    lines = [
        "# rlpad GPU run (`make gpu-run` / `make test-gpu`)", "",
        f"{d.get('name', 'no CUDA device')} (sm {d.get('capability', '?')}, {d.get('memory_gib', '?')} GiB), "
        f"driver {d.get('driver')}; torch {d.get('torch')} (CUDA {d.get('cuda')}, cuDNN {d.get('cudnn')}), "
        f"transformers {d.get('transformers')}, Python {d.get('python')}. {r['date']}; lane wall time "
        f"{fmt(r['wall_s'])} s.", "",
    ]  # fmt: skip
    if r.get("dry_run"):
        lines += ["**DRY RUN on the CPU** (RLPAD_GPU_DRY_RUN=1): the GPU command's steps at tiny shapes; no figure "
                  "below means anything about a GPU.", ""]
    if r.get("targets"):
        lines += ["## Targets (issue #34) and the 2026-11-24 H100 baseline", "",
                  "| figure | measured | target | met | baseline 2026-11-24 | note |", "|---|---:|---|---|---:|---|"]
        for t in r["targets"]:
            met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
            value = "not measured" if t["value"] is None else fmt(t["value"])
            baseline = "-" if t["baseline"] is None else fmt(t["baseline"])
            lines.append(f"| {t['name']} | {value} | {t['op']} {fmt(t['target'])} | {met} | {baseline} | {t['note']} |")
        lines.append("")
    lines += ["| step | exit | seconds |", "|---|---:|---:|"]
    lines += [f"| {s['name']} | {s['rc']}{' (timed out)' if s['timed_out'] else ''} | {s['seconds']} |" for s in r["steps"]]
    s = r["summary"]
    lines += ["", f"## Tests: {s['passed']} passed, {s['failed']} failed, {s['error']} errors, {s['skipped']} skipped", "",
              "| outcome | test | s | reason |", "|---|---|---:|---|"]  # fmt: skip
    lines += [f"| {t['outcome']} | {t['name']} | {t['seconds']} | {t['message'].replace('|', '/')} |" for t in r["tests"]]

    exact = [p for p in r["figures"].values() if isinstance(p, dict) and "errors" in p]
    if exact:
        bounds = exact[0].get("bounds", {})
        lines += ["", "## bf16 exactness vs the fp32 oracle (forward and backward)", "",
                  "Per valid response token (nats) and over all parameter gradients; `leak` is the negative control "
                  "(one cu_seqlens segment through the same kernel), which must be outside the bounds.", "",
                  "| arch | path / batch | " + " | ".join(ERROR_KEYS) + " |", "|---|---|" + "---:|" * len(ERROR_KEYS),
                  "| | **bounds** | " + " | ".join(fmt(bounds.get(k, "")) for k in ERROR_KEYS) + " |"]  # fmt: skip
        for p in exact:
            for path, errs in p["errors"].items():
                lines.append(f"| {p.get('arch')} | {path} | " + " | ".join(fmt(errs.get(k, "")) for k in ERROR_KEYS) + " |")
        lines += ["", "The varlen kernel in the profile of one forward+backward (forward / backward):", ""]
        for p in exact:
            for path, c in p.get("calls", {}).items():
                lines.append(f"- {p.get('arch')} {path} ({p.get('kernel')}): op calls {c.get('forward_calls')} / "
                             f"{c.get('backward_calls')}, FlashAttention launches {c.get('cuda_fwd_launches')} / "
                             f"{c.get('cuda_bwd_launches')}: {', '.join(c.get('flash_kernels', []))}")
    other = {k: v for k, v in r["figures"].items() if not (isinstance(v, dict) and "errors" in v)}
    if other:
        lines += ["", "## Other figures", ""]
        for name, p in other.items():
            shown = ", ".join(f"{k}={fmt(v)}" for k, v in numeric_leaves(p) if k != "test")
            lines.append(f"- **{name}**: {shown}")
    lines += ["", "## Benchmarks (bf16; logprob: qwen2.5-0.5b and 7b-layers; prefix: Qwen2.5-0.5B shape; head and "
              "its sweep: hidden 3584, vocab 152064)", ""]
    for name, b in r["bench"].items():
        step = b["step"] or {}
        lines.append(f"### rlpad bench {COMMANDS.get(name, name)} --device cuda: exit {step.get('rc', 'not run')}"
                     f"{' (timed out)' if step.get('timed_out') else ''}, {step.get('seconds', '?')} s")
        shown = bench_tables(name, b["json"]) if isinstance(b["json"], dict) else None
        if shown:
            lines += ["", *shown]
        elif isinstance(b["json"], (dict, list)):
            lines += ["", "| key | value |", "|---|---:|"]
            lines += [f"| {k} | {fmt(v)} |" for k, v in numeric_leaves(b["json"])]
        else:
            lines += ["", "No JSON written; the log ends:", "", "```", *b["log_tail"], "```"]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="results/gpu")
    parser.add_argument("--wall-s", type=float, default=None)
    parser.add_argument("--dry-run", action="store_true", help="the report of the CPU dry run (said on top)")
    parser.add_argument("--rerender", action="store_true",
                        help="report.md again from OUT/report.json (its device and figures), today's targets table")
    args = parser.parse_args(argv)
    if args.rerender:
        report = read_json(os.path.join(args.out, "report.json"))
        for name in TABLES:  # a benchmark the lane did not run then
            report["bench"].setdefault(name, {"step": None, "json": None, "log_tail": []})
        report["targets"] = targets(report)
    else:
        report = build(args.out, args.wall_s, args.dry_run)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown(report))
    s = report["summary"]
    print(f"wrote {args.out}/report.md and report.json: {s['passed']} passed, {s['failed']} failed, "
          f"{s['error']} errors, {s['skipped']} skipped")
    return 0 if report["tests"] else 1


if __name__ == "__main__":
    sys.exit(main())
