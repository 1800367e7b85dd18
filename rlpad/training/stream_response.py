"""Streaming rollouts: one response as an engine streams it, each token with its policy version.

A :class:`Response` grows delta by delta; each token keeps the policy version that sampled it and
its behaviour log-prob under that version (rlpad/training/stream_staleness.py defines versions). A
partial rollout continues the same Response after a weight load (later tokens carry the new
version); ``partial_rollout=false`` restarts it (:meth:`Response.restart`, counted). Checkpointable
(:meth:`Response.state`). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Response"]


@dataclass
class Response:
    """One sample of prompt ``uid`` (index ``index`` in its group): tokens, their versions and behaviour log-probs."""

    uid: str
    index: int
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    done: bool = False
    restarts: int = 0  # times aborted and regenerated from the prompt (partial_rollout=false)
    score: float | None = None  # the reward, set when the group finishes

    def extend(self, tokens: Sequence[int], log_probs: Sequence[float], version: int) -> None:
        """Tokens sampled by policy ``version`` (a stream's delta); versions never go back."""
        if self.done:
            raise ValueError(f"response {self.uid}/{self.index} is done; nothing may be appended")
        if len(tokens) != len(log_probs):
            raise ValueError(f"{len(tokens)} tokens but {len(log_probs)} log-probs")
        if self.versions and version < self.versions[-1]:
            raise ValueError(f"response {self.uid}/{self.index}: version {version} after {self.versions[-1]}")
        self.tokens += [int(t) for t in tokens]
        self.log_probs += [float(x) for x in log_probs]
        self.versions += [int(version)] * len(tokens)

    def restart(self) -> None:
        """Aborted to be regenerated from the prompt: its tokens are gone, the restart counted."""
        self.tokens, self.versions, self.log_probs = [], [], []
        self.done = False
        self.restarts += 1

    @property
    def oldest_version(self) -> int:
        if not self.versions:
            raise ValueError(f"response {self.uid}/{self.index} has no token")
        return self.versions[0]

    @property
    def crossed_load(self) -> bool:
        """Sampled by more than one policy version (continued across a weight load)."""
        return bool(self.versions) and self.versions[0] != self.versions[-1]

    def state(self) -> dict[str, Any]:
        """Plain values for a checkpoint; :meth:`from_state` restores it."""
        return {k: getattr(self, k) for k in ("uid", "index", "tokens", "versions", "log_probs", "done", "restarts",
                                              "score")}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Response:
        return cls(**{k: list(v) if isinstance(v, list) else v for k, v in state.items()})  # its own lists
