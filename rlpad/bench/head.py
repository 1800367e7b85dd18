"""``rlpad bench head [--device cuda]``: the LM head alone (log-prob + entropy), forward and
forward+backward, against the three-GEMM floor, in bf16.

Rows per token count (random inputs of one shape, :func:`rlpad.embedded.head_exactness.head_inputs`):

* ``head``: what :func:`rlpad.core.logprob.chunked_log_probs_and_entropy` runs here
  (:func:`rlpad.core.lm_head.head_path`: ``triton`` on a CUDA GPU with Triton);
* ``torch_cuda``: the chunked torch head with fp32-output logits and bf16 gradient GEMMs (the
  fallback without Triton; on the CPU its arithmetic with upcast GEMMs);
* ``chunked bf16``: the chunked torch head as before issue #26 (logits rounded to bf16, fp32
  weight-gradient GEMM);
* ``full logits``: ``h @ W^T`` whole, then fp32 ``log_softmax`` and the entropy from it;
* ``floor``: the three bf16 GEMMs alone (logits; grad_hidden and grad_weight with the logits as dz).

Seconds are medians of interleaved repetitions (CUDA-synchronised), each with its ratio to the
floor of the same pass; peak memory is ``torch.cuda.max_memory_allocated`` above the inputs during
one forward+backward (CUDA only); ``lp err`` / ``ent err`` are max |error| against the fp64
reference on the first ``err_tokens`` tokens. A second table: the fused head's launch plan per token
count (its tile table's choice; on the CPU, an H100's) and the HBM model of each grid order
(:func:`rlpad.core.lm_head_plan.head_plan`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rlpad.bench.measure import device_peak, interleaved_medians, require_cuda
from rlpad.bench.table import Table
from rlpad.core.lm_head import TORCH, TORCH_CUDA, head_path, triton_missing
from rlpad.core.lm_head_plan import head_plan
from rlpad.core.logprob import chunked_log_probs_and_entropy, log_probs_and_entropy
from rlpad.embedded.head_exactness import fp64_head, head_inputs

__all__ = ["DEFAULTS", "VARIANTS", "run_head", "tables"]

# device -> (token counts, hidden, vocab, logits_chunk_size)
DEFAULTS = {"cuda": ((4800, 19000), 3584, 152064, 4096), "cpu": ((128, 512), 128, 2048, 128)}
VARIANTS = ("head", "torch_cuda", "chunked_bf16", "full_logits", "floor")


def _heads(chunk: int) -> dict[str, Callable]:
    """Variant -> ``f(hidden, weight, labels) -> (log_prob, entropy)`` (the floor: ``None``)."""
    return {
        "head": lambda h, w, y: chunked_log_probs_and_entropy(h, w, y, chunk_size=chunk),
        "torch_cuda": lambda h, w, y: chunked_log_probs_and_entropy(h, w, y, chunk_size=chunk, head=TORCH_CUDA),
        "chunked_bf16": lambda h, w, y: chunked_log_probs_and_entropy(h, w, y, chunk_size=chunk, head=TORCH),
        "full_logits": lambda h, w, y: log_probs_and_entropy(h @ w.t(), y),
    }


def _pass(variant: str, x: dict, chunk: int, backward: bool):
    """One forward (and backward of ``g_lp . lp + g_ent . ent``) of ``variant``; returns (lp, ent)."""
    h, w, y = x["hidden"], x["weight"], x["labels"]
    if variant == "floor":
        logits = h @ w.t()
        if backward:  # the logits stand in for dz: same shape, same dtype
            torch.mm(logits, w), torch.mm(logits.t(), h)
        return None, None
    h.requires_grad_(backward)
    w.requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        lp, ent = _heads(chunk)[variant](h, w, y)
        if backward:
            ((lp * x["g_lp"]).sum() + (ent * x["g_ent"]).sum()).backward()
    h.grad = w.grad = None
    return lp.detach(), ent.detach()


def _peak_and_outputs(variant: str, x: dict, chunk: int, device: torch.device) -> tuple[float | None, Any]:
    """Peak memory (GiB above what is allocated before, CUDA) of one forward+backward, and its outputs."""
    if device.type != "cuda":
        return None, _pass(variant, x, chunk, True)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = _pass(variant, x, chunk, True)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30, out


def run_head(device: str = "cpu", *, tokens: tuple[int, ...] | None = None, hidden: int | None = None,
             vocab: int | None = None, chunk: int | None = None, reps: int = 3, err_tokens: int = 1024) -> dict[str, Any]:
    """The whole benchmark on ``device`` (``cuda``: ValueError without a GPU); returns the result."""
    dev = require_cuda() if device == "cuda" else torch.device("cpu")
    d_tokens, d_hidden, d_vocab, d_chunk = DEFAULTS[dev.type]
    tokens, hidden, vocab, chunk = tokens or d_tokens, hidden or d_hidden, vocab or d_vocab, chunk or d_chunk
    if min(tokens) < 1 or hidden < 1 or vocab < 2 or chunk < 1 or reps < 1 or err_tokens < 1:
        raise ValueError(f"need tokens, hidden, chunk, reps, err_tokens >= 1 and vocab >= 2; got tokens={tokens}, "
                         f"hidden={hidden}, vocab={vocab}, chunk={chunk}, reps={reps}, err_tokens={err_tokens}")
    name, _ = device_peak(dev)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": name, "torch": torch.__version__,
                              "triton": None if triton_missing() else _triton_version(), "dtype": "bf16", "hidden": hidden,
                              "vocab": vocab, "chunk": chunk, "reps": reps, "err_tokens": err_tokens, "rows": [],
                              "plans": [head_plan(n, hidden, vocab, dev) for n in tokens]}
    for n in tokens:
        x = head_inputs(n, hidden, vocab, dtype=torch.bfloat16, device=dev, seed=n)
        result["head_path"] = head_path(x["hidden"], x["weight"])
        oom: set[str] = set()  # variants that ran out of device memory (full logits at 19000 tokens may)

        def guarded(v: str, backward: bool) -> None:
            if v not in oom:
                try:
                    _pass(v, x, chunk, backward)
                except torch.cuda.OutOfMemoryError:
                    oom.add(v)
                    x["hidden"].grad = x["weight"].grad = None
                    torch.cuda.empty_cache()

        passes = {f"{v}/{mode}": (lambda v=v, b=(mode == "fwdbwd"): guarded(v, b))
                  for v in VARIANTS for mode in ("fwd", "fwdbwd")}
        seconds = interleaved_medians(passes, reps, dev)
        e = min(n, err_tokens)
        ref_lp, ref_ent = fp64_head(x["hidden"][:e], x["weight"], x["labels"][:e])
        for v in VARIANTS:
            if v in oom:
                result["rows"].append({"tokens": n, "variant": v, "oom": True})
                continue
            peak, (lp, ent) = _peak_and_outputs(v, x, chunk, dev)
            row = {"tokens": n, "variant": v, "fwd_s": seconds[f"{v}/fwd"], "fwdbwd_s": seconds[f"{v}/fwdbwd"],
                   "fwd_vs_floor": seconds[f"{v}/fwd"] / seconds["floor/fwd"],
                   "fwdbwd_vs_floor": seconds[f"{v}/fwdbwd"] / seconds["floor/fwdbwd"], "peak_gib": peak}
            if lp is not None:
                row["lp_err"] = (lp[:e].double() - ref_lp).abs().max().item()
                row["ent_err"] = (ent[:e].double() - ref_ent).abs().max().item()
            result["rows"].append(row)
        del x
    return result


def _triton_version() -> str:
    import triton

    return triton.__version__


def tables(result: dict[str, Any]) -> list[Table]:
    """One table: a row per (tokens, variant)."""
    def cell(v, f):
        return "-" if v is None else format(v, f)

    rows = [[str(r["tokens"]), r["variant"] + (f" ({result['head_path']})" if r["variant"] == "head" else ""),
             *(["out of memory"] + ["-"] * 6 if r.get("oom") else
               [f"{r['fwd_s'] * 1e3:.2f}", f"{r['fwd_vs_floor']:.2f}x", f"{r['fwdbwd_s'] * 1e3:.2f}",
                f"{r['fwdbwd_vs_floor']:.2f}x", cell(r["peak_gib"], ".2f"), cell(r.get("lp_err"), ".1e"),
                cell(r.get("ent_err"), ".1e")])] for r in result["rows"]]
    title = (f"LM head alone, log-prob + entropy, {result['device']} (torch {result['torch']}, triton "
             f"{result['triton'] or 'none'}), bf16, hidden {result['hidden']}, vocab {result['vocab']}, "
             f"logits_chunk_size {result['chunk']}; medians of {result['reps']}")
    notes = ["floor: the three bf16 GEMMs alone (logits, grad_hidden, grad_weight); peak: GiB above the inputs in "
             "one forward+backward (CUDA); errors: max |x - fp64| over the first "
             f"{result['err_tokens']} tokens."]
    main = Table(["tokens", "variant", "fwd ms", "/ floor", "fwd+bwd ms", "/ floor", "peak GiB", "lp err", "ent err"],
                 rows, title=title, notes=notes, align="rlrrrrrrr")
    return [main, plan_table(result["plans"])] if result.get("plans") else [main]


def plan_table(plans: list[dict[str, Any]]) -> Table:
    """The launch plan per token count and the forward's HBM traffic in each grid order (chosen: *)."""
    rows = [[str(p["tokens"]), f"{p['tiles']} (sm {p['capability']})", o["order"] + (" *" if o["order"] == p["order"] else ""),
             str(o["splits"]), str(o["group"] or "-"), str(o["resident"]), str(o["waves"]), f"{o['hidden_gb']:.1f}",
             f"{o['weight_gb']:.1f}", f"{o['total_gb']:.1f}", f"{o['ms_at_hbm']:.1f}"] for p in plans for o in p["orders"]]
    return Table(["tokens", "tiles", "grid order", "splits", "group", "resident", "waves", "h GB", "W GB", "HBM GB",
                  "ms at HBM"], rows, title=f"Fused head's forward launch on {plans[0]['gpu']}: HBM model per grid order",
                 notes=["rlpad.core.lm_head_plan.forward_traffic: waves of resident programs in step; a wave reads each "
                        "weight tile once and its hidden panels once if they fit in half the L2, else once per tile; "
                        "*: the order the head runs."], align="rllrrrrrrrr")
