"""The timing of a training step's stages, kept in one place.

Every stage of :meth:`rlpad.training.trainer.Trainer.train_step` runs inside :meth:`StageClock.stage`
(or :meth:`StageClock.call`, which also takes the seconds a worker measured for itself out of its
result). The step's metrics then carry, per stage name:

- ``timing_s/<stage>``: the driver's wall time of the stage (summed when it runs more than once, e.g.
  one generation per dynamic-sampling batch);
- ``worker_s/<stage>``: the seconds the workers measured inside themselves (``WORKER_SECONDS``), when
  they report them;
- ``timing_s/step_wall`` and ``timing_s/overhead`` (the wall time minus the workers' seconds: what the
  trainer itself costs: reward, advantages, moving batches, splitting and merging).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rlpad.batch import WORKER_SECONDS, Batch

__all__ = ["StageClock", "pop_worker_seconds"]


def pop_worker_seconds(result: Batch | dict[str, Any], worker_s: dict[str, float], name: str) -> None:
    """Move the seconds a worker measured for itself (``WORKER_SECONDS``) out of a result into ``worker_s``."""
    store = result.meta if isinstance(result, Batch) else result
    seconds = store.pop(WORKER_SECONDS, None) if isinstance(store, dict) else None
    if seconds is not None:
        worker_s[name] = worker_s.get(name, 0.0) + float(seconds)


class StageClock:
    """Wall seconds per stage (``wall``) and worker-measured seconds per stage (``worker``) of one step."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.wall: dict[str, float] = {}
        self.worker: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name`` (added to an earlier run of the same stage)."""
        start = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.wall[name] = self.wall.get(name, 0.0) + seconds

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` timed as stage ``name``; the worker's own seconds taken out of its result."""
        with self.stage(name):
            result = fn(*args, **kwargs)
        pop_worker_seconds(result, self.worker, name)
        return result

    def metrics(self) -> dict[str, float]:
        """``timing_s/step_wall``, ``worker_s/<stage>`` and ``timing_s/overhead`` (the latter when workers reported)."""
        wall = time.perf_counter() - self.start
        out = {"timing_s/step_wall": wall, **{f"worker_s/{k}": v for k, v in self.worker.items()}}
        if self.worker:
            out["timing_s/overhead"] = wall - sum(self.worker.values())
        return out
