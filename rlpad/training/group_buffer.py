"""Streaming rollouts: the buffer of finished groups.

A prompt's group (its n :class:`~rlpad.training.stream_response.Response`) enters the :class:`GroupBuffer`
when all n responses are done, through the optional group filter (DAPO's, applied as groups enter);
a step takes ``k`` groups, first in first out, once the buffer holds k that are within the hard cap,
dropping (and counting) those past it on the way. :func:`group_batch_fields` gives the per-token
version tensor and the per-row oldest version a batch carries.

Pure Python + torch tensors for the batch fields.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlpad.training.async_schedule import VERSION_KEY
from rlpad.training.stream_response import Response
from rlpad.training.stream_staleness import StalenessRule

__all__ = ["Group", "GroupBuffer", "TOKEN_VERSION_KEY", "group_batch_fields", "spread_filter"]

TOKEN_VERSION_KEY = "token_policy_version"  # (B*n, R) per response token: the version that sampled it; -1 on padding


@dataclass
class Group:
    """A prompt's n finished responses, in sample order; ``prompt`` is whatever the loop keeps of the prompt row."""

    uid: str
    responses: list[Response]
    prompt: Any = None

    @property
    def oldest_version(self) -> int:
        return min(r.oldest_version for r in self.responses)


def spread_filter(metric: Callable[[Response], float]) -> Callable[[Group], bool]:
    """DAPO's group filter: keep a group whose responses differ in ``metric`` (a group of one is kept, as verl does)."""
    def keep(group: Group) -> bool:
        values = [metric(r) for r in group.responses]
        return len(values) == 1 or max(values) > min(values)
    return keep


class GroupBuffer:
    """Finished groups waiting for the trainer (see the module docstring); counters for the step metrics."""

    def __init__(self, n: int, keep: Callable[[Group], bool] | None = None):
        if n < 1:
            raise ValueError(f"group size n must be >= 1, got {n}")
        self.n, self.keep = n, keep
        self.pending: dict[str, dict[int, Response]] = {}
        self.ready: deque[Group] = deque()
        self.filtered_groups = 0
        self.dropped_groups = 0
        self.dropped_samples = 0

    def add(self, response: Response, prompt: Any = None) -> Group | None:
        """A finished response; returns its group when this completes it (and the filter kept it), else None."""
        group = self.complete(response, prompt)
        return group if group is not None and self.admit(group) else None

    def complete(self, response: Response, prompt: Any = None) -> Group | None:
        """A finished response; returns its group when this completes it, not yet through the filter nor ready
        (the caller scores it, then :meth:`admit`); else None."""
        if not response.done:
            raise ValueError(f"response {response.uid}/{response.index} is not done")
        if not 0 <= response.index < self.n:
            raise ValueError(f"response index {response.index} outside the group of {self.n}")
        members = self.pending.setdefault(response.uid, {})
        if response.index in members:
            raise ValueError(f"response {response.uid}/{response.index} was added twice")
        members[response.index] = response
        if len(members) < self.n:
            return None
        del self.pending[response.uid]
        return Group(response.uid, [members[j] for j in range(self.n)], prompt)

    def admit(self, group: Group) -> bool:
        """A completed group through the filter: ready for the trainer (True) or filtered out (counted, False)."""
        if self.keep is not None and not self.keep(group):
            self.filtered_groups += 1
            return False
        self.ready.append(group)
        return True

    def __len__(self) -> int:
        """Buffer depth: groups ready for the trainer."""
        return len(self.ready)

    def take(self, k: int, updates_applied: int, rule: StalenessRule) -> list[Group] | None:
        """The first ``k`` ready groups within the hard cap for an update with ``updates_applied`` updates applied;
        groups past it met on the way are dropped and counted. None (nothing taken) while fewer than k are fresh."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        for group in list(self.ready):
            if rule.too_stale(group.oldest_version, updates_applied):
                self.ready.remove(group)
                self.dropped_groups += 1
                self.dropped_samples += len(group.responses)
        if len(self.ready) < k:
            return None
        return [self.ready.popleft() for _ in range(k)]


def group_batch_fields(groups: Sequence[Group], response_length: int) -> dict[str, torch.Tensor]:
    """The batch fields of streamed groups, rows in group order then sample order (as the rollout layout):
    ``token_policy_version`` (B*n, R) long, -1 past each response's end, and ``policy_version`` (VERSION_KEY, (B*n,)) the
    oldest token's version of each row."""
    rows = [r for g in groups for r in g.responses]
    versions = torch.full((len(rows), response_length), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        kept = r.versions[:response_length]
        versions[i, : len(kept)] = torch.tensor(kept, dtype=torch.long)
    return {TOKEN_VERSION_KEY: versions,
            VERSION_KEY: torch.tensor([r.oldest_version for r in rows], dtype=torch.long)}
