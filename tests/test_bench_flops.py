"""The FLOP model behind the benchmark's 'FLOP-ideal speedup', against hand-counted numbers."""

import torch

from rlpad.bench.flops import logprob_flops, padded_and_valid_flops
from rlpad.embedded.tiny import tiny_config


def test_flops_by_hand():
    cfg = tiny_config("llama", hidden_size=64, head_dim=32, num_hidden_layers=2, intermediate_size=128,
                      vocab_size=100)  # 2 heads, 2 kv heads
    f = logprob_flops(cfg, [3, 2], scored_tokens=4)
    per_layer_params = 64 * (64 + 2 * 64) + 64 * 64 + 3 * 64 * 128
    assert f["linear"] == 2 * 5 * per_layer_params * 2
    assert f["attention"] == 4 * (6 + 3) * 2 * 32 * 2  # causal pairs: 3*4/2 + 2*3/2
    assert f["head"] == 2 * 4 * 64 * 100
    assert f["total"] == f["linear"] + f["attention"] + f["head"]


def test_ideal_speedup_is_one_without_padding_and_grows_with_it():
    cfg = tiny_config("qwen2")
    full = torch.ones(4, 16, dtype=torch.long)
    padded, valid = padded_and_valid_flops(cfg, full, response_length=8)
    assert padded == valid
    half = full.clone()
    half[:, :4] = 0
    half[:, -4:] = 0
    padded, valid = padded_and_valid_flops(cfg, half, response_length=8)
    assert 1.9 < padded["total"] / valid["total"] < 2.3  # half the tokens, quadratic attention a bit more
