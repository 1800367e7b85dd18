"""``rlpad bench prefix``: remove-padding vs shared-prompt log-prob forward on GRPO-shaped batches.

Batches of 8 groups x n=8 (every prompt P tokens, responses of uniform random length in [1, R]),
at P=512/R<=256 and P=128/R<=512, on the 40m model of ``rlpad bench logprob``. Forward and
forward+backward (log-prob + entropy, token-mean loss), medians of interleaved repetitions; tokens/s
count the valid tokens of the padded batch (the same work for both paths). FLOP-ideal speedup =
rmpad FLOPs / shared FLOPs (decoder linear + attention + LM head; the head is the same for both)
and, for reference, the decoder-only ideal (linear + attention).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import torch

from rlpad.bench.flops import logprob_flops, shared_prompt_flops
from rlpad.bench.logprob import MODELS
from rlpad.core.forward import compute_log_probs
from rlpad.core.shared_prompt import prompt_groups
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import tiny_model

__all__ = ["SHAPES", "bench_shape", "print_table", "run"]

SHAPES = ((512, 256), (128, 512))  # (prompt length, max response length)
GROUPS, N = 8, 8
CHUNK = 1024  # LM head chunk: the (N, V) logits never exist whole (memory; same for both paths)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_shape(model: torch.nn.Module, prompt: int, response: int, *, reps: int = 3, seed: int = 0,
                groups: int = GROUPS) -> dict[str, Any]:
    """Median seconds of rmpad and shared-prompt forward / forward+backward on one batch shape."""
    data = grpo_batch(groups, N, prompt, response, vocab_size=model.config.vocab_size, seed=seed, min_prompt=prompt)
    mask = data["response_mask"].float()
    args = (model, data["input_ids"], data["attention_mask"], data["position_ids"], response)
    kw = dict(use_remove_padding=True, calculate_entropy=True, logits_chunk_size=CHUNK)

    def forward(share: bool) -> None:
        with torch.no_grad():
            compute_log_probs(*args, share_prompts=share, **kw)

    def forward_backward(share: bool) -> None:
        lp, ent = compute_log_probs(*args, share_prompts=share, **kw)
        ((lp + 0.01 * ent) * mask).sum().div(mask.sum()).backward()
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {f"{m}_{p}": [] for m in ("fwd", "fwdbwd") for p in ("rmpad", "shared")}
    for _ in range(reps):  # rmpad and shared alternate so they share the machine's drift
        for mode, fn in (("fwd", forward), ("fwdbwd", forward_backward)):
            for path in ("rmpad", "shared"):
                times[f"{mode}_{path}"].append(_time(lambda: fn(path == "shared")))
    valid = data["attention_mask"].sum(-1).tolist()
    plens = data["attention_mask"][:, :prompt].sum(-1).tolist()
    rlens = data["response_mask"].sum(-1).tolist()
    groups = prompt_groups(data["input_ids"], data["attention_mask"], data["position_ids"], response)
    scored = int(sum(rlens))
    rm = logprob_flops(model.config, valid, scored)
    sh = shared_prompt_flops(model.config, [(plens[g[0]], [rlens[r] for r in g]) for g in groups], scored)
    ideal = rm["total"] / sh["total"]
    tokens = int(sum(valid))
    result: dict[str, Any] = {
        "prompt": prompt, "max_response": response, "rows": len(valid), "groups": len(groups),
        "valid_tokens": tokens, "shared_tokens": sum(plens[g[0]] + sum(rlens[r] for r in g) for g in groups),
        "flop_ideal_speedup": ideal,
        "decoder_flop_ideal_speedup": (rm["linear"] + rm["attention"]) / (sh["linear"] + sh["attention"]),
        "rmpad_gflop": rm["total"] / 1e9, "shared_gflop": sh["total"] / 1e9,
    }
    for mode in ("fwd", "fwdbwd"):
        t_rm, t_sh = statistics.median(times[f"{mode}_rmpad"]), statistics.median(times[f"{mode}_shared"])
        result[mode] = {"rmpad_s": t_rm, "shared_s": t_sh, "rmpad_tok_s": tokens / t_rm, "shared_tok_s": tokens / t_sh,
                        "speedup": t_rm / t_sh, "speedup_vs_ideal": t_rm / t_sh / ideal}  # fmt: skip
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"\nlog-prob + entropy, {result['model']} ({result['params_m']:.1f}M), {result['groups']} groups x n={N}: "
          "remove-padding vs shared prompt (median seconds; tokens/s count valid tokens)")
    header = (f"{'P/R<=':>8} {'pass':>7} {'rmpad s':>8} {'shared s':>9} {'rmpad tok/s':>11} {'shared tok/s':>12} "
              f"{'speedup':>8} {'ideal':>6} {'of ideal':>8}")
    print(header)
    print("-" * len(header))
    for r in result["shapes"]:
        for mode in ("fwd", "fwdbwd"):
            m = r[mode]
            print(f"{r['prompt']:>4}/{r['max_response']:<3} {mode:>7} {m['rmpad_s']:8.2f} {m['shared_s']:9.2f} "
                  f"{m['rmpad_tok_s']:11.0f} {m['shared_tok_s']:12.0f} {m['speedup']:7.2f}x "
                  f"{r['flop_ideal_speedup']:5.2f}x {m['speedup_vs_ideal']:7.2f}x")


def run(model_name: str = "40m", *, reps: int = 3, shapes=SHAPES, groups: int = GROUPS,
        out: str | None = None) -> dict[str, Any]:
    """The whole benchmark; prints the table and writes JSON to ``out`` when given. ``groups``
    fewer than 8 shrinks every batch (a busy machine); both paths scale alike per group."""
    torch.set_num_threads(os.cpu_count() or 1)
    spec = dict(MODELS[model_name])
    model = tiny_model(spec.pop("arch"), seed=0, **spec).train()
    warm = grpo_batch(2, 2, 16, 16, vocab_size=model.config.vocab_size, seed=1)
    for share in (False, True):  # one-time costs out of the timings
        compute_log_probs(model, warm["input_ids"], warm["attention_mask"], warm["position_ids"], 16,
                          use_remove_padding=True, share_prompts=share)[0].sum().backward()  # fmt: skip
    model.zero_grad(set_to_none=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "model": model_name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "groups": groups,
        "shapes": [],
    }
    for p, r in shapes:
        result["shapes"].append(bench_shape(model, p, r, reps=reps, groups=groups))
        print(json.dumps(result["shapes"][-1]), flush=True)
    print_table(result)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {out}")
    return result
