"""The weight stash of asynchronous training (workers/weight_stash.py) as a plain object: what it holds and
when it lets go. tests/test_async.py runs it as a Ray actor between the real actor and engine."""

from __future__ import annotations

import pytest
import torch

from workers.weight_stash import WeightStash


def test_a_version_is_held_until_every_replica_released_it():
    stash = WeightStash(replicas=2)
    source = torch.arange(6, dtype=torch.float32)
    assert stash.put(3, 0, [("a", source)]) == 24
    stash.put(3, 1, [("b", torch.ones(2, dtype=torch.float64))])
    stash.put(4, 0, [("a", source + 1)])
    source.zero_()  # a copy is kept, not the sender's tensor (in Ray: a view of the object store's copy)
    assert stash.get(3, 0)[0][1].tolist() == [0, 1, 2, 3, 4, 5]
    assert stash.held() == {3: 40, 4: 24}
    stash.release(3)
    assert stash.held() == {3: 40, 4: 24}  # one replica of two
    stash.release(3)
    assert stash.held() == {4: 24}
    with pytest.raises(KeyError, match=r"no bucket 0 of policy version 3 \(held: \{4: 24\}\)"):
        stash.get(3, 0)
    with pytest.raises(ValueError, match="replicas >= 1"):
        WeightStash(0)
