"""``rlpad eval --config RECIPE [--checkpoint PATH | --model HF_FOLDER] [--n N] [a.b.c=value ...]``.

The recipe's validation alone, on a trained model: the same rollout (``rollout.val_kwargs``), the same
reward, the same metrics as a run logs (``val/reward``, ``val-core/*``, ``val-aux/*``:
rlpad.training.validation_metrics); a table on the console and a JSON file. The model is a run's
checkpoint (``--checkpoint``: a ``global_step_<k>`` folder, or a run folder / its ``checkpoints``
folder for the latest), a Hugging Face folder (``--model``: ``actor_rollout_ref.model.path``), or the
recipe's own model. From a checkpoint of step k the validation is seeded as the run's own at step k,
so on the same stack it reproduces what the run logged there.

Only what validation needs is started: the actor (it loads the checkpoint and syncs the engines) and
the rollout, plus the reward model or judge the reward uses (and a PPO recipe's critic, a distillation
recipe's teacher); no reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from rlpad.config.schema import Config
from rlpad.recipe.load import load_config
from rlpad.training.checkpoint import CheckpointDir
from rlpad.training.validation_metrics import summary_lines

__all__ = ["evaluate", "find_checkpoint", "main", "validation_only"]


def find_checkpoint(path: str) -> str:
    """The checkpoint folder ``path`` names: itself (``global_step_<k>``), or the latest one of a run
    folder or of its ``checkpoints`` folder; ValueError in one line otherwise."""
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return path
    run = os.path.dirname(os.path.normpath(path)) if os.path.basename(os.path.normpath(path)) == "checkpoints" else path
    latest = CheckpointDir(run).latest()
    if latest is not None:
        return latest
    raise ValueError(f"--checkpoint {path!r} is not an rlpad checkpoint (a checkpoints/global_step_<k> folder "
                     "holding trainer_state.json), nor a run folder with one")


def validation_only(recipe: str, overrides: list[str], *, model: str | None = None, n: int | None = None) -> Config:
    """The recipe with ``overrides`` for validation alone, checked as any recipe is: ``model`` as
    ``actor_rollout_ref.model.path``, ``n`` responses per prompt, no reference (no KL), the synchronous
    schedule (a PPO recipe keeps its critic, a distillation recipe its teacher: the checks tie them to the
    estimator and the loss). ValueError: ``n`` below 1, or above 1 with greedy validation (the responses
    would be the same)."""
    if n is not None and n < 1:
        raise ValueError(f"--n {n}: must be >= 1")
    ours = ["actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false", "trainer.max_off_policy_steps=0"]
    ours += [f"actor_rollout_ref.model.path={model}"] if model is not None else []
    ours += [f"actor_rollout_ref.rollout.val_kwargs.n={n}"] if n is not None else []
    config = load_config(recipe, [*overrides, *ours])
    if n is not None and n > 1 and not config.actor_rollout_ref.rollout.val_kwargs.do_sample:
        raise ValueError(f"--n {n}: the recipe's validation is greedy (actor_rollout_ref.rollout.val_kwargs.do_sample="
                         f"false), so the {n} responses would be the same; add actor_rollout_ref.rollout.val_kwargs."
                         "do_sample=true and its temperature (e.g. 1.0)")
    return config


def evaluate(config: Config, checkpoint: str | None = None) -> tuple[dict[str, float], int]:
    """Start the workers ``config`` needs for validation, load ``checkpoint`` (or keep ``model.path``'s
    weights), validate once; returns (the metrics, the step the weights are from: 0 without a checkpoint)."""
    from rlpad.rewards.combine import CombinedReward
    from rlpad.run_log import RunLog
    from rlpad.train import launch, prepare
    from rlpad.training.initial_weights import sync_initial_weights
    from rlpad.training.trainer import Trainer

    step = int(CheckpointDir.read_state(checkpoint)["step"]) if checkpoint else 0
    prep = prepare(config)
    config = prep.config
    out_dir = os.path.join(config.trainer.default_local_dir, "eval")
    os.makedirs(out_dir, exist_ok=True)
    with RunLog(out_dir, config.trainer.log_level) as run_log:
        print(f"rlpad eval: starting the actor and the {config.actor_rollout_ref.rollout.name} rollout; their "
              f"messages go to {run_log.path}", flush=True)
        workers = launch(config, run_log)
        try:
            if isinstance(prep.reward_fn, CombinedReward):
                prep.reward_fn.attach_workers(workers)
            trainer = Trainer(config, workers, prep.tokenizer, prep.train_loader, prep.val_dataset, prep.reward_fn)
            if checkpoint:
                workers.load_checkpoint(checkpoint)
                workers.sync_weights()
            else:
                sync_initial_weights(config, workers)
            trainer.step = step  # the run's validation seed at that step
            metrics = trainer.validate()
            for line in trainer.warnings:
                print(line, file=sys.stderr)
        finally:
            workers.shutdown()
    return metrics, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpad eval", description="the recipe's validation alone on a trained "
                                     "model: per-source mean@N, best@k, worst@k, maj@k; a table and a JSON file")
    parser.add_argument("--config", required=True, help="the recipe (its data.val_files, reward, val_kwargs)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", default=None,
                       help="a checkpoints/global_step_<k> folder, or a run folder (its latest checkpoint)")
    which.add_argument("--model", default=None, help="a Hugging Face model folder (e.g. one rlpad export wrote)")
    parser.add_argument("--n", type=int, default=None, help="responses per prompt (rollout.val_kwargs.n)")
    parser.add_argument("--out", default=None, help="the JSON file (default <default_local_dir>/eval/<what>.json)")
    parser.add_argument("--verbose", "-v", action="store_true", help="Ray's, vLLM's and the workers' messages too")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    args = parser.parse_args(argv)
    overrides = [*args.overrides, *(["trainer.log_level=info"] if args.verbose else [])]
    try:  # what the user gave: one line naming the problem, exit 2, before anything starts
        checkpoint = find_checkpoint(args.checkpoint) if args.checkpoint else None
        if args.model is not None and not os.path.isdir(args.model):
            raise ValueError(f"--model {args.model!r} is not a folder (a Hugging Face model folder)")
        config = validation_only(args.config, overrides, model=args.model, n=args.n)
        if not config.data.val_files:
            raise ValueError(f"{args.config}: data.val_files is empty: nothing to validate on")
        start = time.perf_counter()
        metrics, step = evaluate(config, checkpoint)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = checkpoint or args.model or config.actor_rollout_ref.model.path
    out = args.out or os.path.join(config.trainer.default_local_dir, "eval",
                                   f"step_{step}.json" if checkpoint else f"{_slug(what)}.json")
    record = {"model": args.model, "checkpoint": checkpoint, "step": step, "recipe": args.config,
              "overrides": args.overrides, "n": config.actor_rollout_ref.rollout.val_kwargs.n,
              "seconds": round(time.perf_counter() - start, 2), "metrics": metrics}
    _write_json(record, out)
    print(f"rlpad eval of {what} (step {step}): val/reward {metrics['val/reward']:.4f} over {metrics['val/n']:.0f} "
          "responses")
    print("\n".join(summary_lines(metrics)))
    print(f"wrote {out}")
    return 0


def _slug(path: str) -> str:
    return os.path.basename(os.path.normpath(path)).replace(":", "_") or "model"


def _write_json(record: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
