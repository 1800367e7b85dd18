"""``rlpad check``: padded vs remove-padding on tiny models, per-token agreement and speed."""

from __future__ import annotations

import statistics
import time

import torch

from rlpad.core.forward import compute_log_probs
from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

__all__ = ["run_check"]


def run_check(batch: int = 16, prompt: int = 128, response: int = 128, reps: int = 3) -> bool:
    """Print a per-token agreement and speed table; True when every architecture agrees (<= FP32_LOGPROB_TOL)."""
    data = rollout_batch(batch, prompt, response, vocab_size=512, seed=0)
    valid = int(data["attention_mask"].sum())
    print(f"rollout batch: {batch} rows x ({prompt} prompt + {response} response), "
          f"{valid / data['attention_mask'].numel():.0%} valid tokens, fp32, {torch.get_num_threads()} threads\n")
    header = f"{'arch':>8} {'max |dlogp|':>12} {'max |dH|':>10} {'padded ms':>10} {'rmpad ms':>9} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    ok = True
    for arch in sorted(ARCHITECTURES):
        model = tiny_model(arch, vocab_size=512, hidden_size=128, num_hidden_layers=2)
        args = (model, data["input_ids"], data["attention_mask"], data["position_ids"], response)
        times: dict[bool, list[float]] = {False: [], True: []}
        outs = {}
        with torch.no_grad():
            for rep in range(reps + 1):
                for rmpad in (False, True):
                    start = time.perf_counter()
                    outs[rmpad] = compute_log_probs(*args, use_remove_padding=rmpad, calculate_entropy=True)
                    if rep:
                        times[rmpad].append(time.perf_counter() - start)
        d_lp = (outs[True][0] - outs[False][0]).abs().max().item()
        d_ent = (outs[True][1] - outs[False][1]).abs().max().item()
        t_pad, t_rm = statistics.median(times[False]), statistics.median(times[True])
        ok &= d_lp <= FP32_LOGPROB_TOL and d_ent <= FP32_LOGPROB_TOL
        print(f"{arch:>8} {d_lp:12.2e} {d_ent:10.2e} {1e3 * t_pad:10.1f} {1e3 * t_rm:9.1f} {t_pad / t_rm:7.2f}x")
    print("\nagreement:", f"OK (<= {FP32_LOGPROB_TOL:g} per token)" if ok else f"FAILED (> {FP32_LOGPROB_TOL:g})")
    return ok
