"""``python -m rlpad.train --config recipes/<name>.yaml [a.b.c=value ...]`` (also ``rlpad train``).

Locally it starts a Ray head on 127.0.0.1 itself; under ``ray job submit`` (RAY_ADDRESS set) it
joins that cluster. ``trainer.backend=local`` runs the same workers in this process instead (no
Ray, world size 1; workers/local.py). Two embedded names make the default recipe self-contained on a fresh
machine: ``actor_rollout_ref.model.path: embedded:toy`` is the tiny Qwen2 model warm-started on
the toy task by :mod:`rlpad.embedded.sft` (cached), and ``data.train_files: [toy:train]`` /
``data.val_files: [toy:val]`` are the toy dataset of :mod:`rlpad.embedded.toy` (written on first use).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from rlpad.config import Config
from rlpad.config_loader import load_config, save_config
from rlpad.data import build_datasets
from rlpad.core.models import load_tokenizer
from rlpad.rewards import load_reward_fn
from rlpad.trainer import Trainer, summarize

__all__ = ["main", "resolve_embedded", "run"]

EMBEDDED_MODEL = "embedded:toy"


def resolve_embedded(config: Config) -> Config:
    """Replace the embedded model and toy data names with real paths (building them if needed)."""
    model = config.actor_rollout_ref.model
    if model.path == EMBEDDED_MODEL:
        from rlpad.embedded.sft import warm_start

        model.path = warm_start(config.sft, seed=0, verbose=False)
        if config.critic.model.path == EMBEDDED_MODEL:
            config.critic.model.path = model.path
    elif config.critic.model.path == EMBEDDED_MODEL:
        raise ValueError("critic.model.path=embedded:toy needs actor_rollout_ref.model.path=embedded:toy too")
    data, sft = config.data, config.sft
    if any(f.startswith("toy:") for f in [*data.train_files, *data.val_files]):
        from rlpad.embedded.toy import write_toy_dataset

        out = os.path.join(os.path.abspath(sft.cache_dir), f"toy-{sft.data_seed}-{sft.n_val}-{sft.max_operand}")
        paths = {"toy:train": os.path.join(out, "train.parquet"), "toy:val": os.path.join(out, "val.parquet")}
        if not all(os.path.isfile(p) for p in paths.values()):
            tmp = f"{out}.tmp-{os.getpid()}"
            write_toy_dataset(tmp, n_val=sft.n_val, seed=sft.data_seed, max_operand=sft.max_operand)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        for files in (data.train_files, data.val_files):
            for i, f in enumerate(files):
                if f.startswith("toy:"):
                    if f not in paths:
                        raise ValueError(f"data files: unknown embedded dataset {f!r}; use toy:train or toy:val")
                    files[i] = paths[f]
    return config


def run(config: Config) -> dict[str, float]:
    """Train with ``config``; returns the run summary (initial/final validation reward, throughput)."""
    config = resolve_embedded(config)
    model_cfg = config.actor_rollout_ref.model
    tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path)
    train_loader, val_dataset = build_datasets(config.data, tokenizer)
    reward_fn = load_reward_fn(config.reward.fn)
    out_dir = config.trainer.default_local_dir
    os.makedirs(out_dir, exist_ok=True)
    save_config(config, os.path.join(out_dir, "config.yaml"))

    start = time.perf_counter()
    workers = _launch(config)
    trainer = Trainer(config, workers, tokenizer, train_loader, val_dataset, reward_fn)
    try:
        history = trainer.fit()
    finally:
        workers.shutdown()
    summary = summarize(history) | {"wall_s": time.perf_counter() - start}
    _print_summary(summary, config)
    return summary


def _launch(config: Config):
    """The worker stack named by ``trainer.backend``: Ray actors, or everything in this process."""
    if config.trainer.backend == "local":
        from workers.local import launch_local_workers  # no Ray

        return launch_local_workers(config)
    from workers.launcher import launch_workers  # the Ray side

    return launch_workers(config)


def _print_summary(summary: dict[str, float], config: Config) -> None:
    print("\n" + "=" * 60)
    print(f"rlpad {config.algorithm.adv_estimator} run: {config.trainer.default_local_dir}")
    if "val_reward_initial" in summary:
        gain = summary["val_reward_final"] - summary["val_reward_initial"]
        print(f"  validation reward   {summary['val_reward_initial']:.3f} -> {summary['val_reward_final']:.3f}  ({gain:+.3f})")
    for key, value in summary.items():
        if key.startswith("tokens_per_s/"):
            print(f"  tokens/s {key.split('/', 1)[1]:<12} {value:10.0f}")
    if "mismatch/abs_diff_mean" in summary:
        print(f"  rollout vs actor    |logp diff| mean {summary['mismatch/abs_diff_mean']:.2e}, max "
              f"{summary['mismatch/abs_diff_max']:.2e}, k3 KL {summary['mismatch/k3_kl']:.2e} (median over steps)")
    if "val/mismatch/abs_diff_mean" in summary:
        print(f"  ... on validation   |logp diff| mean {summary['val/mismatch/abs_diff_mean']:.2e}, max "
              f"{summary['val/mismatch/abs_diff_max']:.2e}, pearson {summary['val/mismatch/pearson']:.6f}")
    if "padding_ratio" in summary:
        print(f"  padding ratio       {summary['padding_ratio']:.1%}  (use_remove_padding="
              f"{config.actor_rollout_ref.model.use_remove_padding})")
    if "step_s" in summary:
        print(f"  median step         {summary['step_s']:.1f} s")
    print(f"  wall time           {summary['wall_s']:.0f} s")
    print(f"  metrics: {config.trainer.default_local_dir}/metrics.jsonl, curve: {config.trainer.default_local_dir}/reward_curve.png")
    print("=" * 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlpad.train", description="GRPO/PPO training from a recipe")
    parser.add_argument("--config", default=None, help="recipe YAML (default: the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())

