"""``rlpad bench logprob``: padded vs remove-padding log-prob forward, and LM-head memory.

Speed: a rollout-shaped batch (16 rows, prompt <= 256 left-padded, response <= 256
right-padded, about half valid) on two model sizes; forward-only and forward+backward; medians
of interleaved repetitions; measured speedup next to the FLOP-ideal one (padded FLOPs / valid
FLOPs). Memory: log-prob + entropy forward+backward at vocab 151936 and 4096 tokens, full
logits vs chunked LM head, each variant in its own process (peak RSS growth).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from rlpad.bench.flops import padded_and_valid_flops
from rlpad.core.forward import compute_log_probs
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import tiny_model

__all__ = ["MODELS", "bench_speed", "bench_memory", "run", "print_tables"]

# name -> tiny_model arguments
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="qwen2", vocab_size=1024, hidden_size=128, num_hidden_layers=2, head_dim=32,
                 num_attention_heads=4, num_key_value_heads=2),
    "40m": dict(arch="qwen2", vocab_size=32000, hidden_size=512, num_hidden_layers=4, head_dim=64,
                num_attention_heads=8, num_key_value_heads=8, intermediate_size=1408, tie_word_embeddings=False),
}


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_speed(model_name: str, *, batch: int = 16, prompt: int = 256, response: int = 256,
                reps: int = 3, seed: int = 0) -> dict[str, Any]:
    """Median seconds of padded and rmpad forward / forward+backward, tokens/s and FLOP-ideal ratio."""
    spec = dict(MODELS[model_name])
    model = tiny_model(spec.pop("arch"), seed=seed, **spec).train()
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

    times: dict[str, list[float]] = {f"{m}_{p}": [] for m in ("fwd", "fwdbwd") for p in ("padded", "rmpad")}
    for rep in range(reps + 1):  # repetition 0 warms up; padded and rmpad alternate to share drift
        for mode, fn in (("fwd", forward), ("fwdbwd", forward_backward)):
            for path in ("padded", "rmpad"):
                t = _time(lambda: fn(path == "rmpad"))
                if rep:
                    times[f"{mode}_{path}"].append(t)
    padded_flops, valid_flops = padded_and_valid_flops(model.config, data["attention_mask"], response)
    ideal = padded_flops["total"] / valid_flops["total"]
    valid_tokens = int(data["attention_mask"].sum())
    result: dict[str, Any] = {
        "model": model_name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "rows": batch, "seq_len": prompt + response, "valid_tokens": valid_tokens,
        "valid_fraction": valid_tokens / data["attention_mask"].numel(),
        "flop_ideal_speedup": ideal, "padded_gflop": padded_flops["total"] / 1e9, "valid_gflop": valid_flops["total"] / 1e9,
    }
    for mode in ("fwd", "fwdbwd"):
        t_pad, t_rm = statistics.median(times[f"{mode}_padded"]), statistics.median(times[f"{mode}_rmpad"])
        result[mode] = {
            "padded_s": t_pad, "rmpad_s": t_rm,
            "padded_tok_s": valid_tokens / t_pad, "rmpad_tok_s": valid_tokens / t_rm,
            "speedup": t_pad / t_rm, "speedup_vs_ideal": (t_pad / t_rm) / ideal,
            "rmpad_gflop_s": valid_flops["total"] * (3 if mode == "fwdbwd" else 1) / t_rm / 1e9,
        }
    return result


def bench_memory(variant: str, *, tokens: int = 4096, hidden: int = 896, vocab: int = 151936,
                 chunk: int = 256) -> dict[str, Any]:
    """Run one memory variant ("full" or "chunked") in a fresh process; returns its peak RSS growth."""
    cmd = [sys.executable, "-m", "rlpad.bench.memory", variant, str(tokens), str(hidden), str(vocab), str(chunk)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_tables(result: dict[str, Any]) -> None:
    print("\nlog-prob + entropy, padded vs remove-padding (median seconds; tokens/s counts valid tokens)")
    header = f"{'model':>6} {'pass':>7} {'padded s':>9} {'rmpad s':>8} {'rmpad tok/s':>11} {'speedup':>8} {'ideal':>6} {'of ideal':>8}"
    print(header)
    print("-" * len(header))
    for r in result["speed"]:
        for mode in ("fwd", "fwdbwd"):
            m = r[mode]
            print(f"{r['model']:>6} {mode:>7} {m['padded_s']:9.3f} {m['rmpad_s']:8.3f} {m['rmpad_tok_s']:11.0f} "
                  f"{m['speedup']:7.2f}x {r['flop_ideal_speedup']:5.2f}x {m['speedup_vs_ideal']:7.2f}x")
    if result.get("memory"):
        mem = {m["variant"]: m for m in result["memory"]}
        print(f"\nLM-head log-prob + entropy, fwd+bwd, {mem['full']['tokens']} tokens x vocab {mem['full']['vocab']}")
        for name, m in mem.items():
            print(f"  {name:>8}: peak +{m['peak_gib']:.2f} GiB  ({m['seconds']:.1f} s)")
        if "full" in mem and "chunked" in mem:
            print(f"  chunked / full peak memory: {mem['chunked']['peak_gib'] / mem['full']['peak_gib']:.3f}")


def run(models: list[str] | None = None, *, reps: int = 3, memory: bool = True, out: str | None = None) -> dict[str, Any]:
    """The whole benchmark; prints the tables and writes JSON to ``out`` when given."""
    torch.set_num_threads(os.cpu_count() or 1)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "speed": [bench_speed(name, reps=reps) for name in (models or list(MODELS))],
        "memory": [bench_memory(v) for v in ("full", "chunked")] if memory else [],
    }
    print_tables(result)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {out}")
    return result
