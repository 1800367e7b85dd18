"""Shared-prompt packing: each distinct prompt of a rollout batch once, followed by its responses.

GRPO samples n responses per prompt, so a batch holds every prompt n times. Rows whose prompt part
(valid tokens and positions of the first ``S - R`` columns) is identical form a group, wherever they
sit in the batch. The packed row holds, per group, the prompt once, then each row's valid response
tokens; response position ids continue from the prompt's (taken from the rows' own position ids)::

    rows            packed (1, T)
    P P P a a ·     [P P P] [a a] [b b b] [c]
    P P P b b b      0 1 2   3 4   3 4 5   3
    P P P c · ·

The attention this row needs (:class:`SharedSegments`, passed to ``rlpad_varlen`` as the forward
keyword ``rlpad_shared_segments``): prompt tokens causal among themselves; a response's tokens see
the whole prompt and causally their own response, never another response or group. Response
token 0 of every row is scored by the hidden state of its group's last prompt token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from rlpad.core.host_plan import HostBatch, response_positions, to_device
from rlpad.core.vision import split_groups_by_images

__all__ = ["MIN_SAVED_BY_DEVICE", "SEGMENTS_KWARG", "SharedPromptRow", "SharedSegments", "min_saved_for",
           "pack_shared_prompts", "prompt_groups", "saved_fraction"]

# ``model.share_prompts_min_saved_fraction`` left unset (None), by device type: below this fraction of
# its valid tokens saved, a micro-batch runs plain remove-padding (docs/shared_prompts.md). CPU: sharing
# paid at the smallest saving measured (0.28-0.31 saved: 1.2-1.4x); CUDA: from the H100 bench of
# 2026-11-24, not re-measured after issue #28's changes. Other devices take CUDA's.
MIN_SAVED_BY_DEVICE = {"cpu": 0.0, "cuda": 0.5}

# The forward keyword transformers passes on to the attention function.
SEGMENTS_KWARG = "rlpad_shared_segments"


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None, response_length: int,
    multi_modal_inputs: Sequence[Mapping] | None = None,
) -> list[list[int]]:
    """Rows grouped by identical prompt part (valid tokens and their positions, and the rows' images
    of ``multi_modal_inputs`` bit for bit), in order of first appearance; rows inside a group
    ascending. Padding slots do not count (their token is ignored)."""
    prompt_cols = input_ids.shape[1] - response_length
    mask = attention_mask[:, :prompt_cols].bool()
    ids = torch.where(mask, input_ids[:, :prompt_cols].long(), -1)
    key = ids if position_ids is None else torch.cat([ids, torch.where(mask, position_ids[:, :prompt_cols].long(), -1)], 1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(inverse.tolist()):
        groups.setdefault(g, []).append(row)
    return split_groups_by_images(list(groups.values()), multi_modal_inputs)  # insertion order: first appearance


def min_saved_for(configured: float | None, device: torch.device | str) -> float:
    """The sharing threshold a worker on ``device`` uses: ``configured``, or the device's default."""
    if configured is not None:
        return configured
    kind = torch.device(device).type
    return MIN_SAVED_BY_DEVICE.get(kind, MIN_SAVED_BY_DEVICE["cuda"])


def saved_fraction(attention_mask: torch.Tensor, response_length: int, groups: list[list[int]]) -> float:
    """The fraction of the batch's valid tokens that sharing removes from the packed row: every
    prompt of a group but one, over all valid tokens (0.0 for an empty batch). ``attention_mask``
    (B, S) on the host; ``groups``: :func:`prompt_groups`."""
    prompt_lens = attention_mask[:, : attention_mask.shape[1] - response_length].sum(1).tolist()
    valid = int(attention_mask.sum())
    return sum((len(rows) - 1) * prompt_lens[rows[0]] for rows in groups) / valid if valid else 0.0


@dataclass
class SharedSegments:
    """The attention structure of a shared-prompt packed row of ``total`` tokens.

    The row is a run of sequences, each contiguous: per group its prompt, then its responses.
    ``prompts`` = [(start, length)] (a ``pad_to`` padding run counts as a prompt: it attends to
    itself), ``responses`` = [(start, length, prompt id)].

    CUDA (varlen kernels, ONE call per layer): the row's queries as they sit, sequence by sequence
    (``cu_q``), each over keys gathered by ``kv_index`` (``cu_k``): a prompt over itself, a
    response over [its prompt, itself], bottom-right causal. The output is in row order.
    CPU (batched sdpa): ``blocks`` = ``(count, prompt_len, length)``: ``count`` query sequences of
    ``length`` tokens over keys [``prompt_len`` prompt tokens, their own tokens]; a prompt itself
    is a block with ``prompt_len`` 0. ``q_order``/``kv_order`` gather every block's queries/keys
    from the row in block order (``q_sizes``/``kv_sizes`` tokens per block), so one gather serves
    all blocks; ``inverse`` puts the concatenated block outputs back in row order.
    Every index is made once per forward (on the host, :func:`pack_shared_prompts`); no layer builds one.
    """

    total: int
    prompts: list[tuple[int, int]]
    responses: list[tuple[int, int, int]]
    cu_q: torch.Tensor  # (runs + 1,) int32, ends at total
    cu_k: torch.Tensor  # (runs + 1,) int32, ends at kv_index.numel()
    kv_index: torch.Tensor  # (sum of key lengths,) row slot of each gathered key
    max_q: int
    max_k: int
    blocks: list[tuple[int, int, int]]
    q_order: torch.Tensor
    kv_order: torch.Tensor
    q_sizes: list[int]
    kv_sizes: list[int]
    inverse: torch.Tensor
    masks: dict = field(default_factory=dict)  # CPU masks by (prompt_len, length, window), shared by the layers

    def tensor_fields(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    @property
    def prompt_starts(self) -> list[int]:
        return [s for s, _ in self.prompts]

    # Each part as a varlen problem of its own (host tensors): the prompts as sequences; the
    # responses as queries over [prompt, own] keys. What the one call above is made of.
    @property
    def prompt_index(self) -> torch.Tensor:
        return _runs([(s, n) for s, n in self.prompts])

    @property
    def prompt_cu(self) -> torch.Tensor:
        return _cu([n for _, n in self.prompts])

    @property
    def prompt_max(self) -> int:
        return max(n for _, n in self.prompts)

    @property
    def resp_index(self) -> torch.Tensor:
        return _runs([(s, n) for s, n, _ in self.responses])

    @property
    def resp_kv_index(self) -> torch.Tensor:
        return _runs([r for s, n, p in self.responses for r in (self.prompts[p], (s, n))])

    @property
    def resp_cu_q(self) -> torch.Tensor:
        return _cu([n for _, n, _ in self.responses])

    @property
    def resp_cu_k(self) -> torch.Tensor:
        return _cu([self.prompts[p][1] + n for _, n, p in self.responses])

    @property
    def resp_max_q(self) -> int:
        return max((n for _, n, _ in self.responses), default=0)

    @property
    def resp_max_k(self) -> int:
        return max((self.prompts[p][1] + n for _, n, p in self.responses), default=0)


@dataclass
class SharedPromptRow:
    """A packed shared-prompt row: ``input_ids``/``position_ids`` (1, T), its ``segments``, and
    ``score_index`` (N,): the packed slot whose hidden state scores each valid response token, in
    the row-major order of ``attention_mask[:, -R:].nonzero()``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: SharedSegments
    score_index: torch.Tensor
    response_idx: torch.Tensor  # (N,) flat index into (B, R) of each scored token

    def to(self, device: torch.device) -> SharedPromptRow:
        """The row with every tensor (its segments' too) on ``device``, in one copy (no host sync)."""
        seg_names = self.segments.tensor_fields()
        own = [self.input_ids, self.position_ids, self.score_index, self.response_idx]
        moved = to_device(own + [getattr(self.segments, n) for n in seg_names], device)
        segments = replace(self.segments, masks={}, **dict(zip(seg_names, moved[len(own):])))
        return SharedPromptRow(*moved[:2], segments, *moved[2:len(own)])


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _runs(runs: list[tuple[int, int]]) -> torch.Tensor:
    """``cat(start + arange(length) for start, length in runs)`` (int64, on the host), in a fixed
    handful of ops whatever the number of runs."""
    if not runs:
        return torch.zeros(0, dtype=torch.long)
    starts, lengths = torch.tensor(runs, dtype=torch.long).unbind(1)
    shift = starts - (lengths.cumsum(0) - lengths)  # start of each run minus its offset in the output
    return shift.repeat_interleave(lengths) + torch.arange(int(sum(n for _, n in runs)))


def _segments(prompts: list[tuple[int, int]], responses: list[tuple[int, int, int]], total: int) -> SharedSegments:
    """Segments (host tensors) from ``prompts`` = [(start, length)] and ``responses`` = [(start, length, prompt id)].

    Every index is a run list (Python ints) turned into a tensor by one :func:`_runs` call: a few
    host ops per forward whatever the rows (not a few per row)."""
    # The varlen call: every run in row order, keys [its prompt (none for a prompt), itself].
    runs = sorted([(s, n, 0, 0) for s, n in prompts] + [(s, n, *prompts[p]) for s, n, p in responses])
    if sum(n for _, n, _, _ in runs) != total or any(a[0] + a[1] != b[0] for a, b in zip(runs, runs[1:])):
        raise AssertionError(f"segments do not tile the {total} packed tokens: {runs}")
    kv_runs = [r for s, n, ps, pn in runs for r in ((ps, pn), (s, n)) if r[1]]
    # The CPU branch: queries of equal shape (prompt length, own length) form one block; prompts are (0, length).
    by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for start, length in prompts:
        by_shape.setdefault((0, length), []).append((start, start))
    for start, length, p in responses:
        by_shape.setdefault((prompts[p][1], length), []).append((start, prompts[p][0]))
    blocks = [(len(items), plen, n) for (plen, n), items in by_shape.items()]
    q_runs = [(s, n) for (_, n), items in by_shape.items() for s, _ in items]
    block_kv = [r for (plen, n), items in by_shape.items() for s, ps in items for r in ((ps, plen), (s, n))]
    q_order = _runs(q_runs)
    inverse = torch.empty_like(q_order)
    inverse[q_order] = torch.arange(total)
    return SharedSegments(
        total=total, prompts=prompts, responses=responses,
        cu_q=_cu([n for _, n, _, _ in runs]), cu_k=_cu([pn + n for _, n, _, pn in runs]), kv_index=_runs(kv_runs),
        max_q=max(n for _, n, _, _ in runs), max_k=max(pn + n for _, n, _, pn in runs),
        blocks=blocks, q_order=q_order, kv_order=_runs(block_kv), q_sizes=[c * n for c, _, n in blocks],
        kv_sizes=[c * (plen + n) for c, plen, n in blocks], inverse=inverse,
    )  # fmt: skip


def pack_shared_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None, response_length: int,
    *, pad_to: int = 1, groups: list[list[int]] | None = None, response_mask: torch.Tensor | None = None,
    rope_positions: torch.Tensor | None = None,
) -> SharedPromptRow:
    """Pack a checked rollout batch (left-padded non-empty prompts, right-padded responses) with
    each group's prompt once; see the module docstring. ``pad_to``: pad the row to a multiple of it
    (sequence parallelism) with token 0 at positions 0, 1, ..., a block of its own that attends
    only to itself and is never scored. ``groups``: :func:`prompt_groups` of the batch, where the
    caller has them. ``response_mask`` (B, R): score only those response tokens (the generated
    ones); every valid response token, tool output included, is still packed and attended.
    ``rope_positions`` (3, B, S): a VL batch's multimodal positions; the row's ``position_ids`` are then
    (4, 1, T) (:meth:`rlpad.core.host_plan.HostBatch.gather_positions`).

    Built on the host from one read of the batch (none when it is on the CPU): the row is on the
    CPU; :meth:`SharedPromptRow.to` moves it to the device in one copy."""
    host = replace(HostBatch.of(input_ids, attention_mask, position_ids, response_mask), rope_positions=rope_positions)
    seqlen = host.input_ids.shape[1]
    prompt_cols = seqlen - response_length
    prompt_lens = host.attention_mask[:, :prompt_cols].sum(1).tolist()
    resp_lens = host.attention_mask[:, prompt_cols:].sum(1).tolist()
    src: list[tuple[int, int]] = []  # runs (flat B*S start, length) of the packed tokens, in packed order
    prompts: list[tuple[int, int]] = []
    responses: list[tuple[int, int, int]] = []
    score: list[tuple[int, int, int, int]] = []  # (row, last prompt slot, response start, length)
    cursor = 0
    if groups is None:
        groups = prompt_groups(host.input_ids, host.attention_mask, host.position_ids, response_length)
    for g, rows in enumerate(groups):
        plen = int(prompt_lens[rows[0]])
        src.append((rows[0] * seqlen + prompt_cols - plen, plen))
        prompts.append((cursor, plen))
        cursor += plen
        last_prompt = cursor - 1
        for r in rows:
            n = int(resp_lens[r])
            if n:  # response token 0 is scored by the group's last prompt token, token t > 0 by slot start + t - 1
                src.append((r * seqlen + prompt_cols, n))
                responses.append((cursor, n, g))
                score.append((r, last_prompt, cursor, n))
                cursor += n
    flat = _runs(src)
    packed_ids = host.input_ids.reshape(-1).index_select(0, flat).view(1, -1)
    packed_pos = host.gather_positions(flat).unsqueeze(-2)  # (1, T) or (4, 1, T)
    pad = -cursor % pad_to
    if pad:
        packed_ids = torch.cat([packed_ids, packed_ids.new_zeros(1, pad)], 1)
        packed_pos = torch.cat([packed_pos, torch.arange(pad, dtype=packed_pos.dtype).expand(*packed_pos.shape[:-1], pad)], -1)
        prompts.append((cursor, pad))
    score_index = _runs([run for _, last, start, n in sorted(score) for run in ((last, 1), (start, n - 1))])
    response_idx = response_positions(host, response_length)[0]
    if host.response_mask is not None:  # drop the slots of tokens that are context only (tool output)
        valid = host.attention_mask[:, prompt_cols:].reshape(-1).nonzero().flatten()
        score_index = score_index[host.response_mask.reshape(-1)[valid].bool()]
    return SharedPromptRow(packed_ids, packed_pos, _segments(prompts, responses, cursor + pad), score_index,
                           response_idx)
