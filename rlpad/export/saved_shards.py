"""A worker's sharded checkpoint (torch.distributed.checkpoint, :mod:`workers.fsdp_checkpoint`) read in one
process: no process group, no GPU, no Ray, whatever world size wrote it.

The checkpoint's ``.metadata`` lists every tensor with its global shape and dtype; a load asks for some of
them by name and DCP reads, from each rank's ``__<rank>_0.distcp``, the byte ranges of their shards and
assembles them. :meth:`SavedShards.iter_loaded` loads the tensors a few at a time (up to ``group_bytes``),
so reading a model never holds more than one group.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["GROUP_BYTES", "SavedShards"]

GROUP_BYTES = 256 * 2**20  # tensors loaded per DCP call (one larger tensor is a group of its own)
MODEL = "model"  # the checkpoint's model part ({"model": ..., "optim": ...})


class SavedShards:
    """The model tensors of one role folder of a checkpoint (``.../global_step_<k>/actor``)."""

    def __init__(self, path: str):
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise ValueError(f"{path!r} is not a sharded checkpoint folder (no .metadata)")
        self.path = path
        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as e:  # a truncated or foreign .metadata: one line, not the unpickler's traceback
            raise ValueError(f"{path!r}: its .metadata cannot be read ({type(e).__name__}: {e})") from e
        planner = metadata.planner_data or {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for flat, entry in metadata.state_dict_metadata.items():
            path = planner.get(flat)
            top, fqn = path if path is not None and len(path) == 2 else flat.partition(".")[::2]
            if top == MODEL and isinstance(entry, TensorStorageMetadata):
                self.meta[fqn] = (tuple(entry.size), entry.properties.dtype)

    def keys(self) -> list[str]:
        """The model's state-dict keys, in the checkpoint's order."""
        return list(self.meta)

    def nbytes(self, key: str) -> int:
        shape, dtype = self.meta[key]
        return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()

    def load(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """The full tensors of ``keys`` (on the CPU, in their saved dtype)."""
        missing = [k for k in keys if k not in self.meta]
        if missing:
            raise KeyError(f"{self.path}: no tensor {missing[0]!r} in this checkpoint")
        out = {k: torch.empty(self.meta[k][0], dtype=self.meta[k][1]) for k in dict.fromkeys(keys)}
        if out:
            with warnings.catch_warnings():  # DCP warns that no process group exists: none is meant to
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({MODEL: out}, storage_reader=FileSystemReader(self.path), no_dist=True)
        return out

    def stream(self, pairs: Sequence[tuple[str, str]], group_bytes: int = GROUP_BYTES
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for each ``(name, key)`` of ``pairs``, in order, loading consecutive keys together
        up to ``group_bytes`` (a larger tensor alone): at most one group is held at a time."""
        group: list[tuple[str, str]] = []
        size = 0
        for name, key in [*pairs, (None, None)]:
            nbytes = self.nbytes(key) if key is not None else 0
            if group and (key is None or size + nbytes > group_bytes):
                loaded = self.load([k for _, k in group])
                for n, k in group:
                    yield n, loaded[k]
                del loaded
                group, size = [], 0
            if key is not None:
                group.append((name, key))
                size += nbytes
