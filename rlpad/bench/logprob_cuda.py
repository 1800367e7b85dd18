"""``rlpad bench logprob --device cuda``: padded sdpa vs remove-padding on a Qwen2.5-0.5B-shaped model.

Random weights in bf16 with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 key-value
heads, intermediate 4864, vocab 151936, tied embeddings); a rollout-shaped batch of 64 rows,
prompts <= 512 left-padded, responses <= 1024 right-padded, about half the tokens valid.

* speed: padded (sdpa with the padding mask) vs packed (flash_attention_2 when flash-attn is
  installed, else rlpad_varlen = torch's varlen kernel), forward and forward+backward, in
  micro-batches of ``micro_rows`` rows and with the LM head chunked, as the workers run them;
  medians of interleaved repetitions (CUDA-synchronised wall time); tokens/s of valid tokens,
  speedup next to the FLOP-ideal one, and achieved TFLOP/s and MFU of the FLOPs each path
  executes (fwd+bwd = 3x forward) against the device's dense bf16 peak (:mod:`rlpad.bench.mfu`);
* memory: LM-head log-prob + entropy forward+backward on 4096 tokens, full logits vs chunked,
  peak ``torch.cuda.max_memory_allocated`` above what the inputs hold.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from rlpad.bench.flops import padded_and_valid_flops
from rlpad.bench.mfu import PEAK_SOURCE, achieved_tflops, mfu, peak_bf16_tflops
from rlpad.core.attn_choice import resolve_attn_implementation
from rlpad.core.forward import compute_log_probs
from rlpad.core.logprob import chunked_log_probs_and_entropy, log_probs_and_entropy
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import tiny_config

__all__ = ["QWEN2_5_0_5B", "bench_cuda_memory", "bench_cuda_speed", "measure_speed", "require_cuda", "run_cuda"]

QWEN2_5_0_5B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=896, num_hidden_layers=24, head_dim=64, num_attention_heads=14,
    num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True, max_position_embeddings=32768,
    rope_theta=1_000_000.0,
)


def require_cuda() -> torch.device:
    """The current CUDA device; ValueError naming the problem when torch sees none."""
    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda needs a CUDA GPU, but torch {torch.__version__} sees none "
                         f"(torch.cuda.is_available() is False; CUDA build: {torch.version.cuda})")
    return torch.device("cuda", torch.cuda.current_device())


def _model(device: torch.device, spec: dict[str, Any], seed: int):
    from transformers import AutoModelForCausalLM

    import rlpad.core.attention  # noqa: F401  (registers rlpad_varlen)

    config = tiny_config("qwen2", **spec)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.train()


def _timed(fn, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def bench_cuda_speed(*, rows: int = 64, prompt: int = 512, response: int = 1024, micro_rows: int = 16,
                     chunk: int = 4096, reps: int = 3, seed: int = 0) -> dict[str, Any]:
    """Median seconds of padded sdpa and packed forward / forward+backward, with tokens/s, FLOPs and MFU."""
    return measure_speed(require_cuda(), QWEN2_5_0_5B, rows=rows, prompt=prompt, response=response,
                         micro_rows=micro_rows, chunk=chunk, reps=reps, seed=seed)


def measure_speed(device: torch.device, spec: dict[str, Any], *, rows: int, prompt: int, response: int,
                  micro_rows: int, chunk: int, reps: int, seed: int = 0) -> dict[str, Any]:
    """:func:`bench_cuda_speed` for any qwen2 shape ``spec`` on any device (bf16; MFU only on a known GPU)."""
    if micro_rows < 1 or rows % micro_rows:
        raise ValueError(f"micro_rows={micro_rows} must be >= 1 and divide rows={rows}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    packed_impl = resolve_attn_implementation("auto", device)
    model = _model(device, spec, seed)
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

    times: dict[str, list[float]] = {f"{m}_{p}": [] for m in ("fwd", "fwdbwd") for p in ("padded", "rmpad")}
    for rep in range(reps + 1):  # repetition 0 warms up (kernel selection, allocator); paths alternate
        for mode in ("fwd", "fwdbwd"):
            for path in ("padded", "rmpad"):
                t = _timed(lambda: one_pass(path == "rmpad", mode == "fwdbwd"), device)
                if rep:
                    times[f"{mode}_{path}"].append(t)
    padded_flops, valid_flops = padded_and_valid_flops(model.config, data["attention_mask"].cpu(), response)
    ideal = padded_flops["total"] / valid_flops["total"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bf16_tflops(name) if device.type == "cuda" else None
    result: dict[str, Any] = {
        "device": name, "peak": {"label": peak[0], "bf16_tflops": peak[1], "source": PEAK_SOURCE} if peak else None,
        "torch": torch.__version__, "packed_attention": packed_impl, "padded_attention": "sdpa",
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "rows": rows, "micro_rows": micro_rows,
        "seq_len": prompt + response, "valid_tokens": valid_tokens,
        "valid_fraction": valid_tokens / data["attention_mask"].numel(), "flop_ideal_speedup": ideal,
        "padded_tflop": padded_flops["total"] / 1e12, "valid_tflop": valid_flops["total"] / 1e12,
    }
    for mode in ("fwd", "fwdbwd"):
        factor = 3 if mode == "fwdbwd" else 1  # backward = 2x forward FLOPs
        t_pad, t_rm = statistics.median(times[f"{mode}_padded"]), statistics.median(times[f"{mode}_rmpad"])
        row: dict[str, Any] = {
            "padded_s": t_pad, "rmpad_s": t_rm, "padded_tok_s": valid_tokens / t_pad, "rmpad_tok_s": valid_tokens / t_rm,
            "speedup": t_pad / t_rm, "speedup_vs_ideal": (t_pad / t_rm) / ideal,
            "padded_tflops": achieved_tflops(factor * padded_flops["total"], t_pad),
            "rmpad_tflops": achieved_tflops(factor * valid_flops["total"], t_rm),
        }
        if peak:
            row["padded_mfu"] = mfu(factor * padded_flops["total"], t_pad, peak[1])
            row["rmpad_mfu"] = mfu(factor * valid_flops["total"], t_rm, peak[1])
        result[mode] = row
    return result


def bench_cuda_memory(variant: str, *, tokens: int = 4096, hidden: int = 896, vocab: int = 151936,
                      chunk: int = 256, seed: int = 0) -> dict[str, Any]:
    """Peak CUDA memory above the inputs of LM-head log-prob + entropy fwd+bwd ("full" or "chunked"), bf16."""
    if variant not in ("full", "chunked"):
        raise ValueError(f"unknown memory variant {variant!r}; use full or chunked")
    device = require_cuda()
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)  # gradient buffers exist in both variants
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    if variant == "full":
        lp, ent = log_probs_and_entropy(h @ w.T, labels)
    else:
        lp, ent = chunked_log_probs_and_entropy(h, w, labels, chunk_size=chunk)
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    out = {"variant": variant, "tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk": chunk,
           "peak_gib": (torch.cuda.max_memory_allocated(device) - base) / 2**30,
           "seconds": time.perf_counter() - start}
    del lp, ent, h, w
    torch.cuda.empty_cache()
    return out


def print_cuda_tables(result: dict[str, Any]) -> None:
    s = result["speed"]
    peak = s["peak"]
    print(f"\n{s['device']} (torch {s['torch']}), Qwen2.5-0.5B-shaped bf16 ({s['params_m']:.0f}M), {s['rows']} rows "
          f"x {s['seq_len']} (micro-batches of {s['micro_rows']}), {s['valid_fraction']:.0%} valid; packed attention: "
          f"{s['packed_attention']}; bf16 peak: " + (f"{peak['bf16_tflops']:.0f} TFLOP/s ({peak['label']})" if peak
                                                     else "unknown device, no MFU"))
    header = (f"{'pass':>7} {'padded s':>9} {'rmpad s':>8} {'rmpad tok/s':>11} {'speedup':>8} {'ideal':>6} "
              f"{'of ideal':>8} {'pad TF/s':>8} {'rm TF/s':>8} {'pad MFU':>7} {'rm MFU':>7}")
    print(header + "\n" + "-" * len(header))
    for mode in ("fwd", "fwdbwd"):
        m = s[mode]
        mfus = (f"{m['padded_mfu']:7.1%} {m['rmpad_mfu']:7.1%}" if "rmpad_mfu" in m else f"{'-':>7} {'-':>7}")
        print(f"{mode:>7} {m['padded_s']:9.3f} {m['rmpad_s']:8.3f} {m['rmpad_tok_s']:11.0f} {m['speedup']:7.2f}x "
              f"{s['flop_ideal_speedup']:5.2f}x {m['speedup_vs_ideal']:7.2f}x {m['padded_tflops']:8.1f} "
              f"{m['rmpad_tflops']:8.1f} {mfus}")
    mem = {m["variant"]: m for m in result.get("memory", [])}
    if "full" in mem and "chunked" in mem:
        print(f"\nLM-head log-prob + entropy fwd+bwd, {mem['full']['tokens']} tokens x vocab {mem['full']['vocab']}, "
              f"bf16, torch.cuda.max_memory_allocated above the inputs: full {mem['full']['peak_gib']:.2f} GiB, "
              f"chunked {mem['chunked']['peak_gib']:.2f} GiB ({mem['chunked']['peak_gib'] / mem['full']['peak_gib']:.3f})")


def run_cuda(*, reps: int = 3, memory: bool = True, micro_rows: int = 16) -> dict[str, Any]:
    """The whole CUDA benchmark; prints the tables and returns the result (the CLI writes the JSON)."""
    require_cuda()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"),
                              "speed": bench_cuda_speed(reps=reps, micro_rows=micro_rows)}
    result["memory"] = [bench_cuda_memory(v) for v in ("full", "chunked")] if memory else []
    print_cuda_tables(result)
    return result
