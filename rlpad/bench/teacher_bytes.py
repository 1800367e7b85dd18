"""The bytes a ``forward_kl_topk`` teacher hands on per step: its top-k ids and log-probs at the driver and
through Ray, in rlpad's jagged layout (the scored positions only, int32 ids, k + 1 log-probs with the tail:
rlpad.core.distill_scoring) against the padded (B, R, k) int64 + fp32 grids it replaced.

Measured on real tensors at a shape that fits a CPU (the batch's in-memory bytes, and its pickle, what a
Ray call ships), with responses of uniform random length in [1, R] (half the grid scored), then scaled
per scored position to the step of issue 51 (B = 1024, R = 8192, k = 128).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.core.distill_scoring import split_rows

__all__ = ["STEP", "layout_bytes", "run_teacher_bytes"]

STEP = {"rows": 1024, "response": 8192, "topk": 128}  # the step the figures are scaled to
LAYOUTS = ("padded", "jagged")


def _batch(layout: str, scored: torch.Tensor, k: int, vocab: int, gen: torch.Generator) -> Batch:
    rows, response = scored.shape
    if layout == "padded":  # the earlier layout: (B, R, k) int64 ids and fp32 log-probs, zero off the scored positions
        ids = torch.zeros(rows, response, k, dtype=torch.int64)
        lp = torch.zeros(rows, response, k)
        n = int(scored.sum())
        ids[scored] = torch.randint(0, vocab, (n, k), generator=gen)
        lp[scored] = torch.randn(n, k, generator=gen)
        return Batch({"teacher_topk_ids": ids, "teacher_topk_log_probs": lp})
    n = int(scored.sum())
    ids = torch.randint(0, vocab, (n, k), generator=gen, dtype=torch.int32)
    lp = torch.randn(n, k + 1, generator=gen)
    return Batch({}, {"teacher_topk_ids": split_rows(ids, scored), "teacher_topk_log_probs": split_rows(lp, scored)})


def layout_bytes(batch: Batch) -> tuple[int, int]:
    """``(tensor bytes, pickled bytes)`` of a batch's teacher keys."""
    held = sum(v.nbytes for v in batch.tensors.values())
    held += sum(t.nbytes for rows in batch.non_tensors.values() for t in rows)
    return held, len(pickle.dumps(batch, protocol=5))


def run_teacher_bytes(rows: int = 64, response: int = 2048, topk: int = STEP["topk"], vocab: int = 151936,
                      seed: int = 0) -> dict[str, Any]:
    """Each layout's bytes at ``rows x response`` (half scored), and per step (:data:`STEP`, scaled per
    scored position: the per-row overhead of the jagged layout scaled with the rows)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, response + 1, (rows,), generator=gen)
    scored = torch.arange(response)[None, :] < lengths[:, None]
    n = int(scored.sum())
    step_n = STEP["rows"] * STEP["response"] * n / (rows * response)  # the same fill at the step's shape
    out: dict[str, Any] = {"rows": rows, "response": response, "topk": topk, "scored": n, "step": dict(STEP)}
    for layout in LAYOUTS:
        held, pickled = layout_bytes(_batch(layout, scored, topk, vocab, gen))
        if layout == "padded":  # proportional to the grid, scored or not
            scale = STEP["rows"] * STEP["response"] * STEP["topk"] / (rows * response * topk)
        else:  # proportional to the scored positions x (k ids + k + 1 log-probs)
            scale = step_n * (2 * STEP["topk"] + 1) / (n * (2 * topk + 1))
        out[layout] = {"bytes": held, "pickled": pickled, "step_gb": held * scale / 1e9,
                       "step_pickled_gb": pickled * scale / 1e9}
    out["ratio"] = out["jagged"]["pickled"] / out["padded"]["pickled"]
    return out
