"""safetensors files written one tensor at a time: the header first (every name, dtype and shape is known
from the shards' metadata), then each tensor's bytes as it arrives, so a writer holds one tensor, never
the model.

The format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {"format": "pt"}}`` padded with
spaces to a multiple of 8, then the tensors' bytes back to back, each at its offsets. A model larger than
``max_shard_bytes`` is split the way ``save_pretrained`` splits it: ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json`` (``weight_map``, ``metadata.total_size``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["DTYPE_CODES", "MAX_SHARD_BYTES", "TensorSpec", "shard_plan", "write_safetensors"]

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
MAX_SHARD_BYTES = 5 * 2**30  # one file up to 5 GiB (transformers 4's save_pretrained default)
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its name, shape and the dtype it is written in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def shard_plan(specs: list[TensorSpec], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[tuple[str, list[TensorSpec]]]:
    """``(file name, its tensors)`` in ``specs``' order: consecutive tensors fill a file up to ``max_shard_bytes``
    (a larger tensor gets a file of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return list(zip(names, shards))


def _header(specs: list[TensorSpec]) -> bytes:
    entries, offset = {}, 0
    for s in specs:
        if s.dtype not in DTYPE_CODES:
            raise ValueError(f"{s.name}: dtype {s.dtype} has no safetensors code")
        entries[s.name] = {"dtype": DTYPE_CODES[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)


def write_safetensors(folder: str, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]], *,
                      max_shard_bytes: int = MAX_SHARD_BYTES,
                      on_tensor: Callable[[TensorSpec], None] | None = None) -> int:
    """Write ``tensors`` (``(name, tensor)`` in ``specs``' order, any device, cast to each spec's dtype) into
    ``folder`` as one safetensors file or shards plus an index; returns the bytes written. ``on_tensor`` is
    called after each tensor (a progress display). ValueError when a tensor is not the one its spec names.
    Holds one tensor (its CPU copy) at a time."""
    plan = shard_plan(specs, max_shard_bytes)
    stream = iter(tensors)
    written = 0
    for file_name, shard in plan:
        with open(os.path.join(folder, file_name), "wb") as f:
            header = _header(shard)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            written += 8 + len(header)
            for spec in shard:
                name, tensor = next(stream, (None, None))
                if name != spec.name or tensor is None or tuple(tensor.shape) != spec.shape:
                    got = "nothing" if tensor is None else f"{name!r} {tuple(tensor.shape)}"
                    raise ValueError(f"safetensors stream: expected {spec.name!r} {spec.shape}, got {got}")
                data = tensor.detach().to("cpu", spec.dtype).contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                written += spec.nbytes
                del data, tensor
                if on_tensor is not None:
                    on_tensor(spec)
    if next(stream, None) is not None:
        raise ValueError("safetensors stream: more tensors than specs")
    if len(plan) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: file_name for file_name, shard in plan for s in shard}}
        data = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
        with open(os.path.join(folder, INDEX), "wb") as f:
            f.write(data)
        written += len(data)
    return written
