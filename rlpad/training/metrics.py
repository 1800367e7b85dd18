"""Per-step metrics: JSONL, TensorBoard, W&B (when installed and asked for), and a console bar."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

__all__ = ["MetricsLogger", "cpu_kernels", "plot_reward_curve"]

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# metric -> its name on the progress bar
BAR_METRICS = {"reward/mean": "reward", "val/reward": "val_reward", "actor/pg_loss": "pg_loss"}


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
        self._tb = self._wandb = self._bar = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        if "wandb" in backends:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("trainer.logger asks for wandb, which is not installed (pip install wandb)") from e
            self._wandb = wandb.init(project=project, name=run_name, config=config)
        if "console" in backends:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="rlpad", unit="step", dynamic_ncols=True)

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
        if self._bar:
            shown = {name: f"{numeric[k]:.3g}" for k, name in BAR_METRICS.items() if k in numeric}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step - self._bar.n)

    def warn(self, line: str) -> None:
        """A warning line on the console (stderr), above the progress bar when there is one."""
        if self._bar:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar:
            self._bar.close()
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
    """Training and validation reward against step, as a PNG; None if matplotlib is missing."""
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
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
