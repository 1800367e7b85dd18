"""Embedded tasks' dataset cache folders carry the task's version: a task whose rows changed never reuses old ones."""

import os
from dataclasses import replace

import pytest

from rlpad.config.schema import SFTConfig
from rlpad.embedded.tasks import TASKS, VL_TASKS, dataset_folder
from rlpad.embedded.resolve import embedded_dataset

SPECS = {**TASKS, **VL_TASKS}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_task_folder_carries_its_version_and_a_new_version_a_new_folder(name):
    spec, cfg = SPECS[name], SFTConfig()
    folder = dataset_folder(spec, cfg)
    assert folder.startswith(f"{spec.version or spec.name}-")
    bumped = replace(spec, version=f"{spec.version or spec.name}-bumped")
    assert dataset_folder(bumped, cfg) != folder
    assert dataset_folder(spec, replace(cfg, data_seed=cfg.data_seed + 1)) != folder  # the split settings too


def test_the_folder_names_kept_where_they_already_carried_the_version():
    cfg = SFTConfig()
    assert dataset_folder(TASKS["toy"], cfg) == f"toy-{cfg.data_seed}-{cfg.n_val}-{cfg.max_operand}"  # no version
    assert dataset_folder(TASKS["toy_python"], cfg) == f"toy_python-2-{cfg.data_seed}-{cfg.n_val}"
    assert dataset_folder(VL_TASKS["vl_shapes"], cfg) == f"vl_shapes-2-{cfg.data_seed}-{cfg.n_val}"


def test_the_run_writes_the_dataset_into_the_versioned_folder(tmp_path):
    cfg = SFTConfig(cache_dir=str(tmp_path))
    out = embedded_dataset("toy_guess", cfg)
    assert os.path.basename(out) == dataset_folder(TASKS["toy_guess"], cfg)
    assert TASKS["toy_guess"].version in os.path.basename(out)
    assert sorted(os.listdir(out)) == ["train.parquet", "val.parquet"]
