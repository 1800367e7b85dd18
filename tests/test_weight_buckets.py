"""Weight-sync bucket planning and the prompt split between rollout replicas (pure functions)."""

import pytest

from rlpad.embedded.tiny import tiny_model
from rlpad.rollout.buckets import plan_buckets, weight_unit


def test_weight_unit_is_the_block_prefix():
    assert weight_unit("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert weight_unit("transformer.h.0.attn.c_attn.weight") == "transformer.h.0"
    assert weight_unit("model.layers.3.mlp.experts.7.w1.weight") == "model.layers.3"
    assert weight_unit("model.embed_tokens.weight") == weight_unit("lm_head.weight") == weight_unit("model.norm.weight") == ""


def test_buckets_hold_whole_units_in_order_and_respect_the_size():
    model = tiny_model("qwen2", hidden_size=64, head_dim=32, num_hidden_layers=4, vocab_size=128)
    entries = [(n, t.numel() * t.element_size()) for n, t in model.state_dict().items()]
    sizes = dict(entries)
    layer_bytes = sum(b for n, b in entries if n.startswith("model.layers.0."))
    for bucket_bytes in (1, layer_bytes, 2 * layer_bytes + 1, 10**12):
        buckets = plan_buckets(entries, bucket_bytes)
        flat = [n for b in buckets for n in b]
        assert sorted(flat) == sorted(sizes)  # every tensor exactly once
        where = {n: i for i, b in enumerate(buckets) for n in b}
        for unit in {weight_unit(n) for n in sizes}:
            assert len({where[n] for n in sizes if weight_unit(n) == unit}) == 1, unit  # never split
        assert {weight_unit(n) for n in buckets[0]} >= {""}  # embeddings, norm, head first
        for b in buckets:  # a bucket over the size holds one unit only
            if sum(sizes[n] for n in b) > bucket_bytes:
                assert len({weight_unit(n) for n in b}) == 1
        layer_order = [int(weight_unit(n).split(".")[-1]) for n in flat if weight_unit(n)]
        assert layer_order == sorted(layer_order)
    assert len(plan_buckets(entries, 1)) == 5  # rest + 4 blocks
    assert len(plan_buckets(entries, 10**12)) == 1


def test_plan_buckets_rejects_bad_input():
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        plan_buckets([("a", 1)], 0)
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([("a", 1), ("a", 2)], 10)


def test_split_prompts_whole_contiguous_slices():
    pytest.importorskip("ray")
    from workers.rollout import split_prompts

    assert split_prompts(7, 2) == [(0, 4), (4, 7)]
    assert split_prompts(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_prompts(2, 4) == [(0, 1), (1, 2)]  # fewer prompts than replicas: idle replicas
    assert split_prompts(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="need >= 1 prompt"):
        split_prompts(0, 2)
