"""``rlpad bench e2e``: what remove-padding buys in whole GRPO/PPO steps, and what the trainer costs.

Runs ``steps`` training steps of a recipe twice through the normal launch path
(:func:`rlpad.train.fit`: real Ray workers, vLLM rollout, FSDP2 actor), once with
``use_remove_padding`` on and once off, same seeds, no validation and no checkpoints. Per phase
(gen, old_log_prob, ref, values, update_actor, update_critic, sync) it reports the median seconds
over the steps after the first (warm-up), the padded / remove-padding time ratio, and for the two
actor phases the FLOP-ideal ratio of the actual batches (padded FLOPs / remove-padding FLOPs,
:mod:`rlpad.bench.flops`). The trainer overhead of a step is the driver's wall time minus the
seconds the workers measured inside themselves (``worker_s/*`` metrics), as a share of the step,
with where it goes: each phase's driver time minus its workers' time (moving batches through
Ray, splitting and merging) and the driver's own phases (reward, advantages).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from rlpad.bench.table import Table, write_json

__all__ = ["FlopRecorder", "overhead", "phase_table", "run_e2e", "summarize_mode", "tables"]

PHASES = ("gen", "old_log_prob", "ref", "values", "update_actor", "update_critic", "sync")
DRIVER_PHASES = ("reward", "adv")  # computed on the driver itself
IDEAL_PHASES = ("old_log_prob", "update_actor")


class FlopRecorder:
    """Passes every call to the wrapped workers; records the padded and remove-padding forward FLOPs of
    each ``compute_log_prob`` batch (the same rows go through ``update_actor``)."""

    def __init__(self, workers: Any, model_config: Any):
        self._workers, self._model_config = workers, model_config
        self.flops: list[tuple[float, float]] = []  # (padded, remove-padding) per step

    def compute_log_prob(self, batch: Any) -> Any:
        from rlpad.bench.flops import padded_and_packed_flops

        padded, packed = padded_and_packed_flops(self._model_config, batch["attention_mask"],
                                                 int(batch["responses"].shape[1]))
        self.flops.append((padded["total"], packed["total"]))
        return self._workers.compute_log_prob(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workers, name)


def overhead(record: dict[str, float]) -> dict[str, float]:
    """A step's trainer overhead from its metrics: ``wall - sum(worker_s/*)``, its share of the wall
    time, and its parts (per phase: driver minus workers; reward and advantages: driver only)."""
    wall = record["timing_s/step_wall"]
    if wall <= 0:
        raise ValueError(f"timing_s/step_wall must be > 0, got {wall}")
    worker = {k.split("/", 1)[1]: v for k, v in record.items() if k.startswith("worker_s/")}
    if not worker:
        raise ValueError("the step has no worker_s/* metrics: the workers did not report their own seconds")
    total = wall - sum(worker.values())
    parts = {f"transfer/{p}": record.get(f"timing_s/{p}", 0.0) - s for p, s in worker.items()}
    parts.update({f"driver/{p}": record[f"timing_s/{p}"] for p in DRIVER_PHASES if f"timing_s/{p}" in record})
    accounted = sum(record.get(f"timing_s/{p}", 0.0) for p in (*PHASES, *DRIVER_PHASES))
    parts["untimed"] = wall - accounted  # between the timed phases (metrics, bookkeeping)
    return {"overhead_s": total, "overhead_pct": 100.0 * total / wall, **parts}


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def summarize_mode(history: Sequence[dict[str, Any]], flops: Sequence[tuple[float, float]],
                   skip: int = 1) -> dict[str, Any]:
    """Medians over the steps after the first ``skip`` of one run: phase seconds (driver and worker),
    step wall time, overhead and its parts, padding ratio and the FLOP-ideal ratio."""
    steps = [r for r in history if "timing_s/step_wall" in r]
    if len(steps) <= skip:
        raise ValueError(f"{len(steps)} steps recorded; need more than the {skip} warm-up step(s)")
    steps, flops = steps[skip:], list(flops)[skip:]
    out: dict[str, Any] = {"steps": len(steps), "step_s": _median([r["timing_s/step_wall"] for r in steps]),
                           "padding_ratio": _median([r["padding_ratio"] for r in steps])}
    for p in (*PHASES, *DRIVER_PHASES):
        if any(f"timing_s/{p}" in r for r in steps):
            out[f"{p}_s"] = _median([r[f"timing_s/{p}"] for r in steps if f"timing_s/{p}" in r])
        if any(f"worker_s/{p}" in r for r in steps):
            out[f"{p}_worker_s"] = _median([r[f"worker_s/{p}"] for r in steps if f"worker_s/{p}" in r])
    parts = [overhead(r) for r in steps]
    for key in parts[0]:
        out[key] = _median([p[key] for p in parts])
    if flops:
        out["flop_ideal"] = _median([padded / valid for padded, valid in flops])
    return out


def phase_table(rmpad: dict[str, Any], padded: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{phase, padded_s, rmpad_s, ratio, ideal}``; ratio = padded / remove-padding time."""
    rows = []
    for p in PHASES:
        if f"{p}_s" in rmpad and f"{p}_s" in padded:
            ratio = padded[f"{p}_s"] / rmpad[f"{p}_s"] if rmpad[f"{p}_s"] > 0 else float("nan")
            rows.append({"phase": p, "padded_s": padded[f"{p}_s"], "rmpad_s": rmpad[f"{p}_s"], "ratio": ratio,
                         "ideal": rmpad.get("flop_ideal") if p in IDEAL_PHASES else None})
    rows.append({"phase": "step", "padded_s": padded["step_s"], "rmpad_s": rmpad["step_s"],
                 "ratio": padded["step_s"] / rmpad["step_s"], "ideal": None})
    return rows


def _run_mode(recipe: str, steps: int, use_remove_padding: bool, overrides: Sequence[str], out_dir: str) -> dict:
    from transformers import AutoConfig

    from rlpad.recipe.load import load_config
    from rlpad.embedded.resolve import resolve_embedded
    from rlpad.train import fit

    config = load_config(recipe, [
        *overrides, f"actor_rollout_ref.model.use_remove_padding={str(use_remove_padding).lower()}",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.default_local_dir={out_dir}",
        "trainer.logger=[jsonl]", "data.val_files=[]",
    ])
    config = resolve_embedded(config)
    model_config = AutoConfig.from_pretrained(config.actor_rollout_ref.model.path)
    recorders: list[FlopRecorder] = []

    def wrap(workers: Any) -> FlopRecorder:
        recorders.append(FlopRecorder(workers, model_config))
        return recorders[0]

    history = fit(config, wrap_workers=wrap)
    return summarize_mode(history, recorders[0].flops)


def run_e2e(recipe: str, steps: int = 4, overrides: Sequence[str] = (), out: str | None = None) -> dict[str, Any]:
    """Both runs of ``recipe`` (remove-padding first, then padded); writes JSON to ``out`` (:func:`tables`
    formats the result)."""
    if steps < 2:
        raise ValueError(f"steps={steps}: need at least 2 (the first step is a warm-up and is not counted)")
    with tempfile.TemporaryDirectory(prefix="rlpad-e2e-") as tmp:
        modes = {name: _run_mode(recipe, steps, rmpad, overrides, os.path.join(tmp, name))
                 for name, rmpad in (("rmpad", True), ("padded", False))}
    result = {"recipe": recipe, "steps": steps, "modes": modes, "phases": phase_table(modes["rmpad"], modes["padded"])}
    if out:
        write_json(result, out)
    return result


def tables(result: dict[str, Any]) -> list[Table]:
    """The phase table and the overhead lines of a :func:`run_e2e` result."""
    rm, pad = result["modes"]["rmpad"], result["modes"]["padded"]
    rows = [[row["phase"], f"{row['padded_s']:.3f}", f"{row['rmpad_s']:.3f}", f"{row['ratio']:.2f}x",
             f"{row['ideal']:.2f}x" if row["ideal"] else ""] for row in result["phases"]]
    notes = []
    for name, m in (("remove-padding", rm), ("padded", pad)):
        parts = sorted(((k, v) for k, v in m.items() if k.startswith(("transfer/", "driver/")) or k == "untimed"),
                       key=lambda kv: -kv[1])
        top = ", ".join(f"{k} {v:.3f}s" for k, v in parts[:4])
        notes.append(f"trainer overhead ({name}): {m['overhead_s']:.3f} s of a {m['step_s']:.3f} s step "
                     f"= {m['overhead_pct']:.1f}% (largest parts: {top})")
    title = (f"{result['recipe']}: {result['steps']} steps per mode, medians of steps 2..{result['steps']}, "
             f"padding ratio {rm['padding_ratio']:.1%}")
    return [Table(["phase", "padded s", "remove-padding s", "padded / rmpad", "FLOP-ideal"], rows, title=title,
                  notes=notes)]
