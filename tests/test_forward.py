"""rlpad.core.forward: remove-padding vs padded vs each sequence alone, per token, on several architectures."""

import pytest
import torch

from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL
from rlpad.core.forward import compute_log_probs
from rlpad.core.padding import unpad_input
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

ARCHS = sorted(ARCHITECTURES)  # qwen2 (GQA, tied), llama (MHA), mistral (sliding window 8), qwen3 (qk-norm)
PROMPT, RESPONSE, VOCAB = 12, 10, 128
TOL = FP32_LOGPROB_TOL  # derivation: rlpad/embedded/exactness.py


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    torch.manual_seed(0)
    return tiny_model(request.param, vocab_size=VOCAB, seed=1)


@pytest.fixture(scope="module")
def batch():
    b = rollout_batch(6, PROMPT, RESPONSE, vocab_size=VOCAB, seed=3)
    assert b["attention_mask"][0].all()  # a full-length row
    assert b["response_mask"][1].sum() == 1  # a 1-token response
    assert (b["attention_mask"][:, 0] == 0).any()  # some left padding
    assert (b["response_mask"][:, -1] == 0).any()  # some right padding
    return b


def run(model, batch, rmpad, **kw):
    return compute_log_probs(
        model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE,
        use_remove_padding=rmpad, calculate_entropy=True, **kw,
    )


def alone(model, batch):
    """Each sequence run by itself, no padding at all: the independent reference."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lp = torch.zeros(ids.shape[0], RESPONSE)
    ent = torch.zeros_like(lp)
    for row in range(ids.shape[0]):
        seq = ids[row][mask[row].bool()]
        n_prompt = int(mask[row, :PROMPT].sum())
        logits = model(seq[None], use_cache=False).logits[0].double()
        logp = logits.log_softmax(-1)
        for t in range(int(mask[row, PROMPT:].sum())):
            pos = n_prompt + t - 1
            lp[row, t] = logp[pos, seq[pos + 1]]
            ent[row, t] = -(logp[pos].exp() * logp[pos]).sum()
    return lp, ent


def test_rmpad_equals_padded_equals_alone(model, batch):
    with torch.no_grad():
        lp_pad, ent_pad = run(model, batch, rmpad=False)
        lp_rm, ent_rm = run(model, batch, rmpad=True)
        lp_ref, ent_ref = alone(model, batch)
    for got in (lp_pad, lp_rm):
        torch.testing.assert_close(got, lp_ref, atol=TOL, rtol=0)
    for got in (ent_pad, ent_rm):
        torch.testing.assert_close(got, ent_ref, atol=TOL, rtol=0)
    pad = batch["response_mask"] == 0
    assert (lp_rm[pad] == 0).all() and (ent_rm[pad] == 0).all()
    assert (lp_pad[pad] == 0).all() and (ent_pad[pad] == 0).all()


def test_gradients_of_token_mean_loss_agree(model, batch):
    mask = batch["response_mask"].float()
    grads = []
    for rmpad in (False, True):
        model.zero_grad()
        lp, ent = run(model, batch, rmpad=rmpad)
        loss = ((lp + 0.1 * ent) * mask).sum() / mask.sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad()
    for name, g in grads[0].items():
        assert (grads[1][name] - g).norm() <= FP32_GRAD_REL * g.norm(), name


def test_negative_control_boundaries_removed_changes_results(batch):
    """Packing without boundaries (one long sequence) must differ a lot: the test can fail."""
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        good, _ = run(model, batch, rmpad=True)
        packed, indices, cu, _, _ = unpad_input(ids.unsqueeze(-1), mask)
        positions = torch.arange(packed.shape[0])[None]  # no restarts, no cu_seqlens
        logits = model(packed.view(1, -1), position_ids=positions, use_cache=False).logits[0]
        logp = logits.log_softmax(-1)
        bad = torch.zeros_like(good)
        for row in range(ids.shape[0]):
            start = int(cu[row])
            n_prompt = int(mask[row, :PROMPT].sum())
            for t in range(int(mask[row, PROMPT:].sum())):
                pos = start + n_prompt + t - 1
                bad[row, t] = logp[pos, packed[pos + 1, 0]]
    later_rows = batch["response_mask"][1:].bool()  # row 0 comes first: nothing to leak into it
    assert (good[1:] - bad[1:])[later_rows].abs().max() > 1e-2
    torch.testing.assert_close(bad[0], good[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_head_equals_full_head_with_gradients(chunk, batch):
    model = tiny_model("llama", vocab_size=VOCAB, seed=2)
    mask = batch["response_mask"].float()
    out = {}
    for key, kw in (("full", {}), ("chunked", {"logits_chunk_size": chunk})):
        model.zero_grad()
        lp, ent = run(model, batch, rmpad=True, temperature=0.7, **kw)
        ((lp - 0.3 * ent) * mask).sum().backward()
        out[key] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["chunked"][0], out["full"][0], atol=TOL, rtol=0)
    torch.testing.assert_close(out["chunked"][1], out["full"][1], atol=TOL, rtol=0)
    for name, g in out["full"][2].items():
        assert (out["chunked"][2][name] - g).norm() <= FP32_GRAD_REL * g.norm(), name


def test_temperature_scales_logits_before_softmax(batch):
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    with torch.no_grad():
        lp, _ = run(model, batch, rmpad=True, temperature=2.0)
        seq = batch["input_ids"][2][batch["attention_mask"][2].bool()]
        n_prompt = int(batch["attention_mask"][2, :PROMPT].sum())
        logits = model(seq[None], use_cache=False).logits[0] / 2.0
        expected = logits.log_softmax(-1)[n_prompt - 1, seq[n_prompt]]
    torch.testing.assert_close(lp[2, 0], expected, atol=TOL, rtol=0)


def test_chunked_head_gradcheck_with_bias_and_temperature():
    from rlpad.core.logprob import chunked_log_probs_and_entropy

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (7,), generator=gen)

    def f(h, w, b):
        lp, ent = chunked_log_probs_and_entropy(h, w, labels, bias=b, temperature=0.8, chunk_size=3)
        return lp, ent

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_equal_length_sequences_batched_together_stay_exact():
    """Many sequences of a few distinct lengths: the varlen attention batches equal lengths."""
    model = tiny_model("mistral", vocab_size=VOCAB, seed=4)  # sliding window too
    b = rollout_batch(12, PROMPT, RESPONSE, vocab_size=VOCAB, seed=5)
    b["attention_mask"][:6] = b["attention_mask"][6]  # rows 0-6 share one layout: one group of 7
    b["attention_mask"][7:] = 1  # rows 7-11 are full length: another group
    b["input_ids"] = torch.where(b["attention_mask"].bool(), b["input_ids"].clamp(min=1), 0)
    b["position_ids"] = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    b["response_mask"] = b["attention_mask"][:, PROMPT:]
    with torch.no_grad():
        lp_rm, ent_rm = run(model, b, rmpad=True)
        lp_ref, ent_ref = alone(model, b)
    torch.testing.assert_close(lp_rm, lp_ref, atol=TOL, rtol=0)
    torch.testing.assert_close(ent_rm, ent_ref, atol=TOL, rtol=0)
