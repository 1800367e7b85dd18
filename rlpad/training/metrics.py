"""Per-step metrics: JSONL, TensorBoard, W&B (when installed and asked for), and the console: one line
per step (:func:`step_line`) and, after a validation, its table per data source
(rlpad.training.validation_metrics.summary_lines)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from rlpad.progress import format_seconds
from rlpad.training.validation_metrics import ALL_SOURCES, core_summary, summary_lines

__all__ = ["MetricsLogger", "cpu_kernels", "plot_reward_curve", "step_line"]

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


def step_line(step: int, total: int, metrics: dict[str, Any], seconds: float | None = None,
              eta_s: float | None = None) -> str:
    """One step at a glance: ``step 12/60 | reward 0.438 | val 0.613 | 3.1 s | 2.4k tok/s | ETA 2m29s``
    (each part only when known: ``val`` on validation steps, ``tok/s`` the step's valid tokens per second)."""
    parts = [f"step {step}/{total}"]
    if "reward/mean" in metrics:
        parts.append(f"reward {metrics['reward/mean']:.3f}")
    if "val/reward" in metrics:
        parts.append(f"val {metrics['val/reward']:.3f}")
    if seconds is not None:
        parts.append(f"{seconds:.1f} s")
    rate = metrics.get("tokens_per_s/step")
    if isinstance(rate, (int, float)) and math.isfinite(rate):
        parts.append(f"{rate / 1000:.1f}k tok/s" if rate >= 1000 else f"{rate:.0f} tok/s")
    if eta_s is not None and step < total:
        parts.append(f"ETA {format_seconds(eta_s)}")
    return " | ".join(parts)


def cpu_kernels() -> str:
    """The vector unit torch's CPU kernels run on here (``AVX2``, ``AVX512``, ...). Float results, and so a
    run's learning trajectory, depend on it: a figure measured on the CPU names it."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


class MetricsLogger:
    """Writes one record per step to every backend in ``backends``."""

    def __init__(self, out_dir: str, backends: list[str], *, total_steps: int, project: str = "rlpad",
                 run_name: str = "run", config: dict[str, Any] | None = None, start_step: int = 0):
        unknown = sorted(set(backends) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; choose from {list(LOGGERS)}")
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._jsonl = open(self.path, "a") if "jsonl" in backends else None
        self._tb = self._wandb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        if "wandb" in backends:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("trainer.logger asks for wandb, which is not installed (pip install wandb)") from e
            self._wandb = wandb.init(project=project, name=run_name, config=config)
        self._console = "console" in backends
        self.total_steps, self.start_step = total_steps, start_step
        self._started = self._last = time.perf_counter()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb:
            self._wandb.log(numeric, step=step)
        if self._console:
            self._print(step, numeric)

    def _print(self, step: int, numeric: dict[str, Any]) -> None:
        """The step's line (its wall seconds since the last line; the ETA at the mean so far), then the
        validation table when it says more than the line (several sources, or N > 1)."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        done = step - self.start_step
        eta = (now - self._started) / done * (self.total_steps - step) if done > 0 else None
        print(step_line(step, self.total_steps, numeric, seconds if done > 0 else None, eta), flush=True)
        if step == self.start_step:
            self._started = now  # the ETA counts training steps, not a validation before them
        summary = core_summary(numeric)
        if len(summary) > 1 or any(row["n"] > 1 for row in summary.values()):
            print("\n".join("  " + line for line in summary_lines(numeric, f"validation at step {step}")), flush=True)

    def warn(self, line: str) -> None:
        """A warning line on the console (stderr)."""
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def plot_reward_curve(records: list[dict[str, Any]], path: str) -> str | None:
    """Training and validation reward against step, and with several data sources each one's validation
    mean (its core variable's mean@N, rlpad.training.validation_metrics), as a PNG; None if matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = [(r["step"], r["reward/mean"]) for r in records if "reward/mean" in r]
    val = [(r["step"], r["val/reward"]) for r in records if "val/reward" in r]
    if train:
        ax.plot(*zip(*train), label="train reward (mean)", color="tab:blue", alpha=0.7)
    if val:
        ax.plot(*zip(*val), "o-", label="validation reward", color="tab:orange")
    shown = [y for _, y in train + val]
    sources = _source_means(records)
    if len(sources) > 1:  # one source: its mean is the validation reward already drawn
        for color, (label, points) in enumerate(sources.items(), start=2):
            ax.plot(*zip(*points), "s--", ms=3, lw=1, color=f"C{color % 10}", label=label)
            shown += [y for _, y in points]
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    low, high = min([0.0, *shown]), max([1.0, *shown])
    ax.set_ylim(low - 0.02 * (high - low), high + 0.02 * (high - low))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _source_means(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per data source (not ``all``), its legend label -> ``[(step, its core mean@N), ...]`` over the records."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for source, row in core_summary(r).items():
            if source != ALL_SOURCES and row["mean"] is not None:
                out.setdefault(f"val {source} ({row['var']} mean@{row['n']})", []).append((r["step"], row["mean"]))
    return out
