"""The asynchronous schedule's bookkeeping (rlpad.training.async_schedule) and its config rules, without Ray.

The engine here is a FIFO queue that runs a call only when a result is asked for (as a Ray actor
runs one caller's calls in order); tests/test_async.py runs the schedule on the real Ray workers.
"""

from __future__ import annotations

import pytest
import torch

from rlpad.training.async_schedule import VERSION_KEY, Done, RolloutAhead, Sequential, generation_version, in_flight_steps
from rlpad.batch import WORKER_SECONDS, Batch
from rlpad.recipe.load import load_config
from rlpad.topology import colocated


class QueueEngine:
    """One engine: calls queue up in submission order and run lazily; generations stamp the loaded version.
    ``eager_loads``: weight loads jump the queue (the bug the schedule must catch)."""

    def __init__(self, eager_loads: bool = False):
        self.queue: list[tuple[str, object]] = []
        self.version, self.log, self.eager_loads = 0, [], eager_loads

    def _run_until(self, entry) -> None:
        while entry in self.queue:
            kind, arg = self.queue.pop(0)
            if kind == "load":
                self.version = arg
            self.log.append((kind, arg if kind == "load" else arg[0], self.version))

    def submit_generate(self, batch: Batch, seed: int):
        entry = ("gen", (seed, batch))
        self.queue.append(entry)
        engine = self

        class Pending:
            def result(self) -> Batch:
                engine._run_until(entry)
                rows = len(batch) * 2
                return Batch({VERSION_KEY: torch.full((rows,), engine.log[-1][2]), "seed": torch.full((rows,), seed)},
                             meta={WORKER_SECONDS: 1.0})

        return Pending()

    def submit_weight_sync(self, version: int):
        entry = ("load", version)
        if self.eager_loads:
            self.version = version
            self.log.append(("load", version, version))
            return Done(0.0)
        self.queue.append(entry)
        engine = self

        class Pending:
            def result(self) -> float:
                engine._run_until(entry)
                return 0.0

        return Pending()


def prompts():
    return Batch({"input_ids": torch.zeros(3, 2, dtype=torch.long)})


def drive(engine, k: int, steps: int, start: int = 0, ahead: RolloutAhead | None = None):
    """The trainer's loop around the schedule; returns per step the sample versions and metrics."""
    ahead = ahead or RolloutAhead(engine, k, steps, prompts, seed=lambda t: 100 + t)
    out = {}
    for t in range(start + 1, steps + 1):
        ahead.submit_ahead(t)
        batch, metrics = ahead.take(t)
        out[t] = (batch[VERSION_KEY].tolist(), metrics, int(batch["seed"][0]))
        ahead.sync(t)
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_sample_is_generated_with_the_scheduled_version(k):
    engine = QueueEngine()
    runs = drive(engine, k, steps=7)
    for t, (versions, metrics, seed) in runs.items():
        assert versions == [max(0, t - 1 - k)] * 6 == [generation_version(t, k)] * 6
        assert metrics["async/staleness_mean"] == metrics["async/staleness_max"] == min(t - 1, k)
        assert seed == 100 + t  # the step's own sampling seed, whenever it was generated
        assert 0.0 <= metrics["async/overlap"] <= 1.0 and metrics["timing_s/wait_rollout"] >= 0
    # The engine's queue is the schedule: k + 1 generations, then one load before each further generation.
    kinds = [(kind, arg) for kind, arg, _ in engine.log]
    expected = [("gen", 100 + t) for t in range(1, k + 2)]
    for t in range(k + 2, 8):
        expected += [("load", t - 1 - k), ("gen", 100 + t)]
    assert kinds == expected


def test_a_load_that_jumps_the_queue_is_caught():
    with pytest.raises(RuntimeError, match=r"step 2 was generated with policy version\(s\) \[1\], expected 0"):
        drive(QueueEngine(eager_loads=True), k=1, steps=4)


def test_sequential_waits_for_every_call_and_gives_the_same_batches():
    overlapped, sequential = QueueEngine(), QueueEngine()
    a, b = drive(overlapped, 2, steps=6), drive(Sequential(sequential), 2, steps=6)
    assert {t: (v, s) for t, (v, _, s) in a.items()} == {t: (v, s) for t, (v, _, s) in b.items()}
    overlapped._run_until(overlapped.queue[-1])  # the last weight loads are still queued there
    assert overlapped.log == sequential.log  # the same calls, in the same order on the engine
    assert sequential.queue == []  # nothing was left queued: each call ran when submitted


def test_save_and_restore_reproduce_the_run(tmp_path):
    full = drive(QueueEngine(), 2, steps=6)
    engine = QueueEngine()
    ahead = RolloutAhead(engine, 2, 6, prompts, seed=lambda t: 100 + t)
    first = drive(engine, 2, steps=3, ahead=ahead)
    ahead.save(str(tmp_path))  # waits for the batches of steps 4 and 5 (generated with versions 1, 2)
    resumed_engine = QueueEngine()
    resumed = RolloutAhead(resumed_engine, 2, 6, prompts, seed=lambda t: 100 + t)
    resumed.restore(str(tmp_path), 3)
    rest = drive(resumed_engine, 2, steps=6, start=3, ahead=resumed)
    assert resumed_engine.log[0] == ("load", 3, 3)  # the checkpoint's weights first
    assert [e for e in resumed_engine.log if e[0] == "gen"] == [("gen", 106, 3)]  # only step 6 regenerated
    assert {t: (v, s) for t, (v, _, s) in {**first, **rest}.items()} == {t: (v, s) for t, (v, _, s) in full.items()}
    with pytest.raises(ValueError, match="max_off_policy_steps=2; resume with that value"):
        RolloutAhead(QueueEngine(), 1, 6, prompts, seed=lambda t: t).restore(str(tmp_path), 3)


def test_restore_without_batches_restarts_at_the_checkpoint_version(tmp_path):
    engine = QueueEngine()
    ahead = RolloutAhead(engine, 1, 6, prompts, seed=lambda t: t)
    ahead.restore(str(tmp_path), 3)  # a checkpoint of a synchronous run
    runs = drive(engine, 1, steps=6, start=3, ahead=ahead)
    assert {t: v[0] for t, (v, _, _) in runs.items()} == {4: 3, 5: 3, 6: 4}


def versions_and_seeds(runs):
    return {t: (v, s) for t, (v, _, s) in runs.items()}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("s", [4, 3, 2])
def test_resume_with_more_steps_generates_the_next_batch_with_the_checkpoint_version(tmp_path, k, s):
    """A run of 4 steps saved at step s (its end, one before, mid-run), resumed with 8 steps: the
    generations submitted after the restore at step s use version s; the batches the checkpoint holds
    (none, fewer than k or k) are trained as saved."""
    engine = QueueEngine()
    ahead = RolloutAhead(engine, k, 4, prompts, seed=lambda t: 100 + t)
    first = drive(engine, k, steps=s, ahead=ahead)
    ahead.save(str(tmp_path))
    resumed_engine = QueueEngine()
    resumed = RolloutAhead(resumed_engine, k, 8, prompts, seed=lambda t: 100 + t)
    resumed.restore(str(tmp_path), s)
    rest = drive(resumed_engine, k, steps=8, start=s, ahead=resumed)  # before #30: "step 5 must be generated with version 3"
    held = sorted(ahead.in_flight)  # the batches the checkpoint holds: steps s+1 .. min(s+k, 4)
    assert held == list(range(s + 1, min(s + k, 4) + 1))
    for t, (versions, metrics, seed) in rest.items():
        want = generation_version(t, k) if t in held else max(s, t - 1 - k)
        assert versions == [want] * 6 and seed == 100 + t, t
        assert ("async/overlap" in metrics) == (t not in held)  # a restored batch's overlap is not known here
    if s + k <= 4:  # nothing was cut by the total of 4: bitwise the uninterrupted run of 8 steps
        full = drive(QueueEngine(), k, steps=8)
        assert versions_and_seeds({**first, **rest}) == versions_and_seeds(full)
    elif s == 4:  # the end: the same as resuming a checkpoint with nothing in flight (a fresh schedule at version 4)
        fresh_engine = QueueEngine()
        fresh = RolloutAhead(fresh_engine, k, 8, prompts, seed=lambda t: 100 + t, start_version=4)
        fresh_engine.submit_weight_sync(4)
        assert versions_and_seeds(rest) == versions_and_seeds(drive(fresh_engine, k, steps=8, start=4, ahead=fresh))


def test_the_final_checkpoint_resumes_with_any_k_and_a_mid_run_one_only_with_its_own(tmp_path):
    engine = QueueEngine()
    ahead = RolloutAhead(engine, 2, 4, prompts, seed=lambda t: t)
    drive(engine, 2, steps=4, ahead=ahead)
    ahead.save(str(tmp_path))  # nothing in flight at the end of the run
    assert in_flight_steps(str(tmp_path)) == []
    other = QueueEngine()
    resumed = RolloutAhead(other, 1, 6, prompts, seed=lambda t: t)
    resumed.restore(str(tmp_path), 4)
    assert {t: v[0] for t, (v, _, _) in drive(other, 1, steps=6, start=4, ahead=resumed).items()} == {5: 4, 6: 4}
    mid = tmp_path / "mid"
    mid.mkdir()
    engine = QueueEngine()
    ahead = RolloutAhead(engine, 2, 6, prompts, seed=lambda t: t)
    drive(engine, 2, steps=2, ahead=ahead)
    ahead.save(str(mid))
    assert in_flight_steps(str(mid)) == [3, 4]
    with pytest.raises(ValueError, match="max_off_policy_steps=2; resume with that value"):
        RolloutAhead(QueueEngine(), 1, 6, prompts, seed=lambda t: t).restore(str(mid), 2)


class ResumeOnly:
    """Just what the trainer's resume calls (the synchronous loop's weight sync)."""

    def __init__(self):
        self.calls = []

    def load_checkpoint(self, path):
        self.calls.append("load_checkpoint")

    def sync_weights(self):
        self.calls.append("sync_weights")
        return 0.0


class Loader:
    def __len__(self):
        return 4

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("held", [False, True])
def test_a_synchronous_run_resumes_an_asynchronous_checkpoint_only_with_nothing_in_flight(tmp_path, held):
    from rlpad.training.checkpoint import CheckpointDir
    from rlpad.training.trainer import Trainer

    engine = QueueEngine()
    ahead = RolloutAhead(engine, 1, 4, prompts, seed=lambda t: t)
    step = 3 if held else 4
    drive(engine, 1, steps=step, ahead=ahead)
    checkpoints = CheckpointDir(str(tmp_path / "run"))
    ahead.save(checkpoints.staging(step))
    path = checkpoints.publish(step, {"step": step, "loader": {}, "history": [], "max_off_policy_steps": 1})
    config = load_config(None, ["actor_rollout_ref.rollout.n=2", "trainer.total_training_steps=8",
                                f"trainer.resume_mode={path}", f"trainer.default_local_dir={tmp_path / 'run'}"])
    trainer = Trainer(config, ResumeOnly(), None, Loader(), None)
    if held:
        with pytest.raises(ValueError, match=r"holds the batches of steps \[4\].*max_off_policy_steps=1"):
            trainer._maybe_resume()
    else:  # today: refused although nothing is in flight
        trainer._maybe_resume()
        assert trainer.step == 4 and trainer.workers.calls == ["load_checkpoint", "sync_weights"]


def cfg(*overrides):
    base = ["actor_rollout_ref.rollout.n=2", "trainer.max_off_policy_steps=1",
            "algorithm.rollout_correction.mode=token_tis"]
    return load_config(None, [*base, *overrides])


@pytest.mark.parametrize("overrides, wanted", [
    (["trainer.max_off_policy_steps=-1"], "max_off_policy_steps=-1 must be >= 0"),
    (["algorithm.rollout_correction.mode=none"], "set algorithm.rollout_correction.mode to token_tis or seq_mask"),
    (["trainer.colocate=true"], "trainer.colocate=true time-shares"),
    (["trainer.backend=local"], "trainer.backend=local runs both in one process"),
])
def test_config_errors(overrides, wanted):
    with pytest.raises(ValueError, match=wanted):
        cfg(*overrides)


def test_valid_async_config_and_separate_default_layout():
    config = cfg("trainer.device=cuda")
    assert config.trainer.max_off_policy_steps == 1
    assert not colocated(config, cuda=True)  # the colocated default gives way to asynchronous training
    sync = load_config(None, ["actor_rollout_ref.rollout.n=2", "trainer.device=cuda"])
    assert sync.trainer.max_off_policy_steps == 0 and colocated(sync, cuda=True)
    cfg("algorithm.rollout_correction.mode=seq_mask")  # both corrections are accepted


def test_trainer_refuses_workers_that_cannot_submit_ahead():
    from rlpad.training.trainer import Trainer

    class Loader:
        def __len__(self):
            return 1

    with pytest.raises(ValueError, match="needs workers that submit generations ahead.*object does not"):
        Trainer(cfg("trainer.total_training_steps=2"), object(), None, Loader(), None)


def test_weights_no_engine_will_use_are_not_loaded():
    engine = QueueEngine()
    ahead = RolloutAhead(engine, 1, 2, prompts, seed=lambda t: t)
    drive(engine, 1, steps=1, ahead=ahead)
    ahead.submit_ahead(2)
    ahead.take(2)
    ahead.sync(2, load=False)  # the run's last step, no validation after it
    assert ahead.version == 2 and ("load", 2) not in engine.queue + [(kind, arg) for kind, arg, _ in engine.log]
