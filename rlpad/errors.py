"""The error a worker failure raises: a worker process died, or a rollout replica's weight load failed.

The workers raise :class:`WorkerFailed` (a RuntimeError) naming the worker; the trainer adds where the
run stopped and the checkpoint to resume from, and lets every other error through as it is (a schedule
mismatch is a bug, not a worker to restart). Raised inside a Ray actor it reaches the driver as an
instance of it (Ray's task error subclasses the cause's class).
"""

from __future__ import annotations

__all__ = ["WorkerFailed"]


class WorkerFailed(RuntimeError):
    """A worker died or is unreachable, or a rollout replica holds weights it failed to load."""
