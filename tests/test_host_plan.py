"""The packed and shared-prompt forwards read nothing from the device (issue #28).

Their index tensors (packing order, cu_seqlens, the slots that score each token, the shared-prompt
segments) are built on the host from the batch's host copy and moved in one copy
(rlpad.core.host_plan). Checked by running forward AND backward with the model and the batch on
PyTorch's ``meta`` device, which has no data: any read of a device value (``nonzero``, ``.item()``,
``tolist``, a sort, a copy to the host) raises there. The negative control is the same call without
the host copy: it must read the batch, which ``meta`` refuses.
"""

import pytest
import torch

from rlpad.core.forward import compute_log_probs
from rlpad.core.host_plan import HostBatch, packed_plan
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import tiny_model

PROMPT, RESPONSE, VOCAB = 12, 10, 128


def batch():
    b = grpo_batch(3, 4, PROMPT, RESPONSE, vocab_size=VOCAB, seed=5, shuffle=True, min_prompt=2)
    return {k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}


def run(model, b, share, host):
    lp, ent = compute_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE,
                                use_remove_padding=True, share_prompts=share, calculate_entropy=True,
                                check=False, host=host)  # fmt: skip
    (lp.sum() + ent.sum()).backward()
    return lp, ent


@pytest.mark.parametrize("share", [False, True], ids=["rmpad", "shared"])
def test_forward_and_backward_read_no_device_value(share):
    b = batch()
    host = HostBatch.of(b["input_ids"], b["attention_mask"], b["position_ids"])
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1).to("meta")
    on_meta = {k: v.to("meta") for k, v in b.items()}
    lp, ent = run(model, on_meta, share, host)
    assert lp.device.type == "meta" and lp.shape == (12, RESPONSE)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises((NotImplementedError, RuntimeError)):  # control: without the host copy it reads the device
        run(model, on_meta, share, None)


@pytest.mark.parametrize("share", [False, True], ids=["rmpad", "shared"])
def test_host_copy_gives_the_same_numbers(share):
    b = batch()
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    with torch.no_grad():
        args = (b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE)
        kw = dict(use_remove_padding=True, share_prompts=share, calculate_entropy=True)
        ref = compute_log_probs(model, *args, **kw)
        got = compute_log_probs(model, *args, **kw, host=HostBatch.of(*args[:3]))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_packed_plan_matches_the_layout():
    b = batch()
    plan = packed_plan(HostBatch.of(b["input_ids"], b["attention_mask"], None), RESPONSE, pad_to=4)
    mask = b["attention_mask"].bool()
    nnz = int(mask.sum())
    assert plan.input_ids.shape[0] % 4 == 0 and torch.equal(plan.input_ids[:nnz], b["input_ids"][mask])
    assert int(plan.cu_seqlens[-1]) == plan.input_ids.shape[0] and plan.cu_seqlens.dtype == torch.int32
    # Each scored slot holds the token just before the scored response token, in the same sequence.
    labels = b["input_ids"][:, PROMPT:].reshape(-1)[plan.response_idx]
    before = plan.input_ids[plan.score_slots]
    rows, cols = plan.response_idx // RESPONSE, plan.response_idx % RESPONSE
    assert torch.equal(before, b["input_ids"][rows, PROMPT - 1 + cols])
    assert labels.numel() == int(mask[:, PROMPT:].sum())
