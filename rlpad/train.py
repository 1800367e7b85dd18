"""``python -m rlpad.train --config recipes/<name>.yaml [a.b.c=value ...]`` (also ``rlpad train``).

Locally it starts a Ray head on 127.0.0.1 itself; under ``ray job submit`` (RAY_ADDRESS set) it
joins that cluster. ``trainer.backend=local`` runs the same workers in this process instead (no
Ray, world size 1; workers/local.py). Embedded names (``embedded:<task>`` models, ``<task>:train`` data) make
the tiny recipes self-contained on a fresh machine (:mod:`rlpad.embedded.resolve`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlpad.algorithms.advantages import uses_critic
from rlpad.config.schema import Config
from rlpad.recipe.checks import no_effect_notice
from rlpad.recipe.load import load_config, save_config
from rlpad.core.models import load_tokenizer, model_source
import rlpad.embedded.tiny  # noqa: F401  registers the tiny:<arch> model paths with rlpad.core.models
from rlpad.data import PromptDataset, PromptLoader, build_datasets, data_sources_of
from rlpad.embedded.resolve import (EMBEDDED_PREFIX, EMBEDDED_TEACHER_PREFIX, embedded_data_task, embedded_task,
                                    resolve_embedded)
from rlpad.embedded.tasks import dataset_spec
from rlpad.lora.adapters import check_lora
from rlpad.parallel import sp_size
from rlpad.multimodal.checks import vl_config_problems
from rlpad.multimodal.processor import load_vl_processor
from rlpad.multimodal.prompts import PromptImages
from rlpad.training.metrics import cpu_kernels
from rlpad.code.hooks import configure as configure_code, sandbox_problem
from rlpad.code.sources import verl_difference_notice
from rlpad.rewards.rules import code_source_problem
from rlpad.rewards.math_verifier import drain_fallbacks
from rlpad.rewards.combine import CombinedReward, build_reward
from rlpad.rewards.settings import reward_notices
from rlpad.rewards.sources import data_source_problems, rule_scores_source
from rlpad.rollout import backend_class
from rlpad.rollout.agent_loops import loop_names
from rlpad.rollout.interactions import interaction_notice
from rlpad.rollout.stateful_tools import advertised_schemas
from rlpad.run_log import RunLog
from rlpad.topology import resolve_device
from rlpad.training.hf_out import HF_DIRS, hf_roles
from rlpad.training.step_metrics import summarize
from rlpad.training.streaming import StreamTrainer
from rlpad.training.trainer import Trainer, fill_lr_horizons, total_training_steps
from rlpad.algorithms.distillation_rules import (PATH_KEY as TEACHER_PATH_KEY, distillation_notices, teacher_path,
                                                teacher_problems, uses_teacher_topk)

__all__ = ["Prepared", "check_code_sandbox", "check_inputs", "check_output_dir", "fit", "launch", "main", "prepare", "run"]

# Ray's job supervisor sets this (the job's runtime env) in the process `ray job submit` starts, and only there.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def check_output_dir(config: Config) -> None:
    """Under ``ray job submit`` a relative ``trainer.default_local_dir`` is refused (ValueError).

    The job runs in Ray's unpacked copy of ``--working-dir`` (or the supervisor's folder), which Ray
    deletes, on the head node. It is not resolved against the folder the job was submitted from: the
    job is never told that folder (its runtime env holds only the package's ``gcs://`` URI), and
    ``ray job submit`` may run on another machine than the head, so any guess could write elsewhere.
    """
    out = config.trainer.default_local_dir
    if RAY_JOB_ENV in os.environ and not os.path.isabs(out):
        raise ValueError(
            f"trainer.default_local_dir={out!r} is relative, and this is a `ray job submit` job: it would resolve "
            f"inside Ray's temporary copy of the working dir ({os.getcwd()}), which Ray deletes, so metrics, "
            f"checkpoints and run.log would be lost. Give an absolute path on the head node, e.g. "
            f"trainer.default_local_dir=$PWD/{out} (your shell fills in $PWD where you submit)")


def check_inputs(config: Config) -> None:
    """The paths a run reads exist: data files (FileNotFoundError) and model folders (ValueError),
    each named by its key; the output folder survives the run (:func:`check_output_dir`). Cheap:
    runs before anything is built or started."""
    check_output_dir(config)
    data = config.data
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for name in files:
            if embedded_data_task(name) is None and not os.path.isfile(name):
                raise FileNotFoundError(f"{key}: data file not found: {name!r}")
    model = config.actor_rollout_ref.model
    paths = [("actor_rollout_ref.model.path", model.path), ("actor_rollout_ref.model.tokenizer_path", model.tokenizer_path)]
    if uses_critic(config):
        paths += [("critic.model.path", config.critic.model.path), ("critic.model.tokenizer_path",
                                                                     config.critic.model.tokenizer_path)]
    if teacher_path(config) is not None:
        paths.append((TEACHER_PATH_KEY, teacher_path(config)))
    adapter = model.lora_adapter_path
    if adapter is not None and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        what = "does not exist" if not os.path.exists(adapter) else "is not a peft adapter folder (no adapter_config.json)"
        raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={adapter!r} {what}")
    for key, path in paths:
        if not path or model_source(path) is not None or path.startswith((EMBEDDED_PREFIX, EMBEDDED_TEACHER_PREFIX)):
            continue  # unset, or built in code
        if not os.path.isdir(path):
            what = "is a file, not" if os.path.isfile(path) else "is not"
            raise ValueError(f"{key}={path!r} {what} a directory (a local Hugging Face checkpoint folder; "
                             "nothing is downloaded)")


def check_code_sandbox(config: Config) -> None:
    """Before anything is built (a warm start, a dataset): a run that will run programs (an embedded code
    task's warm start or data, a data file with a code data_source the reward rule scores) needs the code
    sandbox to work here; ValueError in one line naming what is missing otherwise (rlpad.code.sandbox_problem)."""
    data, model_path = config.data, config.actor_rollout_ref.model.path
    files = [*data.train_files, *data.val_files]
    sources = set().union(*(data_sources_of(f) for f in files if embedded_data_task(f) is None))
    configure_code(config.reward.code, sources)
    task = embedded_task(model_path, "actor_rollout_ref.model.path")
    coded = [t for t in {task, *map(embedded_data_task, files)} if t is not None and dataset_spec(t).runs_code]
    if coded and (problem := sandbox_problem()):
        raise ValueError(f"embedded task {', '.join(map(repr, sorted(coded)))} runs programs: {problem}")
    spec = config.reward.function_spec
    if problem := code_source_problem(spec, [s for s in sources if rule_scores_source(spec, s)]):
        raise ValueError(problem)


@dataclass
class Prepared:
    """What the driver builds before any worker starts (:func:`prepare`)."""

    config: Config
    tokenizer: Any
    processor: Any  # a vision-language model's rlpad.multimodal.processor.VLProcessor; None for a text model
    train_loader: PromptLoader
    val_dataset: PromptDataset | None
    reward_fn: Callable[..., Any]


def prepare(config: Config) -> Prepared:
    """Check the inputs, resolve embedded names, load the tokenizer, the datasets and the reward.

    Everything a user can get wrong in a recipe fails here, with ValueError / FileNotFoundError
    naming it, before Ray or vLLM start. verl keys set that change nothing here are named in one
    warning line on stderr (:func:`rlpad.recipe.checks.no_effect_notice`).
    """
    for notice in [no_effect_notice(config)] + reward_notices(config.reward) + distillation_notices(config):
        if notice:
            print(notice, file=sys.stderr, flush=True)
    check_inputs(config)
    check_code_sandbox(config)
    config = resolve_embedded(config)
    check_lora(config)  # the target modules and a saved adapter against the model (built on the meta device)
    model_cfg = config.actor_rollout_ref.model
    tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path)
    if teacher_path(config) is not None:  # a causal LM with the student's tokenizer (docs/distillation.md)
        problems = teacher_problems(teacher_path(config), tokenizer, model_cfg.tokenizer_path or model_cfg.path,
                                    config.distillation.distillation_loss.topk if uses_teacher_topk(config) else None)
        if problems:
            raise ValueError(problems[0])
    processor, images = _vl_inputs(config, tokenizer)
    mt = config.actor_rollout_ref.rollout.multi_turn
    tools = advertised_schemas(mt)  # what the prompts advertise
    train_loader, val_dataset = build_datasets(config.data, tokenizer, tools, images)
    rows = [row for ds in (train_loader.dataset, val_dataset) if ds is not None for row in ds.rows]
    sources = {row["data_source"] for row in rows}
    loops = set(loop_names([row["agent_name"] for row in rows], config.actor_rollout_ref.rollout.agent, mt.enable))
    if notice := interaction_notice(mt.interaction_config_path, loops):
        print(notice, file=sys.stderr, flush=True)
    configure_code(config.reward.code, sources)  # the sandbox pool of code sources (rlpad.code)
    if notice := verl_difference_notice(config.reward.code.continuous, sources):
        print(notice, file=sys.stderr, flush=True)
    if problems := data_source_problems(config.reward, sources):  # the rule and source_weights against the data
        raise ValueError("invalid config:\n  " + "\n  ".join(problems))
    drain_fallbacks()  # a run's first step counts its own fall-backs, not an earlier run's in this process
    fill_lr_horizons(config, total_training_steps(config, len(train_loader)))
    return Prepared(config, tokenizer, processor, train_loader, val_dataset,
                    build_reward(config.reward, _reward_model_inputs(config, tokenizer), _judge(config, tokenizer)))


def _vl_inputs(config: Config, tokenizer: Any) -> tuple[Any, PromptImages]:
    """A vision-language model's processor (None for a text model) and the datasets' image columns,
    after the recipe's VL checks (rlpad.multimodal.checks)."""
    model, data = config.actor_rollout_ref.model, config.data
    processor = load_vl_processor(model.path, tokenizer, data.mm_processor_kwargs)
    rollout_images = backend_class(config.actor_rollout_ref.rollout.name).image_support()
    if problems := vl_config_problems(config, processor is not None, rollout_images):
        raise ValueError("invalid config:\n  " + "\n  ".join(problems) if len(problems) > 1 else problems[0])
    return processor, PromptImages(processor, image_key=data.image_key, video_key=data.video_key,
                                   limit_images=config.actor_rollout_ref.rollout.limit_images, model_path=model.path)


def _reward_model_inputs(config: Config, tokenizer: Any) -> Any:
    """What the reward model reads (rlpad.rewards.model_scorer) when ``reward.reward_model.enable``, else
    None: built here, so a folder that is not a reward model fails before any worker starts."""
    rm = config.reward.reward_model
    if not rm.enable:
        return None
    from rlpad.rewards.model_scorer import RewardModelInputs  # transformers' tokenizer loading

    budget = rm.forward_max_token_len_per_gpu * sp_size(rm, "reward_model") if rm.use_dynamic_bsz else None
    return RewardModelInputs(rm.model_path, tokenizer, trust_remote_code=config.actor_rollout_ref.model.trust_remote_code,
                             max_tokens=budget)


def _judge(config: Config, tokenizer: Any) -> Any:
    """The generative judge (rlpad.rewards.judge) when ``reward.judge.enable``, else None: built here, so a bad
    template or a folder that is not a causal LM fails before any worker starts."""
    if not config.reward.judge.enable:
        return None
    from rlpad.rewards.judge import JudgeScorer  # transformers' tokenizer loading

    return JudgeScorer(config.reward.judge, tokenizer, trust_remote_code=config.actor_rollout_ref.model.trust_remote_code)


def fit(config: Config | Prepared, wrap_workers: Callable[[Any], Any] | None = None) -> list[dict[str, Any]]:
    """:func:`prepare` (unless given), start the workers, train; returns the per-step records.
    ``wrap_workers`` (optional) wraps the workers before the trainer gets them (benchmarks use it
    to look at the batches). Third-party output goes to ``<default_local_dir>/run.log``
    (:class:`rlpad.run_log.RunLog`)."""
    prep = config if isinstance(config, Prepared) else prepare(config)
    config = prep.config
    out_dir = config.trainer.default_local_dir
    os.makedirs(out_dir, exist_ok=True)
    save_config(config, os.path.join(out_dir, "config.yaml"))

    with RunLog(out_dir, config.trainer.log_level) as run_log:
        print(_starting_line(config, run_log), flush=True)
        workers = launch(config, run_log)
        if isinstance(prep.reward_fn, CombinedReward):
            prep.reward_fn.attach_workers(workers)  # the reward model's part: its worker group; the judge's engines
        try:
            driven = wrap_workers(workers) if wrap_workers is not None else workers
            trainer = StreamTrainer if config.async_training.enable else Trainer  # rlpad.training.streaming
            return trainer(config, driven, prep.tokenizer, prep.train_loader, prep.val_dataset, prep.reward_fn).fit()
        finally:
            with _no_interrupt():  # a second Ctrl-C must not leave workers behind
                workers.shutdown()


@contextmanager
def _no_interrupt() -> Iterator[None]:
    """SIGINT ignored inside (in the main thread; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run(config: Config | Prepared) -> dict[str, float]:
    """Train with ``config``; returns the run summary (initial/final validation reward, throughput)."""
    start = time.perf_counter()
    history = fit(config)
    config = config.config if isinstance(config, Prepared) else config
    summary = summarize(history) | {"wall_s": time.perf_counter() - start}
    _print_summary(summary, config)
    return summary


def _starting_line(config: Config, run_log: RunLog) -> str:
    """The one line printed while the workers start: what starts, and where its messages go."""
    t, arr = config.trainer, config.actor_rollout_ref
    roles = "+".join(["actor"] + ["ref"] * config.builds_ref + ["critic"] * uses_critic(config)
                     + ["teacher"] * config.distillation.enabled)
    where = ("in this process" if t.backend == "local"
             else f"on Ray, {t.nnodes * t.n_gpus_per_node} rank(s) per role")
    quiet = "" if run_log.level in ("info", "debug") else " (--verbose: here too)"
    return (f"rlpad: starting {roles} and the {arr.rollout.name} rollout {where}; their start-up messages go to "
            f"{run_log.path}{quiet}")


def launch(config: Config, run_log: RunLog | None = None):
    """The worker stack named by ``trainer.backend``: Ray actors, or everything in this process."""
    if config.trainer.backend == "local":
        from workers.local import launch_local_workers  # no Ray

        return launch_local_workers(config, run_log=run_log)
    from workers.launcher import launch_workers  # the Ray side

    return launch_workers(config, run_log=run_log)


def _print_summary(summary: dict[str, float], config: Config) -> None:
    print("\n" + "=" * 60)
    kind = config.algorithm.adv_estimator + (" + distillation" if config.distillation.enabled else "")
    print(f"rlpad {kind} run: {config.trainer.default_local_dir}")
    if "val_reward_initial" in summary:
        gain = summary["val_reward_final"] - summary["val_reward_initial"]
        print(f"  validation reward   {summary['val_reward_initial']:.3f} -> {summary['val_reward_final']:.3f}  ({gain:+.3f})")
        if resolve_device(config) == "cpu":  # the trajectory is the vector unit's
            print(f"  CPU kernels         {cpu_kernels()} (another vector unit learns along another path)")
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
    for role in hf_roles(config):  # trainer.save_hf / save_contents hf_model (docs/export.md)
        print(f"  {role}: {os.path.join(config.trainer.default_local_dir, HF_DIRS[role], 'latest')} (Hugging Face folder)")
    print("=" * 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlpad.train", description="GRPO/PPO training from a recipe")
    parser.add_argument("--config", default=None, help="recipe YAML (default: the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show Ray's, vLLM's and the workers' messages on the console too (trainer.log_level=info)")
    args = parser.parse_args(argv)
    overrides = [*args.overrides, *(["trainer.log_level=info"] if args.verbose else [])]
    try:  # what the user gave (recipe, overrides, paths, data): one line naming the problem, exit 2
        prepared = prepare(load_config(args.config, overrides))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(prepared)
    except KeyboardInterrupt:  # the workers are already shut down (fit)
        print(f"\ninterrupted; every worker is stopped. Resume with trainer.resume_mode=auto (the default: the latest "
              f"checkpoint under {prepared.config.trainer.default_local_dir}/checkpoints)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

