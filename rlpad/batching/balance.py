"""Sequence-length balancing: split rows across data-parallel ranks and into micro-batches.

Everything here works on a list of per-row lengths (valid tokens, e.g.
``attention_mask.sum(-1)``) and returns index lists into it; nothing touches tensors except
``restore_order``. Pure Python, no Ray.

* ``balance_across_ranks``: EQUAL row counts per rank (differing by at most one when the batch
  does not divide), with the compute work balanced by Karmarkar-Karp. Equal rows keep every
  rank's share of the batch-size arithmetic identical and guarantee each rank can form as many
  micro-batches as any other.
* ``split_by_token_budget``: micro-batches of at most ``max_token_len`` tokens each, work
  balanced by Karmarkar-Karp, as few as the search finds (at least ``min_num_micro_batches``).
* Every rank must run the SAME number of micro-batches, or the collectives of the extra
  backward passes deadlock: each rank computes ``count_micro_batches`` locally, all-reduces
  the MAX, and passes it as ``min_num_micro_batches`` (rlpad/batching/micro_batches.py).
* ``restore_order`` puts outputs computed partition by partition back in the original order.
* Shared prompts (``model.share_prompts``): ``shared_units`` cuts the groups of rows sharing a
  prompt into units a split keeps whole; a unit costs ``P + sum(R_i)`` tokens (the prompt once).
  ``pack_units_by_rows`` fills row-count micro-batches with whole units;
  ``balance_units_across_ranks`` gives each rank whole units when that keeps row counts equal.

Work model: a transformer layer costs about ``24 h^2 s`` FLOPs in its matmuls and ``2 h s^2``
in causal attention for a sequence of ``s`` tokens and hidden size ``h``, so work is
proportional to ``12 h * s + s^2``. We take ``h = 2048`` (1-3B models): ``24576 * s + s^2``.
The constants only change which rows go together, never correctness.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "LINEAR_COEF",
    "QUAD_COEF",
    "balance_across_ranks",
    "balance_units_across_ranks",
    "count_micro_batches",
    "karmarkar_karp",
    "pack_units_by_rows",
    "restore_order",
    "reverse_index",
    "sequence_work",
    "shared_units",
    "split_by_token_budget",
]

LINEAR_COEF = 24576.0  # 12 * hidden size 2048
QUAD_COEF = 1.0


def _as_lengths(lengths: Sequence[int] | np.ndarray | torch.Tensor, name: str = "lengths") -> list[int]:
    if isinstance(lengths, (torch.Tensor, np.ndarray)):
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}")
    out = []
    for i, x in enumerate(lengths):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name}[{i}] must be an int, got {type(x).__name__}")
        if x < 0:
            raise ValueError(f"{name}[{i}] is negative: {x}")
        out.append(int(x))
    return out


def sequence_work(
    lengths: Sequence[int], linear_coef: float = LINEAR_COEF, quad_coef: float = QUAD_COEF
) -> list[float]:
    """Estimated compute per row: ``linear_coef * len + quad_coef * len^2``."""
    return [linear_coef * n + quad_coef * n * n for n in _as_lengths(lengths)]


def _heaviest_first(part: list) -> tuple[float, int]:
    return (-part[0], -len(part[1]))


def _combine(x: list, y: list) -> list:
    """One part from two (in place: both come from states that are used up)."""
    if len(x[1]) < len(y[1]):
        x, y = y, x
    x[0] += y[0]
    x[1].extend(y[1])
    return x


def karmarkar_karp(weights: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split ``range(len(weights))`` into ``k`` parts of near-equal weight sum (largest differencing).

    Each part's indices are sorted; parts are ordered by their first index (empty parts last).
    ``equal_size``: part sizes differ by at most one. Otherwise no part is empty unless there
    are fewer than ``k`` items.
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    # A state: up to k parts [sum, indices], heaviest first; missing parts are empty. Each
    # step merges the two states of largest spread, pairing the heaviest part of one with the
    # lightest of the other, so their spreads cancel.
    if equal_size:
        order = [-1] * ((-len(order)) % k) + order  # zero-weight fillers, dropped at the end
        chunks = [order[s : s + k] for s in range(0, len(order), k)]
        states = [sorted(([weights[i] if i >= 0 else 0.0, [i]] for i in c), key=_heaviest_first) for c in chunks]
    else:
        states = [[[float(weights[i]), [i]]] for i in order]
    heap = [(-_spread(s, k), n, s) for n, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        ma, mb = len(a), len(b)
        # Position i of a meets position k-1-i of b; only k-mb <= i < ma has both non-empty.
        both = [_combine(a[i], b[k - 1 - i]) for i in range(max(k - mb, 0), ma)]
        merged = a[: max(k - mb, 0)] + both + b[: max(k - ma, 0)]
        merged.sort(key=_heaviest_first)
        heapq.heappush(heap, (-_spread(merged, k), counter, merged))
        counter += 1
    final = heap[0][2] if heap else []
    parts = [sorted(i for i in p[1] if i >= 0) for p in final] + [[] for _ in range(k - len(final))]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def _spread(state: list, k: int) -> float:
    return state[0][0] - (state[-1][0] if len(state) == k else 0.0)


def balance_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Row indices per rank: equal row counts (+-1), work balanced. Needs ``len >= world_size``."""
    lengths = _as_lengths(lengths)
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(lengths) < world_size:
        raise ValueError(f"cannot give each of {world_size} ranks a row: the batch has {len(lengths)} rows")
    return karmarkar_karp(sequence_work(lengths), world_size, equal_size=True)


def _check_budget(lengths: list[int], max_token_len: int) -> int:
    if isinstance(max_token_len, bool) or not isinstance(max_token_len, (int, np.integer)):
        raise TypeError(f"max_token_len must be an int, got {type(max_token_len).__name__}")
    if max_token_len < 1:
        raise ValueError(f"max_token_len must be >= 1, got {max_token_len}")
    for i, n in enumerate(lengths):
        if n > max_token_len:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the micro-batch budget max_token_len={max_token_len}"
            )
    return int(max_token_len)


def _check_min(min_num_micro_batches: int) -> int:
    if isinstance(min_num_micro_batches, bool) or not isinstance(min_num_micro_batches, (int, np.integer)):
        raise TypeError(f"min_num_micro_batches must be an int, got {type(min_num_micro_batches).__name__}")
    if min_num_micro_batches < 1:
        raise ValueError(f"min_num_micro_batches must be >= 1, got {min_num_micro_batches}")
    return int(min_num_micro_batches)


def _fits(parts: list[list[int]], lengths: list[int], max_token_len: int) -> bool:
    return all(sum(lengths[i] for i in p) <= max_token_len for p in parts)


def _first_fit_decreasing(lengths: list[int], max_token_len: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_token_len - lengths[i])
    return [sorted(b) for b in bins]


def _smallest_split(lengths: list[int], max_token_len: int, min_parts: int) -> list[list[int]]:
    """A budget-respecting split into few parts.

    Karmarkar-Karp at the lower bound ``max(ceil(tokens / budget), min_parts)``; if a part
    overflows, Karmarkar-Karp at first-fit-decreasing's bin count; if that overflows too,
    the first-fit-decreasing bins themselves (they always fit).
    """
    work = sequence_work(lengths)
    lo = min(max(math.ceil(sum(lengths) / max_token_len), min_parts, 1), len(lengths))
    parts = karmarkar_karp(work, lo)
    if _fits(parts, lengths, max_token_len):
        return parts
    ffd = _first_fit_decreasing(lengths, max_token_len)
    if len(ffd) > lo:
        parts = karmarkar_karp(work, len(ffd))
        if _fits(parts, lengths, max_token_len):
            return parts
    return ffd


def _grow_to(parts: list[list[int]], lengths: list[int], k: int) -> list[list[int]]:
    """Split the heaviest multi-row part in two until there are ``k`` parts or only singletons.

    Splitting never makes a part bigger, so the budget still holds.
    """
    parts = [list(p) for p in parts]
    while len(parts) < k:
        splittable = [p for p in parts if len(p) > 1]
        if not splittable:
            break
        big = max(splittable, key=lambda p: (sum(lengths[i] for i in p), -p[0]))
        parts.remove(big)
        halves = karmarkar_karp([lengths[i] for i in big], 2, equal_size=True)  # both non-empty
        parts.extend([[big[j] for j in h] for h in halves])
    return parts


def _split(lengths: list[int], max_token_len: int, min_num_micro_batches: int) -> list[list[int]]:
    """Non-empty, budget-respecting parts; at least ``min(min_num_micro_batches, rows)`` of them."""
    if not lengths:
        return []
    parts = [p for p in _smallest_split(lengths, max_token_len, min_num_micro_batches) if p]
    want = min(min_num_micro_batches, len(lengths))
    if len(parts) < want:
        direct = [p for p in karmarkar_karp(sequence_work(lengths), want) if p]
        fits = len(direct) == want and _fits(direct, lengths, max_token_len)
        parts = direct if fits else _grow_to(parts, lengths, want)
    return parts


def count_micro_batches(lengths: Sequence[int], max_token_len: int, min_num_micro_batches: int = 1) -> int:
    """How many micro-batches ``split_by_token_budget`` makes for these lengths.

    All-reduce (MAX) this over the ranks and pass it as ``min_num_micro_batches`` to
    ``split_by_token_budget`` on every rank to get equal counts.
    """
    lengths = _as_lengths(lengths)
    max_token_len = _check_budget(lengths, max_token_len)
    min_num_micro_batches = _check_min(min_num_micro_batches)
    return max(len(_split(lengths, max_token_len, min_num_micro_batches)), min_num_micro_batches)


def split_by_token_budget(
    lengths: Sequence[int], max_token_len: int, min_num_micro_batches: int = 1
) -> list[list[int]]:
    """Row indices per micro-batch, each micro-batch holding at most ``max_token_len`` tokens.

    Returns exactly ``count_micro_batches(lengths, max_token_len, min_num_micro_batches)``
    parts, ordered by first index, indices sorted inside each. If that is more than the rows,
    the surplus parts are EMPTY lists at the end: the rank must still take part in every
    collective (e.g. run a zero-weighted dummy micro-batch). A row longer than the budget
    raises ``ValueError``.
    """
    lengths = _as_lengths(lengths)
    max_token_len = _check_budget(lengths, max_token_len)
    min_num_micro_batches = _check_min(min_num_micro_batches)
    parts = _split(lengths, max_token_len, min_num_micro_batches)
    parts = sorted(parts, key=lambda p: p[0])
    return parts + [[] for _ in range(min_num_micro_batches - len(parts))]


def reverse_index(partitions: Sequence[Sequence[int]]) -> list[int]:
    """``rev[i]`` = position of original row ``i`` in the concatenation of ``partitions``."""
    flat = [i for p in partitions for i in p]
    rev = [-1] * len(flat)
    for pos, i in enumerate(flat):
        if not 0 <= i < len(flat) or rev[i] != -1:
            raise ValueError(f"partitions are not a permutation of range({len(flat)}): bad or repeated index {i}")
        rev[i] = pos
    return rev


def restore_order(outputs: Any, partitions: Sequence[Sequence[int]]) -> Any:
    """Put ``outputs`` (rows in partition order) back in the original row order.

    ``outputs`` is one tensor / numpy array / list with the rows of all partitions
    concatenated along the first axis, or a list with one tensor per partition (empty
    partitions may be left out).
    """
    rev = reverse_index(partitions)
    if isinstance(outputs, (list, tuple)) and outputs and all(isinstance(o, torch.Tensor) for o in outputs):
        n_parts = (len(partitions), sum(1 for p in partitions if len(p)))
        if len(outputs) in n_parts and sum(o.shape[0] for o in outputs) == len(rev):
            outputs = torch.cat(list(outputs), dim=0)
    if isinstance(outputs, torch.Tensor):
        if outputs.shape[0] != len(rev):
            raise ValueError(f"outputs have {outputs.shape[0]} rows, partitions hold {len(rev)}")
        return outputs[torch.tensor(rev, dtype=torch.long, device=outputs.device)]
    if isinstance(outputs, np.ndarray):
        if outputs.shape[0] != len(rev):
            raise ValueError(f"outputs have {outputs.shape[0]} rows, partitions hold {len(rev)}")
        return outputs[np.asarray(rev, dtype=np.int64)]
    if isinstance(outputs, (list, tuple)):
        if len(outputs) != len(rev):
            raise ValueError(f"outputs have {len(outputs)} rows, partitions hold {len(rev)}")
        return [outputs[j] for j in rev]
    raise TypeError(f"outputs must be a tensor, numpy array or list, got {type(outputs).__name__}")


def shared_units(
    groups: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    max_token_len: int | None = None,
    max_rows: int | None = None,
) -> tuple[list[list[int]], list[int]]:
    """``(units, tokens)``: each group of rows sharing a prompt, cut into consecutive pieces whose
    shared-prompt token count ``P + sum(R_i)`` fits ``max_token_len`` and whose rows fit
    ``max_rows`` (when given); ``tokens[u]`` is unit u's count. A row alone over the budget raises."""
    plens, rlens = _as_lengths(prompt_lengths, "prompt_lengths"), _as_lengths(response_lengths, "response_lengths")
    units: list[list[int]] = []
    tokens: list[int] = []
    for group in groups:
        current: list[int] = []
        used = 0
        for row in group:
            prompt, cost = plens[row], rlens[row]
            if max_token_len is not None and prompt + cost > max_token_len:
                raise ValueError(f"sequence {row} has {prompt + cost} tokens, more than the micro-batch budget "
                                 f"max_token_len={max_token_len}")  # fmt: skip
            over_tokens = max_token_len is not None and prompt + used + cost > max_token_len
            over_rows = max_rows is not None and len(current) >= max_rows
            if current and (over_tokens or over_rows):
                units.append(current)
                tokens.append(prompt + used)
                current, used = [], 0
            current.append(row)
            used += cost
        if current:
            units.append(current)
            tokens.append(plens[current[0]] + used)
    return units, tokens


def pack_units_by_rows(unit_rows: Sequence[int], max_rows: int) -> list[list[int]]:
    """Unit indices per micro-batch of at most ``max_rows`` rows, whole units in order (a unit
    larger than ``max_rows`` gets a micro-batch of its own)."""
    parts: list[list[int]] = []
    rows = 0
    for u, n in enumerate(_as_lengths(unit_rows, "unit_rows")):
        if not parts or rows + n > max_rows:
            parts.append([])
            rows = 0
        parts[-1].append(u)
        rows += n
    return parts


def _shared_work(tokens: int, rows: int) -> float:
    return LINEAR_COEF * tokens + QUAD_COEF * tokens * tokens / max(rows, 1)


def balance_units_across_ranks(
    units: Sequence[Sequence[int]], tokens: Sequence[int], world_size: int
) -> list[list[int]] | None:
    """Row indices per rank made of whole units (work balanced by Karmarkar-Karp), or ``None`` when
    whole units cannot give every rank the same row count (units of unequal size, or a count that
    ``world_size`` does not divide): the caller then splits rows (``balance_across_ranks``)."""
    sizes = {len(u) for u in units}
    if len(sizes) != 1 or len(units) % world_size:
        return None
    work = [_shared_work(t, len(u)) for u, t in zip(units, tokens)]
    return [sorted(r for u in part for r in units[u]) for part in karmarkar_karp(work, world_size, equal_size=True)]
