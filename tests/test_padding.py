"""rlpad.core.padding: flash-attn 2.8's unpad/pad contract, autograd, document masks, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlpad.core.padding import index_first_axis, pad_input, unpad_input


@st.composite
def contiguous_masks(draw):
    """(B, S) masks with one run of ones per row, anywhere in the row."""
    batch = draw(st.integers(1, 6))
    seqlen = draw(st.integers(1, 12))
    rows = []
    for _ in range(batch):
        length = draw(st.integers(1, seqlen))
        start = draw(st.integers(0, seqlen - length))
        rows.append([0] * start + [1] * length + [0] * (seqlen - start - length))
    return torch.tensor(rows)


@settings(max_examples=60, deadline=None)
@given(mask=contiguous_masks(), feat=st.integers(1, 3))
def test_unpad_pad_roundtrip_matches_a_plain_loop(mask, feat):
    batch, seqlen = mask.shape
    x = torch.randn(batch, seqlen, feat)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    # independent computation: walk the rows in order
    expected_rows = [x[b, s] for b in range(batch) for s in range(seqlen) if mask[b, s]]
    lengths = [int(r.sum()) for r in mask]
    assert torch.equal(x_unpad, torch.stack(expected_rows))
    assert cu_seqlens.dtype == torch.int32 and seqused.dtype == torch.int32
    assert cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(batch + 1)]
    assert seqused.tolist() == lengths
    assert isinstance(max_seqlen, int) and max_seqlen == max(lengths)
    back = pad_input(x_unpad, indices, batch, seqlen)
    assert torch.equal(back, x * mask.unsqueeze(-1))


@settings(max_examples=25, deadline=None)
@given(mask=contiguous_masks())
def test_gradients_flow_through_unpad_and_pad(mask):
    batch, seqlen = mask.shape
    x = torch.randn(batch, seqlen, 2, dtype=torch.float64, requires_grad=True)
    x_unpad, indices, *_ = unpad_input(x, mask)
    weight = torch.randn_like(x_unpad)
    (x_unpad * weight).sum().backward()
    expected = torch.zeros_like(x)
    expected[mask.bool()] = weight
    assert torch.equal(x.grad, expected)
    values = torch.randn(int(mask.sum()), 2, dtype=torch.float64, requires_grad=True)
    up = torch.randn(batch, seqlen, 2, dtype=torch.float64)
    (pad_input(values, indices, batch, seqlen) * up).sum().backward()
    assert torch.equal(values.grad, up[mask.bool()])


def test_index_first_axis_gradcheck():
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([5, 0, 3])
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, idx), (x,))


def test_unused_mask_extends_packing_but_not_seqused():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    unused = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]])
    x = torch.arange(8.0).view(2, 4, 1)
    x_unpad, _, cu, max_len, seqused = unpad_input(x, mask, unused)
    assert x_unpad.flatten().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert cu.tolist() == [0, 3, 7] and seqused.tolist() == [2, 4] and max_len == 4


@pytest.mark.parametrize(
    "mask, message",
    [
        ([[1, 0, 1]], "holes"),
        ([[0, 1, 2]], "only 0 and 1"),
        ([[0.0, 0.5, 1.0]], "only 0 and 1"),
        ([[1, 1, 1], [0, 0, 0]], "no valid token"),
    ],
)
def test_unpad_input_rejects_bad_masks(mask, message):
    m = torch.tensor(mask)
    with pytest.raises(ValueError, match=message):
        unpad_input(torch.zeros(*m.shape, 2), m)


def test_unpad_input_rejects_disagreeing_shapes():
    with pytest.raises(ValueError, match="shapes disagree"):
        unpad_input(torch.zeros(2, 5, 3), torch.ones(2, 4, dtype=torch.long))
