"""``rlpad eval``: the recipe's validation alone on a checkpoint reproduces what the run logged at that
step (same stack, same seed: the same responses, every val-core / val-aux number equal), the reward
function's extracted answers reach a majority vote per data source, and bad input is one line.

One tiny run (the local stack, HF rollout): 1 step, 12 validation prompts in two data sources, 4 sampled
responses each, a checkpoint; then the eval of that checkpoint, and as the negative control the eval
of the initial weights seeded as the run's step 1 (the metrics must differ: the check sees the weights).
"""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from rlpad.config.schema import SFTConfig
from rlpad.evaluation import main as eval_main, validation_only
from rlpad.recipe.load import load_config
from rlpad.embedded.resolve import embedded_dataset
from rlpad.train import run
from rlpad.embedded.sft import warm_start
from paths import CACHE, ROOT, recipe

RECIPE = recipe("grpo_tiny")
PRED_REWARD = os.path.join(ROOT, "tests", "pred_reward.py") + ":compute_score"


def val_file(tmp_path) -> str:
    """12 of the toy task's validation prompts, alternately in data sources ``add/a`` and ``add/b``."""
    rows = pq.read_table(os.path.join(embedded_dataset("toy", SFTConfig(cache_dir=CACHE)), "val.parquet")).to_pylist()
    path = tmp_path / "val.jsonl"
    with open(path, "w") as f:
        for i, row in enumerate(rows[:12]):
            f.write(json.dumps({**row, "data_source": f"add/{'ab'[i % 2]}"}) + "\n")
    return str(path)


def overrides(out_dir: str, val: str) -> list[str]:
    return [f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
            "trainer.backend=local", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
            f"data.val_files=[{val}]", f"reward.fn={PRED_REWARD}", "data.train_batch_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "actor_rollout_ref.rollout.val_kwargs.n=4", "trainer.val_before_train=false"]


def validation_keys(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith(("val-core/", "val-aux/", "val/reward"))}


def test_eval_of_a_checkpoint_equals_the_runs_validation_at_that_step(tmp_path, capsys):
    val, out = val_file(tmp_path), str(tmp_path / "run")
    run(load_config(RECIPE, [*overrides(out, val), "trainer.total_training_steps=1", "trainer.save_freq=1"]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logged = validation_keys(json.loads(f.readline()))
    assert {"val-core/add/a/reward/mean@4", "val-core/add/b/reward/maj@4/mean", "val-core/all/reward/best@4/mean",
            "val-aux/add/a/reward/worst@2/std", "val-aux/add/b/score/mean@4"} <= set(logged)
    assert logged["val/reward"] == logged["val-core/all/reward/mean@4"]  # one computation, one number (console: val)

    capsys.readouterr()
    assert eval_main(["--config", RECIPE, "--checkpoint", out, *overrides(out, val)]) == 0
    console = capsys.readouterr().out
    with open(os.path.join(out, "eval", "step_1.json")) as f:
        evaluated = json.load(f)
    assert evaluated["step"] == 1 and evaluated["checkpoint"].endswith("global_step_1")
    assert validation_keys(evaluated["metrics"]) == logged  # every number, exactly
    assert "maj@4" in console and "add/a" in console and "all" in console

    # Negative control: the initial weights, seeded as step 1 (rollout.seed + 1 at step 0): other numbers.
    seed = load_config(RECIPE, []).actor_rollout_ref.rollout.seed
    model = warm_start(SFTConfig(cache_dir=CACHE), seed=0, task="toy")
    assert eval_main(["--config", RECIPE, "--model", model, "--out", str(tmp_path / "initial.json"),
                      *overrides(out, val), f"actor_rollout_ref.rollout.seed={seed + 1}"]) == 0
    with open(tmp_path / "initial.json") as f:
        initial = validation_keys(json.load(f)["metrics"])
    assert initial.keys() == logged.keys() and initial != logged


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "/nonexistent/run"], "is not an rlpad checkpoint"),
    (["--model", "/nonexistent/model"], "is not a folder"),
    (["--n", "4"], "validation is greedy"),
    (["--n", "0"], "must be >= 1"),
])
def test_bad_input_is_one_line_before_anything_starts(args, message, capsys):
    assert eval_main(["--config", RECIPE, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.parametrize("name", ["grpo_tiny_lora", "ppo_tiny", "distill_tiny", "grpo_tiny_long"])
def test_validation_alone_builds_no_reference(name):
    config = validation_only(recipe(name), ["actor_rollout_ref.actor.use_kl_loss=true"], model="/m", n=2
                             if name == "grpo_tiny_long" else None)
    assert not config.uses_ref and config.trainer.max_off_policy_steps == 0
    assert config.actor_rollout_ref.model.path == "/m"
    assert config.actor_rollout_ref.rollout.val_kwargs.n == (2 if name == "grpo_tiny_long" else 1)
