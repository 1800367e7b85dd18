"""Shared-prompt forward (rlpad.core.shared_prompt): each prompt once per group, exact per token."""

import pytest
import torch

from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL
from rlpad.core.forward import compute_log_probs
from rlpad.core.layout import position_ids_from_mask
from rlpad.core.shared_prompt import pack_shared_prompts, prompt_groups
from rlpad.core.value import ValueModel
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

ARCHS = sorted(ARCHITECTURES)  # qwen2 (GQA, tied), llama (MHA), mistral (sliding window 8), qwen3 (qk-norm)
PROMPT, RESPONSE, VOCAB = 14, 10, 128
TOL = FP32_LOGPROB_TOL  # derivation: rlpad/embedded/exactness.py


def make_batch(shuffle: bool) -> dict[str, torch.Tensor]:
    """4 groups of 3 (prompts of different lengths, some longer than mistral's window of 8, row 0
    full length, row 1 a 1-token response) + a group of 1 appended."""
    b = grpo_batch(4, 3, PROMPT, RESPONSE, vocab_size=VOCAB, seed=1, shuffle=shuffle, min_prompt=2)
    single = grpo_batch(2, 1, PROMPT, RESPONSE, vocab_size=VOCAB, seed=8, min_prompt=2)  # row 1: a random prompt
    out = {k: torch.cat([b[k], single[k][1:]]) for k in ("input_ids", "attention_mask")}
    out["position_ids"] = position_ids_from_mask(out["attention_mask"])
    out["response_mask"] = out["attention_mask"][:, PROMPT:]
    out["group"] = torch.cat([b["group"], torch.tensor([4])])
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["contiguous", "shuffled"])
def batch(request):
    b = make_batch(request.param)
    assert b["attention_mask"].all(-1).any()  # a full-length row
    assert (b["response_mask"].sum(-1) == 1).any()  # a 1-token response
    assert len(set(b["attention_mask"][:, :PROMPT].sum(-1).tolist())) >= 3  # prompts of different lengths
    return b


def run(model, b, share, **kw):
    return compute_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE,
                             use_remove_padding=True, share_prompts=share, calculate_entropy=True, **kw)  # fmt: skip


def alone(model, b):
    """Each sequence run by itself, no padding, no packing: the independent reference."""
    ids, mask = b["input_ids"], b["attention_mask"]
    lp, ent = torch.zeros(ids.shape[0], RESPONSE), torch.zeros(ids.shape[0], RESPONSE)
    for row in range(ids.shape[0]):
        seq = ids[row][mask[row].bool()]
        n_prompt = int(mask[row, :PROMPT].sum())
        logp = model(seq[None], use_cache=False).logits[0].double().log_softmax(-1)
        for t in range(int(mask[row, PROMPT:].sum())):
            pos = n_prompt + t - 1
            lp[row, t] = logp[pos, seq[pos + 1]]
            ent[row, t] = -(logp[pos].exp() * logp[pos]).sum()
    return lp, ent


def test_groups_found_wherever_rows_sit(batch):
    groups = prompt_groups(batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    expected: dict[int, list[int]] = {}
    for row, g in enumerate(batch["group"].tolist()):
        expected.setdefault(g, []).append(row)
    assert sorted(groups) == sorted(expected.values())
    assert [len(g) for g in groups].count(1) == 1  # the group of 1
    row = pack_shared_prompts(batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    mask = batch["attention_mask"]
    prompt_tokens = sum(int(mask[g[0], :PROMPT].sum()) for g in groups)
    assert row.input_ids.shape[1] == prompt_tokens + int(mask[:, PROMPT:].sum())  # each prompt once
    # Each varlen call's gathered tokens end exactly at its cu_seqlens[-1] (torch's varlen backward
    # gives NaN gradients for tokens past it), and the max lengths are the true ones.
    seg = row.segments
    for cu, index, longest in ((seg.prompt_cu, seg.prompt_index, seg.prompt_max),
                               (seg.resp_cu_q, seg.resp_index, seg.resp_max_q),
                               (seg.resp_cu_k, seg.resp_kv_index, seg.resp_max_k)):  # fmt: skip
        assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == index.numel()
        assert type(longest) is int and longest == int((cu[1:] - cu[:-1]).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_equals_each_sequence_alone(arch, batch):
    model = tiny_model(arch, vocab_size=VOCAB, seed=1)
    with torch.no_grad():
        lp, ent = run(model, batch, share=True)
        lp_ref, ent_ref = alone(model, batch)
    torch.testing.assert_close(lp, lp_ref, atol=TOL, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=TOL, rtol=0)
    pad = batch["response_mask"] == 0
    assert lp.shape == (len(batch["input_ids"]), RESPONSE)
    assert (lp[pad] == 0).all() and (ent[pad] == 0).all()


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_gradients_equal_the_rmpad_path(arch, batch):
    model = tiny_model(arch, vocab_size=VOCAB, seed=1)
    mask = batch["response_mask"].float()
    grads = []
    for share in (False, True):
        model.zero_grad()
        lp, ent = run(model, batch, share=share)
        (((lp + 0.1 * ent) * mask).sum() / mask.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        rel = (grads[1][name] - g).norm() / g.norm().clamp(min=1e-30)
        assert rel <= FP32_GRAD_REL, f"{name}: relative gradient difference {rel:.2e}"
    # The prompt's embeddings collect every response's contribution: a prompt-only token has a gradient.
    assert grads[1]["model.embed_tokens.weight"].abs().sum() > 0


def test_negative_control_responses_seeing_each_other_differ(batch):
    """The same packed row, but each group run as ONE causal sequence (responses see earlier
    responses of their group): must differ, so the exactness test can fail."""
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    row = pack_shared_prompts(ids, mask, pos, RESPONSE)
    seg = row.segments
    cu = torch.tensor([*seg.prompt_starts, seg.total], dtype=torch.int32)
    with torch.no_grad():
        good, _ = run(model, batch, share=True)
        hidden = model.model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False,
                             cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int((cu[1:] - cu[:-1]).max()),
                             max_length_k=int((cu[1:] - cu[:-1]).max())).last_hidden_state[0]  # fmt: skip
        logp = model.lm_head(hidden.index_select(0, row.score_index)).log_softmax(-1)
        response_idx = mask[:, PROMPT:].reshape(-1).nonzero().flatten()
        labels = ids[:, PROMPT:].reshape(-1)[response_idx]
        bad = torch.zeros(ids.shape[0] * RESPONSE)
        bad[response_idx] = logp.gather(-1, labels[:, None]).squeeze(-1)
        bad = bad.view(ids.shape[0], RESPONSE)
    groups = prompt_groups(ids, mask, pos, RESPONSE)
    firsts = [g[0] for g in groups]  # the first response of a group sees only its prompt either way
    later = [r for g in groups for r in g[1:]]
    torch.testing.assert_close(bad[firsts], good[firsts], atol=TOL, rtol=0)
    assert (bad[later] - good[later])[batch["response_mask"][later].bool()].abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_values_via_the_critic_path(arch, batch):
    vm = ValueModel(tiny_model(arch, vocab_size=VOCAB, seed=1), seed=5)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    with torch.no_grad():
        rmpad = vm(*args, use_remove_padding=True)
        shared = vm(*args, use_remove_padding=True, share_prompts=True)
        padded = vm(*args, use_remove_padding=False)  # independent of any packing
    torch.testing.assert_close(shared, padded, atol=TOL, rtol=0)
    torch.testing.assert_close(shared, rmpad, atol=TOL, rtol=0)
    assert (shared[batch["response_mask"] == 0] == 0).all()


def test_chunked_head_and_temperature_compose(batch):
    model = tiny_model("llama", vocab_size=VOCAB, seed=2)
    with torch.no_grad():
        ref, ref_ent = run(model, batch, share=False, temperature=0.7)
        got, got_ent = run(model, batch, share=True, temperature=0.7, logits_chunk_size=5)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
    torch.testing.assert_close(got_ent, ref_ent, atol=TOL, rtol=0)


def test_errors_before_compute(batch):
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    args = (model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    with pytest.raises(ValueError, match="share_prompts=True needs use_remove_padding"):
        compute_log_probs(*args, use_remove_padding=False, share_prompts=True)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="share_prompts=True needs the 'rlpad_varlen'"):
        compute_log_probs(*args, use_remove_padding=True, share_prompts=True)


def test_same_prompt_tokens_different_padding_value_share():
    """Padding slots do not count: rows with equal valid prompt tokens group even if pad ids differ;
    different positions for the same tokens do not group."""
    b = grpo_batch(1, 3, 6, 4, vocab_size=VOCAB, seed=1, min_prompt=3)
    b["input_ids"][1, 0] = 5 if not b["attention_mask"][1, 0] else b["input_ids"][1, 0]
    assert prompt_groups(b["input_ids"], b["attention_mask"], b["position_ids"], 4) == [[0, 1, 2]]
    shifted = b["position_ids"].clone()
    shifted[2] += 1
    assert prompt_groups(b["input_ids"], b["attention_mask"], shifted, 4) == [[0, 1], [2]]
