"""rlpad.core.value: the critic is the scoring core + a value head; checked against each sequence alone."""

import pytest
import torch

from rlpad.core.value import ValueModel
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

PROMPT, RESPONSE, VOCAB = 12, 10, 128


@pytest.fixture(scope="module")
def batch():
    return rollout_batch(6, PROMPT, RESPONSE, vocab_size=VOCAB, seed=3)


def values_alone(vm: ValueModel, batch) -> torch.Tensor:
    """Each sequence by itself through the backbone, value head on the state before each response token."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = torch.zeros(ids.shape[0], RESPONSE)
    for row in range(ids.shape[0]):
        seq = ids[row][mask[row].bool()]
        n_prompt = int(mask[row, :PROMPT].sum())
        hidden = vm.backbone(input_ids=seq[None], use_cache=False).last_hidden_state[0]
        for t in range(int(mask[row, PROMPT:].sum())):
            out[row, t] = vm.value_head(hidden[n_prompt + t - 1]).float().item()
    return out


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_values_padded_and_rmpad_equal_each_sequence_alone(arch, batch):
    vm = ValueModel(tiny_model(arch, vocab_size=VOCAB, seed=1), seed=5)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    with torch.no_grad():
        ref = values_alone(vm, batch)
        padded = vm(*args, use_remove_padding=False)
        packed = vm(*args, use_remove_padding=True)
    assert padded.shape == packed.shape == (6, RESPONSE)
    assert (packed[batch["response_mask"] == 0] == 0).all()
    torch.testing.assert_close(padded, ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(packed, ref, atol=2e-5, rtol=0)
    # Negative control: the value at token t is read from the state BEFORE t; reading it one
    # position later (the state of t itself) differs.
    shifted = torch.zeros_like(ref)
    shifted[:, :-1] = ref[:, 1:]
    assert not torch.allclose(shifted, packed, atol=1e-4)


def test_value_errors_before_compute(batch):
    vm = ValueModel(tiny_model("qwen2", vocab_size=VOCAB, seed=1))
    bad = batch["input_ids"].clone()
    bad[0, -1] = VOCAB
    with pytest.raises(ValueError, match="vocabulary"):
        vm(bad, batch["attention_mask"], None, RESPONSE)
