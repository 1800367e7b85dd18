"""``Batch``: the rows that travel between the trainer and the workers.

A dict of tensors that share their first dimension, a dict of per-row non-tensor fields
(numpy object arrays: ``uid``, ``ground_truth``, ...) and a dict of batch-level ``meta``
(``temperature``, timing, ...). Picklable, so it crosses Ray as is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

__all__ = ["WORKER_SECONDS", "Batch", "worker_seconds"]

# Seconds a worker spent inside one call, measured in the worker: in ``meta`` of a returned Batch
# or as a key of a returned metrics dict. A worker group reports the slowest rank's.
WORKER_SECONDS = "worker_s"


def _as_object_array(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    arr = np.empty(len(values), dtype=object)
    arr[:] = list(values)
    return arr


@dataclass
class Batch:
    """Rows of tensors and non-tensor fields with one shared length; see the module docstring."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {k: _as_object_array(v) for k, v in self.non_tensors.items()}
        lengths = {k: int(v.shape[0]) for k, v in self.tensors.items()}
        lengths.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(lengths.values())) > 1:
            raise ValueError(f"mismatched row counts in batch: {lengths}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"batch has no key {key!r}; it has {sorted(self.keys())}")

    def __setitem__(self, key: str, value: torch.Tensor | np.ndarray | Sequence) -> None:
        n = len(self)
        rows = int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)
        if (self.tensors or self.non_tensors) and rows != n:
            raise ValueError(f"mismatched row counts: {key!r} has {rows} rows, the batch has {n}")
        if isinstance(value, torch.Tensor):
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.non_tensors[key] = _as_object_array(value)

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def require(self, *keys: str, who: str = "batch") -> None:
        """Raise ValueError naming the keys that ``who`` needs and the batch lacks."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise ValueError(f"{who}: batch is missing required key(s) {missing}; it has {sorted(self.keys())}")

    def _like(self, tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray]) -> Batch:
        """A batch of the same class (a subclass keeps its own fields) holding these rows, meta copied."""
        return replace(self, tensors=tensors, non_tensors=non_tensors, meta=dict(self.meta))

    def select(self, *keys: str) -> Batch:
        """A batch with only ``keys`` (tensors and non-tensors), meta kept."""
        self.require(*keys)
        return self._like({k: v for k, v in self.tensors.items() if k in keys},
                          {k: v for k, v in self.non_tensors.items() if k in keys})

    def index(self, idx: torch.Tensor | np.ndarray | Sequence[int] | slice) -> Batch:
        """Rows ``idx`` (a slice, or integer indices in any order)."""
        if isinstance(idx, slice):
            return self._like({k: v[idx] for k, v in self.tensors.items()},
                              {k: v[idx] for k, v in self.non_tensors.items()})
        idx_np = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1)
        idx_t = torch.as_tensor(idx_np)
        return self._like({k: v.index_select(0, idx_t.to(v.device)) for k, v in self.tensors.items()},
                          {k: v[idx_np] for k, v in self.non_tensors.items()})

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` rows (the last may be shorter)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, parts: int) -> list[Batch]:
        """``parts`` consecutive chunks of equal size; the batch size must divide evenly."""
        if parts < 1 or len(self) % parts:
            raise ValueError(f"cannot chunk a batch of {len(self)} rows into {parts} equal parts")
        return self.split(len(self) // parts)

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each row ``times`` times: ``a a b b`` (interleave) or ``a b a b``."""
        order = np.repeat(np.arange(len(self)), times) if interleave else np.tile(np.arange(len(self)), times)
        return self.index(order)

    def update(self, other: Batch) -> Batch:
        """Add ``other``'s keys and meta to this batch (same rows) and return it."""
        if len(other) and len(self) and len(other) != len(self):
            raise ValueError(f"mismatched row counts: {len(self)} vs {len(other)}")
        for k in other.keys():
            self[k] = other[k]
        self.meta.update(other.meta)
        return self

    def to(self, device: torch.device | str) -> Batch:
        return self._like({k: v.to(device) for k, v in self.tensors.items()}, dict(self.non_tensors))

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of ``batches`` one after another; keys must agree, meta of the first is kept."""
        batches = list(batches)
        if not batches:
            raise ValueError("cannot concatenate an empty list of batches")
        keys = set(batches[0].keys())
        for i, b in enumerate(batches[1:], 1):
            if set(b.keys()) != keys:
                raise ValueError(f"batch {i} has keys {sorted(b.keys())}, batch 0 has {sorted(keys)}")
        first = batches[0]
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            dict(first.meta),
        )


def worker_seconds(result: Batch | dict[str, Any], seconds: float) -> Batch | dict[str, Any]:
    """Attach ``seconds`` (the worker's own time for the call) to a Batch's meta or a metrics dict."""
    if isinstance(result, Batch):
        result.meta[WORKER_SECONDS] = seconds
    elif isinstance(result, dict):
        result[WORKER_SECONDS] = seconds
    return result
