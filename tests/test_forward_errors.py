"""compute_log_probs rejects bad input with a ValueError/TypeError naming the problem, before compute."""

import pytest
import torch

from rlpad.core.forward import compute_log_probs
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import tiny_model

VOCAB, PROMPT, RESPONSE = 64, 5, 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", vocab_size=VOCAB)


def good():
    b = rollout_batch(3, PROMPT, RESPONSE, vocab_size=VOCAB, seed=0)
    return b["input_ids"].clone(), b["attention_mask"].clone(), b["position_ids"].clone()


def call(model, ids, mask, pos, response_length=RESPONSE, **kw):
    kw.setdefault("use_remove_padding", True)
    return compute_log_probs(model, ids, mask, pos, response_length, **kw)


def test_mask_with_hole(model):
    ids, mask, pos = good()
    mask[0] = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1, 1])
    with pytest.raises(ValueError, match="holes"):
        call(model, ids, mask, pos)


def test_mask_not_binary(model):
    ids, mask, pos = good()
    mask[1, -1] = 2
    with pytest.raises(ValueError, match="only 0 and 1"):
        call(model, ids, mask, pos)


def test_shapes_disagree(model):
    ids, mask, pos = good()
    with pytest.raises(ValueError, match="shapes disagree"):
        call(model, ids, mask[:, 1:], pos)
    with pytest.raises(ValueError, match="shapes disagree"):
        call(model, ids, mask, pos[:2])


@pytest.mark.parametrize("response_length", [PROMPT + RESPONSE, PROMPT + RESPONSE + 3, 0])
def test_response_length_out_of_range(model, response_length):
    ids, mask, pos = good()
    with pytest.raises(ValueError, match="response_length"):
        call(model, ids, mask, pos, response_length=response_length)


def test_response_length_must_be_int(model):
    ids, mask, pos = good()
    with pytest.raises(TypeError, match="response_length"):
        call(model, ids, mask, pos, response_length=4.0)


@pytest.mark.parametrize("bad_id", [VOCAB, -1])
def test_token_outside_vocabulary(model, bad_id):
    ids, mask, pos = good()
    ids[2, 6] = bad_id
    with pytest.raises(ValueError, match=r"vocabulary.*row 2, column 6"):
        call(model, ids, mask, pos)


def test_row_without_valid_token(model):
    ids, mask, pos = good()
    mask[1] = 0
    with pytest.raises(ValueError, match="no valid token"):
        call(model, ids, mask, pos)


def test_right_padded_prompt(model):
    ids, mask, pos = good()
    mask[2] = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="left-padded"):
        call(model, ids, mask, pos, use_remove_padding=False)


def test_float_token_ids(model):
    ids, mask, pos = good()
    with pytest.raises(TypeError, match="integer token ids"):
        call(model, ids.float(), mask, pos)


def test_rmpad_needs_varlen_attention():
    model = tiny_model("qwen2", vocab_size=VOCAB, attn_implementation="sdpa")
    ids, mask, pos = good()
    with pytest.raises(ValueError, match="varlen attention"):
        call(model, ids, mask, pos)
    lp, _ = call(model, ids, mask, pos, use_remove_padding=False)  # the padded path is fine
    assert lp.shape == (3, RESPONSE)
