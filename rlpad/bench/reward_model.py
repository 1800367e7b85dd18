"""``rlpad bench rm``: a reward model's scoring forward, padded vs remove-padding.

A rollout-shaped batch (16 rows, prompt <= 256 left-padded, response <= 256 right-padded, about half
valid) scored by a one-output ``*ForSequenceClassification`` of a benchmark shape
(rlpad/bench/models.py; default 40m) through :func:`rlpad.core.reward_model.compute_scores`; medians
of interleaved repetitions, the measured speedup next to the FLOP-ideal one (padded / packed
forward FLOPs of the decoder, :mod:`rlpad.bench.flops`; the one-output head is B x hidden either way).
"""

from __future__ import annotations

from typing import Any

import torch

from rlpad.bench.flops import packed_work, padded_work, forward_flops
from rlpad.bench.measure import interleaved_medians, path_rates
from rlpad.bench.models import model_shape
from rlpad.bench.table import Table
from rlpad.core.reward_model import compute_scores
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import tiny_reward_model

__all__ = ["run_rm_bench", "tables"]


def _decoder_flops(config: Any, work: Any, rows: int) -> float:
    parts = forward_flops(config, work)
    return parts["linear"] + parts["attention"] + 2.0 * rows * config.hidden_size  # no LM head: the score head


def run_rm_bench(model: str = "40m", *, batch: int = 16, prompt: int = 256, response: int = 256, reps: int = 3,
                 seed: int = 0) -> dict[str, Any]:
    """Median seconds of the padded and the packed scoring forward, tokens/s and the FLOP-ideal ratio."""
    arch, spec = model_shape(model)
    rm = tiny_reward_model(arch, seed=seed, **spec)
    data = rollout_batch(batch, prompt, response, vocab_size=rm.config.vocab_size, seed=seed, edge_rows=False)
    args = (rm, data["input_ids"], data["attention_mask"], data["position_ids"])

    def score(rmpad: bool) -> None:
        with torch.no_grad():
            compute_scores(*args, use_remove_padding=rmpad)

    seconds = interleaved_medians({"padded": lambda: score(False), "rmpad": lambda: score(True)}, reps,
                                  torch.device("cpu"))
    mask = data["attention_mask"]
    flops = {"padded": _decoder_flops(rm.config, padded_work(mask, response), batch),
             "rmpad": _decoder_flops(rm.config, packed_work(mask, response), batch)}
    valid = int(mask.sum())
    return {"model": model, "params_m": sum(p.numel() for p in rm.parameters()) / 1e6, "rows": batch,
            "seq_len": prompt + response, "valid_tokens": valid, "valid_fraction": valid / mask.numel(),
            "fwd": path_rates(valid, seconds, flops, base="padded", other="rmpad")}


def tables(result: dict[str, Any]) -> list[Table]:
    """The one-row table of a :func:`run_rm_bench` result."""
    m = result["fwd"]
    row = [result["model"], f"{result['valid_fraction']:.2f}", f"{m['padded_s']:.3f}", f"{m['rmpad_s']:.3f}",
           f"{m['rmpad_tok_s']:.0f}", f"{m['speedup']:.2f}x", f"{m['flop_ideal_speedup']:.2f}x",
           f"{m['speedup_vs_ideal']:.2f}x"]
    header = ["reward model", "valid", "padded s", "rmpad s", "rmpad tok/s", "speedup", "ideal", "of ideal"]
    return [Table(header, [row],
                  title="reward-model scoring forward, padded vs remove-padding (median seconds; tokens/s counts "
                        "valid tokens)")]
