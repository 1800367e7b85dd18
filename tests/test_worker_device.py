"""Which CUDA device a worker rank takes (workers.fsdp.cuda_device_index): a pure rule of the
environment, tested without a GPU. Under torchrun every process sees all the node's GPUs and must
take LOCAL_RANK's (all on cuda:0 would make NCCL fail or hang); a Ray actor sees one GPU and no
LOCAL_RANK, and keeps the current device."""

import pytest

from workers.fsdp import cuda_device_index


@pytest.mark.parametrize("env, count, current, wanted", [
    ({"LOCAL_RANK": "3", "RANK": "7"}, 4, 0, 3),  # torchrun, second node: the node-local index, not RANK
    ({"LOCAL_RANK": "0"}, 1, 0, 0),
    ({}, 1, 0, 0),  # a Ray actor: its one visible GPU
    ({"LOCAL_RANK": ""}, 2, 1, 1),  # empty: not given
])
def test_device_from_local_rank(env, count, current, wanted):
    assert cuda_device_index(env, count, current) == wanted


def test_bad_local_rank():
    with pytest.raises(ValueError, match="LOCAL_RANK=4 names no device: this process sees 4 CUDA device"):
        cuda_device_index({"LOCAL_RANK": "4"}, 4, 0)
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an int"):
        cuda_device_index({"LOCAL_RANK": "x"}, 4, 0)
