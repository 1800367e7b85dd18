"""The shared-prompt path's per-layer work is a small constant: no index built in a layer (issue #28).

On a GPU every aten op on a device tensor is (at least) one kernel launch, so the ops a forward +
backward dispatches on the device are the CPU's proxy for launches. Counted with a
TorchDispatchMode on PyTorch's ``meta`` device (no data, no kernel: the dispatcher still sees every
op), with the dispatch offered what an H100 offers in bf16 (torch's varlen kernel, which has a
meta implementation), so the CUDA branch of rlpad_varlen runs as it would there. Per-layer ops =
(ops at 6 layers - ops at 2 layers) / 4.

The shared path may add to the plain packed row's per layer only the two K/V gathers of its one
varlen call and their backward; that holds for batches of any group structure, and no op inside
a layer makes an integer (index) tensor. Separately, on the CPU: the one varlen call's inputs
(``cu_q``, ``cu_k``, ``kv_index``) describe exactly the attention of the exact sdpa branch.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from rlpad.bench.host_proxy import DeviceOps, gpu_code_path
from rlpad.core.forward import compute_log_probs
from rlpad.core.host_plan import HostBatch
from rlpad.core.shared_attention import shared_prompt_attention
from rlpad.core.shared_prompt import pack_shared_prompts
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import tiny_model

RESPONSE, VOCAB = 10, 128
# What the shared path adds per layer to the packed row's work: K and V gathered (forward), their
# gradients scattered back (backward: a zero buffer and an index_add each).
SHARED_EXTRA = Counter({"aten.index_select": 2, "aten.new_zeros": 2, "aten.index_add": 2})


@pytest.fixture
def h100_offer():
    """The dispatch sees on ``meta`` what an sm90 GPU with torch's varlen kernel offers
    (rlpad.bench.host_proxy, the same stand-in `rlpad bench host` counts with)."""
    with gpu_code_path():
        yield


def counted(batch: dict, share: bool, layers: int) -> DeviceOps:
    """Device ops of one bf16 forward + backward of a ``layers``-layer tiny qwen2 on ``meta`` (views aside)."""
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1, num_hidden_layers=layers).to(torch.bfloat16).to("meta")
    host = HostBatch.of(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    on_meta = {k: batch[k].to("meta") for k in ("input_ids", "attention_mask", "position_ids")}
    with DeviceOps() as seen:
        lp, ent = compute_log_probs(model, on_meta["input_ids"], on_meta["attention_mask"], on_meta["position_ids"],
                                    RESPONSE, use_remove_padding=True, share_prompts=share, calculate_entropy=True,
                                    check=False, host=host)  # fmt: skip
        (lp.sum() + ent.sum()).backward()
    return seen


def per_layer(batch: dict, share: bool) -> tuple[Counter, Counter]:
    """(ops per layer, integer-output ops per layer)."""
    two, six = counted(batch, share, 2), counted(batch, share, 6)
    ops, ints = six.ops.copy(), six.ints.copy()
    ops.subtract(two.ops)
    ints.subtract(two.ints)
    assert all(v % 4 == 0 for v in ops.values()), ops
    return Counter({k: v // 4 for k, v in ops.items() if v}), Counter({k: v // 4 for k, v in ints.items() if v})


BATCHES = {  # (groups, n, prompt columns, shuffled): different group structures, the same per-layer work
    "3x4": (3, 4, 12, True),
    "6x2": (6, 2, 20, False),
}


@pytest.mark.parametrize("shape", list(BATCHES))
def test_shared_path_per_layer_ops_are_the_packed_rows_plus_two_gathers(shape, h100_offer):
    groups, n, prompt, shuffle = BATCHES[shape]
    batch = grpo_batch(groups, n, prompt, RESPONSE, vocab_size=VOCAB, seed=5, shuffle=shuffle, min_prompt=2)
    shared, shared_ints = per_layer(batch, share=True)
    packed, packed_ints = per_layer(batch, share=False)
    assert shared["torch_attn._varlen_attn"] == 1 and shared["torch_attn._varlen_attn_backward"] == 1, shared
    extra = shared.copy()
    extra.subtract(packed)
    assert Counter({k: v for k, v in extra.items() if v}) == SHARED_EXTRA, (extra, shared, packed)
    # No index is built inside a layer: the only integer outputs per layer are the varlen kernel's
    # own (its RNG state), the same as on the packed row.
    assert shared_ints == packed_ints, (shared_ints, packed_ints)


@pytest.mark.parametrize("share", [False, True], ids=["rmpad", "shared"])
def test_the_plan_reaches_the_device_in_one_copy(share, h100_offer):
    """Every index of the forward (packing, cu_seqlens, segments, scoring slots) was built on the
    host and moved in ONE host-to-device copy, at any depth."""
    batch = grpo_batch(3, 4, 12, RESPONSE, vocab_size=VOCAB, seed=5, shuffle=True, min_prompt=2)
    assert [counted(batch, share, layers).h2d for layers in (2, 6)] == [1, 1]


def per_sequence(q, k, v, cu_q, cu_k, window):
    """Each sequence i: queries q[cu_q[i]:cu_q[i+1]] over keys k/v[cu_k[i]:cu_k[i+1]], causal aligned
    bottom-right (query j at key position nk - nq + j), fp64 sdpa with an explicit mask; (T, H, D)."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        diff = (nk - nq + torch.arange(nq))[:, None] - torch.arange(nk)
        mask = (diff >= 0) & (diff < (window if window is not None else nk + 1))
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (qs, ks, vs)), attn_mask=mask)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 5])
def test_one_varlen_call_describes_the_exact_attention(window):
    """The varlen call's inputs (queries in place by ``cu_q``, keys gathered by ``kv_index`` and
    ``cu_k``), run per sequence in fp64, equal the exact CPU branch in row order."""
    b = grpo_batch(4, 3, 14, RESPONSE, vocab_size=VOCAB, seed=3, shuffle=True, min_prompt=2)
    seg = pack_shared_prompts(b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE, pad_to=4).segments
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, seg.total, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    ref = shared_prompt_attention(q, k, v, seg, scale=None, window=window)[0]  # (T, H, D): the sdpa branch
    qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))
    assert int(seg.cu_q[-1]) == seg.total and int(seg.cu_k[-1]) == seg.kv_index.numel()
    assert seg.cu_q.dtype == seg.cu_k.dtype == torch.int32
    assert seg.max_q == int(seg.cu_q.diff().max()) and seg.max_k == int(seg.cu_k.diff().max())
    got = per_sequence(qt, kt[seg.kv_index], vt[seg.kv_index], seg.cu_q, seg.cu_k, window)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    # Negative control: the same sequences with their own keys only (responses not seeing the prompt).
    alone = per_sequence(qt, kt, vt, seg.cu_q, seg.cu_q, window)
    assert (alone - ref).abs().max() > 1e-2
