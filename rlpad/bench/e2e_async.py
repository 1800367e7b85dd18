"""``rlpad bench e2e --max-off-policy-steps 0 1``: what asynchronous training buys in whole steps.

Runs ``steps`` training steps of a recipe once per ``k`` (``trainer.max_off_policy_steps``) through
the normal launch path (:func:`rlpad.train.fit`: real Ray workers, vLLM rollout, FSDP2 actor) with
one rollout engine and a one-rank actor, each pinned to a core of its own
(:func:`workers.cpu_pin.pin_cores`), the same seeds and ``algorithm.rollout_correction.mode=token_tis``
in every run, no validation and no checkpoints. Per run it reports the median seconds of each
phase over the steps after the first ``skip`` (warm-up and filling the pipeline) and of the whole
step (``timing_s/step_wall``). The synchronous run's phases give the ideal speed-up of overlapping
generation with training, ``(gen + train) / max(gen, train)`` with ``train`` = step - gen; the
measured one is the synchronous step time over the asynchronous one.

``curves=PATH`` instead trains the recipe's whole length with its validation schedule for each k and
plots the validation (and training) reward of every run in one PNG.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from rlpad.bench.table import Table, write_json

__all__ = ["curve_tables", "ideal_speedup", "run_async_curves", "run_async_e2e", "summarize_async", "tables"]

PHASES = ("gen", "wait_rollout", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
          "sync")
BENCH_OVERRIDES = ("trainer.n_gpus_per_node=1", "trainer.nnodes=1", "actor_rollout_ref.rollout.num_replicas=1",
                   "trainer.colocate=false", "algorithm.rollout_correction.mode=token_tis")


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def summarize_async(history: Sequence[dict[str, Any]], skip: int = 2) -> dict[str, float]:
    """Medians over the steps after the first ``skip``: ``step_s`` (wall), ``<phase>_s`` for the driver's
    phases (gen: the engine's own seconds when it ran ahead, ``async/gen_s``), staleness and overlap."""
    steps = [r for r in history if "timing_s/step_wall" in r]
    if len(steps) <= skip:
        raise ValueError(f"{len(steps)} steps recorded; need more than the {skip} skipped at the start")
    steps = steps[skip:]
    out = {"steps": float(len(steps)), "step_s": _median([r["timing_s/step_wall"] for r in steps])}
    for p in PHASES:
        key = "async/gen_s" if p == "gen" and "async/gen_s" in steps[0] else f"timing_s/{p}"
        values = [r[key] for r in steps if key in r]
        if values:
            out[f"{p}_s"] = _median(values)
    for key in ("async/staleness_mean", "async/overlap"):
        if key in steps[0]:
            out[key.split("/")[1]] = _median([r[key] for r in steps])
    return out


def ideal_speedup(sync: dict[str, float]) -> dict[str, float]:
    """From a synchronous run's medians: gen, train (= step - gen) and ``(gen + train) / max(gen, train)``."""
    gen = sync["gen_s"]
    train = sync["step_s"] - gen
    if gen <= 0 or train <= 0:
        raise ValueError(f"need gen > 0 and train > 0 seconds, got gen={gen}, train={train}")
    return {"gen_s": gen, "train_s": train, "ideal": (gen + train) / max(gen, train)}


def _config(recipe: str, k: int, out_dir: str, overrides: Sequence[str], timing: bool, steps: int | None):
    from rlpad.recipe.load import load_config

    runs = [f"trainer.default_local_dir={out_dir}", "trainer.logger=[jsonl]", "trainer.save_freq=-1",
            "trainer.resume_mode=disable", f"trainer.max_off_policy_steps={k}"]
    if steps is not None:
        runs.append(f"trainer.total_training_steps={steps}")
    if timing:
        runs += ["trainer.test_freq=-1", "trainer.val_before_train=false", "data.val_files=[]"]
    return load_config(recipe, [*BENCH_OVERRIDES, *overrides, *runs])


def _train(config: Any) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    from rlpad.train import fit

    pinned: dict[str, list[int]] = {}

    def pin(workers: Any) -> Any:
        from workers.cpu_pin import pin_cores  # the Ray side

        pinned.update(pin_cores(workers))
        return workers

    return fit(config, wrap_workers=pin), pinned


def run_async_e2e(recipe: str, ks: Sequence[int] = (0, 1), steps: int = 6, overrides: Sequence[str] = (),
                  out: str | None = None, skip: int = 2) -> dict[str, Any]:
    """One run per k (the first must be 0: the synchronous reference); writes JSON to ``out`` (:func:`tables`
    formats the result)."""
    ks = list(ks)
    if not ks or ks[0] != 0 or any(k < 0 for k in ks) or len(set(ks)) != len(ks):
        raise ValueError(f"--max-off-policy-steps {ks}: give 0 first (the synchronous reference), then distinct k >= 1")
    if steps <= skip:
        raise ValueError(f"steps={steps}: need more than the {skip} steps skipped at the start")
    modes, pinned = {}, {}
    with tempfile.TemporaryDirectory(prefix="rlpad-e2e-async-") as tmp:
        for k in ks:
            history, pinned = _train(_config(recipe, k, os.path.join(tmp, f"k{k}"), overrides, True, steps))
            modes[str(k)] = summarize_async(history, skip)
    ideal = ideal_speedup(modes["0"])
    for k in ks[1:]:
        m = modes[str(k)]
        m["speedup"] = modes["0"]["step_s"] / m["step_s"]
        m["of_ideal"] = m["speedup"] / ideal["ideal"]
    result = {"recipe": recipe, "steps": steps, "skip": skip, "pinned": pinned, "load_avg": list(os.getloadavg()),
              "ideal": ideal, "modes": modes}
    if out:
        write_json(result, out)
    return result


def tables(result: dict[str, Any]) -> list[Table]:
    """The per-phase table of a :func:`run_async_e2e` result, with the ideal and the measured speed-up."""
    modes, ideal = result["modes"], result["ideal"]
    ks = list(modes)
    rows = []
    for p in PHASES:
        if any(f"{p}_s" in modes[k] for k in ks):
            label = "gen (engine; overlapped when k > 0)" if p == "gen" else p
            rows.append([label] + [f"{modes[k][f'{p}_s']:.3f}" if f"{p}_s" in modes[k] else "" for k in ks])
    rows.append(["step"] + [f"{modes[k]['step_s']:.3f}" for k in ks])
    notes = [f"ideal speed-up = (gen {ideal['gen_s']:.3f} s + train {ideal['train_s']:.3f} s) / max = "
             f"{ideal['ideal']:.2f}x (the synchronous run's medians)"]
    for k in ks[1:]:
        m = modes[k]
        nan = float("nan")
        notes.append(f"k={k}: sync / async step time {m['speedup']:.2f}x = {m['of_ideal']:.2f} of the ideal "
                     f"(staleness {m.get('staleness_mean', nan):.2f}, overlap {m.get('overlap', nan):.2f})")
    pins = ", ".join(f"{name} on core {cores[0]}" for name, cores in result["pinned"].items())
    title = (f"{result['recipe']}: {result['steps']} steps per run, medians of steps {result['skip'] + 1}.."
             f"{result['steps']}; {pins}")
    return [Table(["phase (s)"] + [f"k={k}" for k in ks], rows, title=title, notes=notes)]


def run_async_curves(recipe: str, ks: Sequence[int] = (0, 1), overrides: Sequence[str] = (),
                     png: str = "docs/async_learning_curves.png", out: str | None = None) -> dict[str, Any]:
    """Train ``recipe`` to its end with its validation schedule once per k; plot the rewards in ``png``."""
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlpad-async-curves-") as tmp:
        for k in ks:
            history, _ = _train(_config(recipe, k, os.path.join(tmp, f"k{k}"), overrides, False, None))
            val = [(r["step"], r["val/reward"]) for r in history if "val/reward" in r]
            train = [(r["step"], r["reward/mean"]) for r in history if "reward/mean" in r]
            walls = [r["timing_s/step_wall"] for r in history if "timing_s/step_wall" in r]
            runs[str(k)] = {"val": val, "train": train, "val_final": val[-1][1] if val else float("nan"),
                            "val_initial": val[0][1] if val else float("nan"), "train_s": sum(walls)}
    result = {"recipe": recipe, "load_avg": list(os.getloadavg()), "runs": runs, "png": _plot(runs, png, recipe)}
    if out:
        write_json(result, out)
    return result


def curve_tables(result: dict[str, Any]) -> list[Table]:
    """Validation reward at the start and the end of each run of :func:`run_async_curves`, and its training seconds."""
    rows = [[k, f"{r['val_initial']:.3f}", f"{r['val_final']:.3f}", f"{r['train_s']:.0f}"]
            for k, r in result["runs"].items()]
    notes = [f"curves: {result['png']}"] if result["png"] else []
    return [Table(["max_off_policy_steps", "val reward, step 0", "val reward, last step", "training s (step walls)"],
                  rows, title=f"{result['recipe']}: the whole recipe per k", notes=notes, align="rrrr")]


def _plot(runs: dict[str, Any], png: str, recipe: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (k, run) in enumerate(runs.items()):
        color = f"C{i}"
        name = "synchronous" if k == "0" else f"max_off_policy_steps={k}"
        ax.plot(*zip(*run["train"]), color=color, alpha=0.35, lw=1)
        if run["val"]:
            ax.plot(*zip(*run["val"]), "o-", color=color, label=f"{name}: validation", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (faint: training batch)")
    ax.set_title(os.path.basename(recipe), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
