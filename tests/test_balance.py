"""rlpad.batching.balance: property tests for rank balancing, token-budget micro-batches and order restoration."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlpad.batching.balance import (
    balance_across_ranks,
    count_micro_batches,
    karmarkar_karp,
    restore_order,
    reverse_index,
    sequence_work,
    split_by_token_budget,
)

SETTINGS = settings(max_examples=150, deadline=None)


def assert_permutation(parts, n):
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n)), parts


def assert_budget(parts, lengths, budget):
    for p in parts:
        assert sum(lengths[i] for i in p) <= budget, (p, [lengths[i] for i in p], budget)


def split_like_ranks(per_rank, budget, min_num=1):
    """The workers' recipe (rlpad.batching.micro_batches): each rank counts locally, all-reduce MAX, then
    every rank splits with that count as its minimum."""
    common = max(count_micro_batches(ls, budget, min_num) for ls in per_rank)
    return [split_by_token_budget(ls, budget, min_num_micro_batches=common) for ls in per_rank]


# ----------------------------------------------------------------------------- strategies


@st.composite
def lengths_and_budget(draw, max_rows=60):
    budget = draw(st.integers(1, 4096))
    lengths = draw(st.lists(st.integers(0, budget), min_size=0, max_size=max_rows))
    return lengths, budget


@st.composite
def adversarial_ranks(draw):
    """Per-rank lengths where the ranks need very different micro-batch counts."""
    budget = draw(st.integers(16, 2048))
    world = draw(st.integers(2, 5))
    ranks = []
    for _ in range(world):
        kind = draw(st.sampled_from(["many_short", "few_long", "near_budget", "random", "tiny"]))
        if kind == "many_short":
            lengths = draw(st.lists(st.integers(1, max(1, budget // 16)), min_size=20, max_size=80))
        elif kind == "few_long":
            lengths = draw(st.lists(st.integers(budget // 2 + 1, budget), min_size=1, max_size=6))
        elif kind == "near_budget":  # each pair overflows: one per micro-batch
            lengths = draw(st.lists(st.integers(budget // 2 + 1, budget), min_size=5, max_size=30))
        elif kind == "tiny":  # fewer rows than the others may need micro-batches
            lengths = draw(st.lists(st.integers(0, budget), min_size=0, max_size=2))
        else:
            lengths = draw(st.lists(st.integers(0, budget), min_size=0, max_size=40))
        ranks.append(lengths)
    return ranks, budget


# ----------------------------------------------------------------------------- Karmarkar-Karp


def test_karmarkar_karp_small_cases():
    assert karmarkar_karp([5, 4, 3, 3, 2, 1], 2) == [[0, 3, 5], [1, 2, 4]]  # 9 / 9
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[0, 2], [1, 3, 4]]  # 14 / 16: KK's classic miss of 15 / 15
    assert karmarkar_karp([1, 2], 4) == [[0], [1], [], []]
    assert karmarkar_karp([0, 0, 5], 3) == [[0], [1], [2]]  # zero weights still spread out
    assert karmarkar_karp([], 2) == [[], []]
    with pytest.raises(ValueError, match="k must be >= 1"):
        karmarkar_karp([1], 0)


@SETTINGS
@given(st.lists(st.integers(0, 10_000), max_size=80), st.integers(1, 9), st.booleans())
def test_karmarkar_karp_properties(weights, k, equal_size):
    parts = karmarkar_karp(weights, k, equal_size=equal_size)
    assert len(parts) == k
    assert_permutation(parts, len(weights))
    if equal_size:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
    elif len(weights) >= k and all(w > 0 for w in weights):
        assert all(parts)
    if weights and not equal_size:
        # Largest differencing is never worse than putting the heaviest item alone.
        sums = [sum(weights[i] for i in p) for p in parts]
        assert max(sums) - min(sums) <= max(weights)


def test_sequence_work_constants():
    assert sequence_work([0, 1, 1000]) == [0.0, 24576.0 + 1.0, 24576.0 * 1000 + 1e6]


# ----------------------------------------------------------------------------- across ranks


@SETTINGS
@given(st.lists(st.integers(0, 8192), min_size=1, max_size=80), st.integers(1, 8))
def test_balance_across_ranks_properties(lengths, world):
    if len(lengths) < world:
        with pytest.raises(ValueError, match="cannot give each"):
            balance_across_ranks(lengths, world)
        return
    parts = balance_across_ranks(lengths, world)
    assert len(parts) == world
    assert_permutation(parts, len(lengths))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    if len(lengths) % world == 0:
        assert len(set(sizes)) == 1


def test_balance_across_ranks_evens_out_work():
    lengths = [4000, 4000, 100, 100, 100, 100, 3900, 3900]
    parts = balance_across_ranks(lengths, 2)
    work = [sum(sequence_work([lengths[i] for i in p])) for p in parts]
    assert sorted(len(p) for p in parts) == [4, 4]
    assert max(work) / min(work) < 1.05  # each rank gets one 4000, one 3900 and two 100s


# ----------------------------------------------------------------------------- token budget


@SETTINGS
@given(lengths_and_budget(), st.integers(1, 8))
def test_split_by_token_budget_properties(case, min_num):
    lengths, budget = case
    parts = split_by_token_budget(lengths, budget, min_num_micro_batches=min_num)
    count = count_micro_batches(lengths, budget, min_num_micro_batches=min_num)
    assert len(parts) == count >= min_num
    assert_permutation(parts, len(lengths))
    assert_budget(parts, lengths, budget)
    assert count >= math.ceil(sum(lengths) / budget)
    non_empty = [p for p in parts if p]
    assert len(non_empty) == min(count, len(lengths))  # empties only when rows run out, and last
    assert parts[: len(non_empty)] == non_empty
    assert all(p == sorted(p) for p in parts)


def test_split_by_token_budget_examples():
    assert split_by_token_budget([10, 20, 30], 1000) == [[0, 1, 2]]
    assert split_by_token_budget([600, 600, 600], 1000) == [[0], [1], [2]]
    parts = split_by_token_budget([100, 900, 50, 50, 50, 700, 300], 1000)
    assert len(parts) == 3  # ceil(2150 / 1000)
    assert split_by_token_budget([5, 5], 100, min_num_micro_batches=4) == [[0], [1], [], []]
    assert split_by_token_budget([], 100, min_num_micro_batches=2) == [[], []]
    assert split_by_token_budget(np.array([3, 4]), 10) == [[0, 1]]
    assert split_by_token_budget(torch.tensor([3, 4]), 4) == [[0], [1]]
    assert count_micro_batches([3, 4], np.int64(4), np.int64(3)) == 3  # e.g. after an all-reduce


def test_split_by_token_budget_bad_input():
    with pytest.raises(ValueError, match="sequence 1 has 2049 tokens.*max_token_len=2048"):
        split_by_token_budget([10, 2049, 5], 2048)
    with pytest.raises(ValueError, match="sequence 0 has 9 tokens.*max_token_len=8"):
        count_micro_batches([9], 8)
    with pytest.raises(ValueError, match="max_token_len must be >= 1"):
        split_by_token_budget([1], 0)
    with pytest.raises(ValueError, match=r"lengths\[1\] is negative"):
        split_by_token_budget([1, -1], 10)
    with pytest.raises(TypeError, match=r"lengths\[0\] must be an int"):
        split_by_token_budget([1.5], 10)
    with pytest.raises(TypeError, match="max_token_len must be an int"):
        split_by_token_budget([1], 10.0)
    with pytest.raises(ValueError, match="min_num_micro_batches must be >= 1"):
        split_by_token_budget([1], 10, min_num_micro_batches=0)


# ----------------------------------------------------------------------------- equal counts across ranks


@SETTINGS
@given(adversarial_ranks(), st.integers(1, 4))
def test_equal_micro_batch_counts_across_ranks(case, min_num):
    per_rank, budget = case
    result = split_like_ranks(per_rank, budget, min_num)
    counts = {len(parts) for parts in result}
    assert counts == {max(count_micro_batches(ls, budget, min_num) for ls in per_rank)}
    for lengths, parts in zip(per_rank, result):
        assert_permutation(parts, len(lengths))
        assert_budget(parts, lengths, budget)


def test_many_short_vs_few_long():
    short = [10] * 100  # 1000 tokens: one micro-batch on its own
    long = [1000, 1000, 1000, 1000]  # four micro-batches
    parts_short, parts_long = split_like_ranks([short, long], 1000)
    assert len(parts_short) == len(parts_long) == 4
    assert all(parts_short)  # the short rank's rows are spread over all four
    assert_budget(parts_short, short, 1000)


@SETTINGS
@given(st.lists(st.integers(1, 3000), min_size=2, max_size=64), st.integers(1, 4), st.integers(3000, 8000))
def test_rank_balance_then_micro_batches_end_to_end(lengths, world, budget):
    if len(lengths) < world:
        return
    ranks = balance_across_ranks(lengths, world)
    per_rank = [[lengths[i] for i in r] for r in ranks]
    micro = split_like_ranks(per_rank, budget)
    assert len({len(m) for m in micro}) == 1
    if len(lengths) % world == 0:  # equal rows per rank: never an empty micro-batch
        assert all(len(p) > 0 for m in micro for p in m)
    # Outputs computed micro-batch by micro-batch on each rank come back in the original order.
    rank_outputs = []
    for r, parts in zip(ranks, micro):
        local = torch.tensor([lengths[i] for i in r])
        pieces = [local[torch.tensor(p, dtype=torch.long)] * 2 for p in parts]
        rank_outputs.append(restore_order(pieces, parts))
    merged = restore_order(torch.cat(rank_outputs), ranks)
    assert merged.tolist() == [2 * n for n in lengths]


# ----------------------------------------------------------------------------- order restoration


@SETTINGS
@given(st.lists(st.integers(0, 500), max_size=50), st.integers(1, 7))
def test_restore_order_roundtrip(lengths, k):
    parts = karmarkar_karp(sequence_work(lengths), k)
    order = [i for p in parts for i in p]
    x = torch.arange(len(lengths)) * 10
    assert restore_order(x[torch.tensor(order, dtype=torch.long)], parts).tolist() == x.tolist()
    assert restore_order(np.array(order) * 10, parts).tolist() == x.tolist()
    assert restore_order([f"r{i}" for i in order], parts) == [f"r{i}" for i in range(len(lengths))]
    rev = reverse_index(parts)
    assert [order[rev[i]] for i in range(len(lengths))] == list(range(len(lengths)))


def test_restore_order_2d_and_errors():
    parts = [[2, 0], [1]]
    x = torch.tensor([[0.0, 0.5], [1.0, 1.5], [2.0, 2.5]])
    pieces = [x[torch.tensor(p)] for p in parts]
    assert torch.equal(restore_order(pieces, parts), x)
    parts = [[1], [0, 2], []]  # an empty micro-batch's output may be left out
    assert torch.equal(restore_order([x[[1]], x[[0, 2]]], parts), x)
    assert torch.equal(restore_order([x[[1]], x[[0, 2]], x[:0]], parts), x)
    with pytest.raises(ValueError, match="not a permutation"):
        reverse_index([[0, 0], [1]])
    with pytest.raises(ValueError, match="outputs have 2 rows"):
        restore_order(torch.zeros(2), parts)
    with pytest.raises(TypeError):
        restore_order("abc", parts)


# ----------------------------------------------------------------------------- rlpad.batching.micro_batches


def test_micro_batches_by_rows_budget_and_agreed_count():
    from rlpad.batch import Batch
    from rlpad.embedded.synthetic import rollout_batch
    from rlpad.batching.micro_batches import micro_batches

    batch = Batch(rollout_batch(7, 6, 10, vocab_size=50, seed=3))
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert micro_batches(batch, 3, None) == [[0, 1, 2], [3, 4, 5], [6]]
    # A rank that must run 5 micro-batches (another rank's count) gets empty ones at the end.
    assert micro_batches(batch, 3, None, agree=lambda v: [max(v[0], 5), v[1]]) == [[0, 1, 2], [3, 4, 5], [6], [], []]
    parts = micro_batches(batch, None, 24)
    assert_permutation(parts, 7)
    assert_budget(parts, lengths, 24)
    assert parts == split_by_token_budget(lengths, 24)  # rows are their own units without shared prompts
    # Another rank needs more: the rows spread over that many, then empty micro-batches beyond 7 rows.
    assert micro_batches(batch, None, 24, agree=lambda v: [v[0] + 1, v[1]]) == split_by_token_budget(lengths, 24, len(parts) + 1)
    spread = micro_batches(batch, None, 24, agree=lambda v: [9, v[1]])
    assert sorted(map(len, spread)) == [0, 0] + [1] * 7
    with pytest.raises(ValueError, match="micro-batch size must be >= 1"):
        micro_batches(batch, 0, None)
    with pytest.raises(ValueError, match=f"has {max(lengths)} tokens, more than the micro-batch token budget 3"):
        micro_batches(batch, None, 3)
    # A row over the budget on another rank: this rank learns it in the agreement and raises too.
    with pytest.raises(ValueError, match="another rank holds a sequence of 99 tokens, more than .* budget 24"):
        micro_batches(batch, None, 24, agree=lambda v: [v[0], 99])
    seen = []  # the rank holding the long row still joins the agreement (once) before raising
    with pytest.raises(ValueError, match="more than the micro-batch token budget 3"):
        micro_batches(batch, None, 3, agree=lambda v: seen.append(v) or v)
    assert seen == [[0, max(lengths)]]
