"""Workers whose rollout engines never receive the actor's weights: the negative control of the weight-sync tests."""

from __future__ import annotations

from rlpad.training.async_schedule import Done


class NoSync:
    """The workers, except that the engines never receive the actor's weights (synchronous or ahead):
    they serve whatever they started with."""

    def __init__(self, workers):
        self.workers = workers

    def __getattr__(self, name):
        return getattr(self.workers, name)

    def sync_weights(self) -> float:
        return 0.0

    def submit_weight_sync(self, version: int) -> Done[float]:
        return Done(0.0)
