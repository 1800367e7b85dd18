"""Sharded initialisation in real gloo processes: only rank 0 reads the checkpoint, every rank
ends with weights (and buffers) equal to a full load bit for bit."""

import pytest

from rlpad.bench.sharded_init import run_init_bench
from workers.staging import NodePaths


@pytest.mark.parametrize("model,world", [("tiny", 2), ("tiny-llama", 3)])
def test_sharded_init_equals_full_load(model, world):
    result = run_init_bench(model, world, compare_to="other-seed")
    ranks = result["ranks"]
    assert [r["reads_checkpoint"] for r in ranks] == [True] + [False] * (world - 1)
    for r in ranks:
        assert r["tensors"] > 0 and r["mismatched"] == [], r
        assert r["tied_embeddings_shared"] in (True, None)  # qwen2: the LM head still IS the embedding
        # Negative control: the same comparison against another seed's checkpoint does find differences.
        assert len(r["mismatched_other"]) > 0
    assert sum(r["shard_bytes"] for r in ranks) == result["fp32_bytes"]  # the shards partition the model


def test_missing_checkpoint_names_node_and_path():
    with pytest.raises(ValueError, match=r"checkpoint path '/nonexistent/ckpt' is not a directory on node \S+"):
        NodePaths()("/nonexistent/ckpt")
    assert NodePaths()("tiny:qwen2") == "tiny:qwen2"
