"""The fused LM head's launch plan (rlpad/core/lm_head_plan.py), no Triton needed: every grid order
covers each (token block, split) once, the HBM model against closed forms at the 7B head's shape, the
tile table's choice per capability and token bucket (logged once), bad configurations refused."""

import dataclasses
import logging

import pytest

from rlpad.core.lm_head_plan import (GPUS, GRID_ORDERS, TILE_TABLE, Tiles, choose_tiles, forward_traffic, l2_group,
                                     plan_splits, program_coords, resident_programs)

N, H, V = 19000, 3584, 152064  # the 7B head at issue #34's token count


@pytest.mark.parametrize("order", GRID_ORDERS)
@pytest.mark.parametrize("n_blocks,splits,group", [(1, 1, 8), (3, 5, 2), (149, 5, 27), (10, 3, 4), (7, 7, 100)])
def test_every_order_is_a_bijection(order, n_blocks, splits, group):
    coords = [program_coords(p, n_blocks, splits, order, group) for p in range(n_blocks * splits)]
    assert sorted(coords) == [(b, s) for b in range(n_blocks) for s in range(splits)]


def test_hbm_model_token_fastest_matches_the_closed_form_and_grouped_cuts_it():
    """token_fastest with 128 x 128 tiles: the resident panels overflow the L2, so each program
    re-reads its panel per vocabulary tile, N_blocks x splits x tiles_per_split x 128 x H x 2 bytes in
    all (issue #34's ~160 GB). vocab_fastest keeps a wave on few panels (in L2): the hidden states
    are read about once and the weight once per wave, 20x less; grouped lies between them."""
    gpu = GPUS["H100"]
    tiles = Tiles(128, 128, 64, 8, 3, order="token_fastest")
    got = forward_traffic(N, H, V, tiles, gpu)
    n_blocks, v_tiles = -(-N // 128), -(-V // 128)
    per_split = -(-v_tiles // got["splits"])
    closed_h = sum(min(per_split, v_tiles - s * per_split) for s in range(got["splits"])) * n_blocks * 128 * H * 2
    assert got["hidden_gb"] == pytest.approx(closed_h / 1e9, rel=0.02)
    assert 150 < got["total_gb"] < 180, got
    vocab = forward_traffic(N, H, V, dataclasses.replace(tiles, order="vocab_fastest"), gpu)
    group = l2_group(tiles, H, gpu.l2_bytes)
    assert group * 128 * H * 2 <= gpu.l2_bytes // 2 < (group + 1) * 128 * H * 2
    assert vocab["splits"] >= -(-vocab["resident"] // group)
    # a wave of `resident` programs holds resident / splits panels (in L2) and reads the weight once
    assert vocab["weight_gb"] == pytest.approx(vocab["waves"] * V * H * 2 / 1e9, rel=0.05), vocab
    assert vocab["hidden_gb"] == pytest.approx(N * H * 2 / 1e9, rel=0.05), vocab
    assert vocab["total_gb"] * 20 < got["total_gb"], (vocab, got)
    grouped = forward_traffic(N, H, V, dataclasses.replace(tiles, order="grouped"), gpu)
    assert vocab["total_gb"] < grouped["total_gb"] < got["total_gb"], grouped  # windows straddle groups


def test_splits_keep_a_wave_on_one_group():
    gpu = GPUS["H100"]
    tiles = Tiles(128, 256, 64, 8, 3)
    resident = resident_programs(tiles, gpu)
    assert resident == gpu.sms  # 147 KiB of stages, 255 registers x 256 threads: one per SM
    group = l2_group(tiles, H, gpu.l2_bytes)
    splits = plan_splits(149, 594, gpu.sms, resident, group, "vocab_fastest")
    assert splits * group >= resident and splits >= -(-4 * gpu.sms // 149)
    assert plan_splits(149, 594, gpu.sms, resident, group, "token_fastest") == -(-4 * gpu.sms // 149)
    assert plan_splits(1, 3, gpu.sms, resident, group, "grouped") == 3  # never more splits than tiles


def test_tile_table_choice_per_capability_and_bucket_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="rlpad.core.lm_head_plan"):
        for cap, entries in TILE_TABLE.items():
            limits = [limit for limit, _ in entries]
            for i, (limit, tiles) in enumerate(entries):
                probe = limit if limit is not None else (limits[-2] or 0) + 1
                assert choose_tiles(cap, probe) == tiles
                assert choose_tiles(cap, probe) == tiles  # asked twice, logged once
        assert choose_tiles((9, 0), 19000) == TILE_TABLE[(9, 0)][-1][1]
        assert choose_tiles((10, 0), 64) == TILE_TABLE[(9, 0)][0][1]  # a newer GPU: the nearest lower entry
        assert choose_tiles((7, 5), 64) == TILE_TABLE[(8, 0)][0][1]  # an older one: 8.0's
        cut = choose_tiles((8, 6), 19000, smem_optin=99 << 10)  # sm_86: ~100 KiB per block
        assert cut.smem_bytes() <= 99 << 10 < dataclasses.replace(cut, stages=cut.stages + 1).smem_bytes()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(set(lines)) and any("sm_90" in line and "128x128x64 w8 s3 p256" in line for line in lines), lines


@pytest.mark.parametrize("kwargs,match", [(dict(order="diagonal"), "grid order must be one of"),
                                          (dict(block_n=0), "must be >= 1"), (dict(group=0), "must be >= 1"),
                                          (dict(promote=24), "promote must be 0 or a positive multiple of block_k")])
def test_bad_tiles_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Tiles(**{**dict(block_n=16, block_v=16, block_k=16, warps=1, stages=1), **kwargs})
