"""Embedded names resolved to real paths, building what they name on first use (cached).

``actor_rollout_ref.model.path: embedded:<task>`` (and the critic's, the judge's, the reward model's) is the tiny
Qwen2 model warm-started on that task (rlpad.embedded.sft); ``embedded-teacher:<task>`` the same trained further
(distillation's teacher); ``data.train_files: [<task>:train]`` / ``[<task>:val]`` the task's dataset
(rlpad.embedded.tasks). They make the tiny recipes self-contained on a fresh machine.
"""

from __future__ import annotations

import os
import shutil

from rlpad.algorithms.distillation_rules import PATH_KEY as TEACHER_PATH_KEY
from rlpad.config.schema import Config, SFTConfig
from rlpad.embedded.cache import cache_root
from rlpad.embedded.tasks import TASKS, VL_TASKS, dataset_folder, dataset_spec

__all__ = ["EMBEDDED_PREFIX", "EMBEDDED_TEACHER_PREFIX", "embedded_data_task", "embedded_dataset", "embedded_reward_model",
           "embedded_task", "resolve_embedded"]

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TEACHER_PREFIX = "embedded-teacher:"  # distillation's built-in teacher: the warm start trained further


def embedded_task(path: str, key: str) -> str | None:
    """The task of an ``embedded:<task>`` model path (None for any other path)."""
    if not path.startswith(EMBEDDED_PREFIX):
        return None
    task = path[len(EMBEDDED_PREFIX):]
    if task not in TASKS and task not in VL_TASKS:
        raise ValueError(f"{key}={path!r}: unknown embedded model; use one of "
                         f"{[EMBEDDED_PREFIX + t for t in [*TASKS, *VL_TASKS]]}")
    return task


def embedded_data_task(name: str) -> str | None:
    """The task of a ``<task>:train`` / ``<task>:val`` data name (None for a file path)."""
    task, sep, split = name.partition(":")
    if not sep or (task not in TASKS and task not in VL_TASKS):
        return None
    if split not in ("train", "val"):
        raise ValueError(f"data files: unknown embedded dataset {name!r}; use {task}:train or {task}:val")
    return task


def resolve_embedded(config: Config) -> Config:
    """Replace the embedded model and data names with real paths (building them if needed)."""
    model = config.actor_rollout_ref.model
    task = embedded_task(model.path, "actor_rollout_ref.model.path")
    critic_task = embedded_task(config.critic.model.path, "critic.model.path")
    if task is not None:
        from rlpad.embedded.sft import warm_start

        embedded = model.path
        model.path = (VL_TASKS[task].warm_start(config.sft) if task in VL_TASKS else
                      warm_start(config.sft, seed=0, task=task, verbose=False))
        if config.critic.model.path == embedded:
            config.critic.model.path = model.path
    teacher = config.distillation.teacher_models.teacher_model
    if config.distillation.enabled and (teacher.model_path or "").startswith(EMBEDDED_TEACHER_PREFIX):
        from rlpad.embedded.sft import embedded_teacher

        name = EMBEDDED_PREFIX + teacher.model_path[len(EMBEDDED_TEACHER_PREFIX):]
        teacher.model_path = embedded_teacher(config.sft, task=embedded_task(name, TEACHER_PATH_KEY))
    if critic_task is not None and embedded_task(config.critic.model.path, "critic.model.path") is not None:
        raise ValueError(f"critic.model.path={config.critic.model.path} needs actor_rollout_ref.model.path to be "
                         "the same embedded model")
    judge = config.reward.judge  # embedded:<task>: the task's warm-started policy as the judge (a tiny LM rlpad builds)
    judge_task = embedded_task(judge.model_path or "", "reward.judge.model_path") if judge.enable else None
    if judge_task is not None:
        from rlpad.embedded.sft import warm_start

        judge.model_path = warm_start(config.sft, seed=0, task=judge_task, verbose=False)
    rm = config.reward.reward_model
    if rm.enable and rm.model_path and embedded_task(rm.model_path, "reward.reward_model.model_path") is not None:
        rm.model_path = embedded_reward_model(rm.model_path, config.sft)
    data, sft = config.data, config.sft
    for files in (data.train_files, data.val_files):
        for i, name in enumerate(files):
            data_task = embedded_data_task(name)
            if data_task is not None:
                files[i] = os.path.join(embedded_dataset(data_task, sft), f"{name.partition(':')[2]}.parquet")
    return config


def embedded_reward_model(path: str, sft: SFTConfig) -> str:
    """The folder of the embedded reward model ``embedded:toy`` (rlpad.embedded.reward_sft; built once)."""
    from rlpad.embedded.reward_sft import TASK, toy_reward_model

    if path != EMBEDDED_PREFIX + TASK:
        raise ValueError(f"reward.reward_model.model_path={path!r}: the embedded reward model is "
                         f"{EMBEDDED_PREFIX}{TASK} (the toy task's; no other task has one)")
    return toy_reward_model(sft)


def embedded_dataset(task: str, sft: SFTConfig) -> str:
    """The folder holding ``train.parquet`` and ``val.parquet`` of an embedded task (written once)."""
    spec = dataset_spec(task)
    out = os.path.join(cache_root(sft), dataset_folder(spec, sft))
    if not all(os.path.isfile(os.path.join(out, f)) for f in ("train.parquet", "val.parquet")):
        tmp = f"{out}.tmp-{os.getpid()}"
        spec.write_dataset(tmp, sft)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out
