"""Asynchronous training: the rollout generates the batches of the next k steps while the actor trains.

With ``trainer.max_off_policy_steps = k >= 1`` the batch of step t is generated with policy version
``v(t) = max(v0, t - 1 - k)`` (version = updates applied; v0 = the version the run started or
resumed from without batches in flight, 0 for a fresh run), so when step t updates (t - 1 updates
applied) every sample of its batch is ``min(t - 1 - v0, k)`` versions old::

    k=1    engine:  gen(1)v0 gen(2)v0 | load v1 | gen(3)v1 | load v2 | gen(4)v2 ...
           actor:            train(1)  sync(1)   train(2)   sync(2)    train(3) ...

The schedule is one rule: at the start of step t the driver submits the generation of step t + k
(non-blocking) and then waits only for batch t; after update t it submits the weight loads of
version t. The workers run the calls each engine gets in the order the driver submitted them
(Ray runs one caller's tasks on an actor in submission order), so the engine's queue IS the
schedule: a load lands after the generations already queued and before those submitted later,
never inside one, and nothing needs a lock. Every engine stamps its output with the version it
generated with (``policy_version``, per row); the schedule checks the stamps against its own
bookkeeping.

This module knows nothing of Ray: the workers implement :class:`AsyncWorkers` (workers/launcher.py).
:class:`Sequential` runs the same schedule one call after another (each submitted call waited for
before the next): overlapping changes time, never numbers (tests/test_async.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from rlpad.batch import WORKER_SECONDS, Batch

__all__ = ["AsyncWorkers", "Done", "Future", "INFLIGHT_FILE", "RolloutAhead", "Sequential", "VERSION_KEY",
           "generation_version"]

T = TypeVar("T", covariant=True)
VERSION_KEY = "policy_version"  # per row: the policy version (updates applied) the engine generated it with
INFLIGHT_FILE = "rollout_in_flight.pt"  # in a checkpoint: the batches generated for later steps


class Future(Protocol[T]):
    """A submitted call; :meth:`result` blocks until it is done and raises its error."""

    def result(self) -> T: ...


class Done(Generic[T]):
    """A future that is already done (a restored batch, a waited-for call)."""

    def __init__(self, value: T):
        self.value = value

    def result(self) -> T:
        return self.value


class AsyncWorkers(Protocol):
    """What the asynchronous schedule needs from the workers on top of :class:`rlpad.trainer.Workers`.

    Both calls return at once. Calls reach each rollout engine in the order they were submitted.
    """

    def submit_generate(self, batch: Batch, seed: int) -> Future[Batch]:
        """Generate like ``Workers.generate``; the result's rows carry ``policy_version``."""

    def submit_weight_sync(self, version: int) -> Future[float]:
        """The actor's current weights into every engine as ``version``, after the calls already submitted
        (the actor's part is done when this returns; the result waits for the engines' loads)."""


def generation_version(step: int, k: int, start_version: int = 0) -> int:
    """The policy version step ``step``'s batch is generated with: ``max(start_version, step - 1 - k)``."""
    return max(start_version, step - 1 - k)


@dataclass
class InFlight:
    """A generation submitted for ``step`` with weights of ``version``."""

    step: int
    version: int
    future: Future[Batch]


class RolloutAhead:
    """The asynchronous schedule: keeps the generations of the next ``k`` steps in flight.

    ``next_prompts()`` gives the prompts of the next step to submit (the data loader), ``seed(step)``
    the sampling seed of a step. Call :meth:`submit_ahead` at the start of step t, :meth:`take` to
    get batch t (with its metrics), :meth:`sync` after update t.
    """

    def __init__(self, workers: AsyncWorkers, k: int, total_steps: int, next_prompts: Callable[[], Batch],
                 seed: Callable[[int], int], start_version: int = 0):
        if k < 1:
            raise ValueError(f"trainer.max_off_policy_steps={k}: the asynchronous schedule needs k >= 1")
        self.workers, self.k, self.total_steps = workers, k, total_steps
        self.next_prompts, self.seed = next_prompts, seed
        self.start_version = start_version
        self.version = start_version  # the newest version submitted to the engines
        self.in_flight: dict[int, InFlight] = {}
        self.submitted = 0  # the last step whose generation was submitted

    def submit_ahead(self, step: int) -> None:
        """Submit the generations of steps up to ``step + k`` (and at most ``total_steps``)."""
        while self.submitted < min(step + self.k, self.total_steps):
            t = self.submitted + 1
            expected = generation_version(t, self.k, self.start_version)
            if expected != self.version:  # the rule and the order of the calls must agree
                raise RuntimeError(f"async schedule: step {t} must be generated with version {expected}, but the "
                                   f"engines are at version {self.version}")
            future = self.workers.submit_generate(self.next_prompts(), seed=self.seed(t))
            self.in_flight[t] = InFlight(t, self.version, future)
            self.submitted = t

    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Batch ``step`` (waiting for it), its stamps checked, and the step's async metrics:
        ``async/staleness_mean|max`` (updates applied minus each sample's version),
        ``timing_s/wait_rollout`` (seconds blocked here), ``async/overlap`` (share of the engines'
        generation seconds that ran while the trainer did something else), ``async/gen_s``."""
        item = self.in_flight.pop(step, None)
        if item is None:
            raise RuntimeError(f"async schedule: no generation in flight for step {step}")
        start = time.perf_counter()
        batch = item.future.result()
        wait = time.perf_counter() - start
        versions = _check_versions(batch, item.version, f"step {step}")
        staleness = (step - 1 - versions).double()
        gen = float(batch.meta.pop(WORKER_SECONDS, 0.0))  # the engines' own seconds (slowest replica)
        metrics = {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
                   "timing_s/wait_rollout": wait, "async/gen_s": gen,
                   "async/overlap": min(1.0, max(0.0, 1.0 - wait / gen)) if gen > 0 else 0.0}
        return batch, metrics

    def check_latest(self, batch: Batch, what: str) -> None:
        """``what`` (a validation rollout) was generated with the newest weights submitted."""
        _check_versions(batch, self.version, f"the {what}")

    def sync(self, version: int) -> None:
        """After update ``version``: the new weights go to the engines behind the queued generations."""
        if version != self.version + 1:
            raise RuntimeError(f"async schedule: weight sync of version {version} after version {self.version}")
        self.workers.submit_weight_sync(version)
        self.version = version

    # ---- checkpoints --------------------------------------------------------------------------------

    def save(self, folder: str) -> None:
        """Wait for every generation in flight and write the batches into checkpoint ``folder`` (the one
        place the driver waits for generations ahead of the step it trains)."""
        items = []
        for step in sorted(self.in_flight):
            item = self.in_flight[step]
            batch = item.future.result()
            item.future = Done(batch)  # the run goes on with it
            items.append({"step": step, "version": item.version, "batch": batch})
        state = {"k": self.k, "version": self.version, "submitted": self.submitted, "in_flight": items}
        torch.save(state, os.path.join(folder, INFLIGHT_FILE))

    def restore(self, folder: str, step: int) -> None:
        """Resume after ``step`` from checkpoint ``folder`` (whose weights the actor has loaded): the
        engines load them as version ``step``, the batches the checkpoint holds come back as done futures.

        A checkpoint without them (saved synchronously) restarts the schedule at version ``step``.
        """
        path = os.path.join(folder, INFLIGHT_FILE)
        self.workers.submit_weight_sync(step)
        self.in_flight, self.version, self.submitted = {}, step, step
        if not os.path.isfile(path):
            self.start_version = step
            return
        state = torch.load(path, weights_only=False)
        if state["k"] != self.k:
            raise ValueError(f"checkpoint {folder} holds the batches of trainer.max_off_policy_steps={state['k']}; "
                             f"resume with that value (this run has {self.k})")
        if state["version"] != step:
            raise ValueError(f"checkpoint {folder}: in-flight state of version {state['version']} at step {step}")
        for item in state["in_flight"]:
            self.in_flight[item["step"]] = InFlight(item["step"], item["version"], Done(item["batch"]))
        self.submitted = state["submitted"]


class Sequential:
    """The workers with every submitted call waited for before the next: the asynchronous schedule run one
    call after another (the same generations and weight loads in the same order, nothing overlapped)."""

    def __init__(self, workers: Any):
        self._workers = workers

    def submit_generate(self, batch: Batch, seed: int) -> Done[Batch]:
        return Done(self._workers.submit_generate(batch, seed=seed).result())

    def submit_weight_sync(self, version: int) -> Done[float]:
        return Done(self._workers.submit_weight_sync(version).result())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workers, name)


def _check_versions(batch: Batch, expected: int, what: str) -> torch.Tensor:
    """The per-row ``policy_version`` stamps of ``batch``; RuntimeError unless all equal ``expected``."""
    versions = batch[VERSION_KEY] if VERSION_KEY in batch else None
    if not isinstance(versions, torch.Tensor) or not bool((versions == expected).all()):
        found = sorted({int(v) for v in versions.tolist()}) if versions is not None else "none"
        raise RuntimeError(f"async schedule: {what} was generated with policy version(s) {found}, expected {expected}: "
                           "a weight load and a generation ran out of order")
    return versions
