"""Weight-sync buckets: which full tensors travel together from the actor to the rollout engines.

vLLM reloads weights layer by layer and fuses checkpoint tensors (``q_proj``/``k_proj``/``v_proj``
into one ``qkv_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``); a reload call that gives
only part of a fused layer leaves the rest uninitialised. So a bucket holds whole *units*: one
unit per decoder block (every name up to its first numeric path component, ``model.layers.3``),
plus one unit for everything outside the blocks (embeddings, final norm, LM head: a tied head
then always travels with its embedding). Units are packed in order up to the bucket size; a unit
larger than the bucket is a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["plan_buckets", "weight_unit"]

REST = ""  # the unit of the tensors outside the numbered blocks


def weight_unit(name: str) -> str:
    """The unit of a checkpoint name: the prefix up to its first numeric component, else ``""``."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return REST


def plan_buckets(entries: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Names grouped into buckets of at most ``bucket_bytes`` (whole units; see the module docstring).

    ``entries``: ``(name, nbytes)`` in the model's order. The non-block unit comes first, then the
    blocks in order of first appearance. Every name lands in exactly one bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    names = [name for name, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError("plan_buckets: duplicate tensor names")
    units: dict[str, list[tuple[str, int]]] = {REST: []}
    for name, nbytes in entries:
        if nbytes < 0:
            raise ValueError(f"plan_buckets: {name} has a negative size {nbytes}")
        units.setdefault(weight_unit(name), []).append((name, nbytes))
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    for unit in units.values():
        if not unit:
            continue
        unit_bytes = sum(n for _, n in unit)
        if current and size + unit_bytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current += [name for name, _ in unit]
        size += unit_bytes
    if current:
        buckets.append(current)
    return buckets
