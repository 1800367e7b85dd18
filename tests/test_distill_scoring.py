"""What distillation reads from the packed row: the teacher's top-k in vocabulary chunks, the student's
log-probs at given ids through the chunked head, the teacher's log-probs of the sampled tokens; each
against an independent fp64 computation, with negative controls that must fail the bound."""

import pytest
import torch

from rlpad.core.distill_scoring import compute_log_probs_at, compute_teacher_topk
from rlpad.core.forward import compute_log_probs
from rlpad.core.logprob import chunked_log_probs_at
from rlpad.core.topk import teacher_topk
from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import tiny_model

pytestmark = pytest.mark.exactness

TOL = FP32_LOGPROB_TOL  # the project's fp32 bound (derivation: rlpad/embedded/exactness.py)
PROMPT, RESPONSE = 10, 8
TOKENIZER_VOCAB = 120  # the ids both models' tokenizer has; their heads are padded past it differently
TEACHER_VOCAB, STUDENT_VOCAB = 136, 128  # the 152064 vs 151936 situation, scaled down


def head(n, h, v, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(hidden), cast(weight), cast(b), (hidden, weight, b)


def fp64_log_softmax(hidden, weight, bias, temperature=1.0):
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    return (z / temperature).log_softmax(-1)


@pytest.mark.parametrize("tokens,token_chunk,vocab_chunk,k", [(13, 5, 7, 4), (9, 9, 53, 1), (6, 2, 3, 10), (1, 4, 16, 53)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_in_vocabulary_chunks_equals_torch_topk_of_full_log_softmax(tokens, token_chunk, vocab_chunk, k, temperature):
    hidden, weight, bias, exact = head(tokens, 24, 53, torch.float64, seed=tokens + k)
    ids, lp = teacher_topk(hidden, weight, k, bias=bias, temperature=temperature, token_chunk=token_chunk,
                           vocab_chunk=vocab_chunk)
    ref = fp64_log_softmax(*exact, temperature).topk(k, dim=-1)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(lp, ref.values, atol=1e-12, rtol=0)
    # fp32 operands: the same ids, log-probs within the fp32 bound
    ids32, lp32 = teacher_topk(hidden.float(), weight.float(), k, bias=bias.float(), temperature=temperature,
                               token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    assert torch.equal(ids32, ref.indices)
    assert (lp32.double() - ref.values).abs().max() < TOL


def test_topk_restricted_to_the_tokenizer_rows_is_a_softmax_over_them():
    hidden, weight, bias, exact = head(7, 16, TEACHER_VOCAB, torch.float32, seed=3)
    ids, lp = teacher_topk(hidden, weight[:TOKENIZER_VOCAB], 5, bias=bias[:TOKENIZER_VOCAB], vocab_chunk=32)
    ref = fp64_log_softmax(exact[0], exact[1][:TOKENIZER_VOCAB], exact[2][:TOKENIZER_VOCAB]).topk(5, dim=-1)
    assert torch.equal(ids, ref.indices) and (lp.double() - ref.values).abs().max() < TOL
    assert int(ids.max()) < TOKENIZER_VOCAB


@pytest.mark.parametrize("chunk", [4, 13])
def test_student_log_probs_at_ids_equal_a_full_softmax_gather_with_gradients(chunk):
    hidden, weight, bias, exact = head(13, 24, 53, torch.float32, seed=5)
    ids = torch.randint(0, 53, (13, 6), generator=torch.Generator().manual_seed(1))
    ids[0] = 52  # repeated ids in a row, and the last row of the head
    g = torch.randn(13, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    lp = chunked_log_probs_at(leaves[0], leaves[1], ids, bias=leaves[2], temperature=0.8, chunk_size=chunk)
    (lp.double() * g).sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in exact]
    ref = fp64_log_softmax(*ref_leaves, 0.8).gather(-1, ids)
    (ref * g).sum().backward()
    assert (lp.double() - ref).abs().max() < TOL
    for got, want in zip(leaves, ref_leaves):
        rel = (got.grad.double() - want.grad).norm() / want.grad.norm()
        assert rel < FP32_GRAD_REL, rel


@pytest.fixture(scope="module")
def models():
    teacher = tiny_model("qwen2", vocab_size=TEACHER_VOCAB, seed=7)
    student = tiny_model("llama", vocab_size=STUDENT_VOCAB, seed=1)
    return teacher, student


@pytest.fixture(scope="module")
def batch():
    return rollout_batch(5, PROMPT, RESPONSE, vocab_size=TOKENIZER_VOCAB, seed=4)


def alone(model, batch, vocab=None):
    """Each sequence by itself, the full logits in fp64: ``(lp of the sampled token, log-softmax rows)``."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lp = torch.zeros(ids.shape[0], RESPONSE, dtype=torch.float64)
    rows = {}
    for r in range(ids.shape[0]):
        seq = ids[r][mask[r].bool()]
        n_prompt = int(mask[r, :PROMPT].sum())
        with torch.no_grad():
            logits = model(seq[None], use_cache=False).logits[0].double()
        logp_full = logits.log_softmax(-1)
        logp = logits[:, :vocab].log_softmax(-1) if vocab else logp_full
        for t in range(int(mask[r, PROMPT:].sum())):
            pos = n_prompt + t - 1
            lp[r, t] = logp_full[pos, seq[pos + 1]]
            rows[(r, t)] = logp[pos]
    return lp, rows


def args(batch):
    return batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE


@pytest.mark.parametrize("rmpad", [True, False])
def test_teacher_on_the_packed_row_equals_each_sequence_alone(models, batch, rmpad):
    teacher, _ = models
    ref_lp, ref_rows = alone(teacher, batch, TOKENIZER_VOCAB)
    with torch.no_grad():
        lp, _ = compute_log_probs(teacher, *args(batch), use_remove_padding=rmpad)
    scored = batch["response_mask"].bool()
    assert (lp.double() - ref_lp)[scored].abs().max() < TOL
    # negative control: the teacher scoring a shifted token (the next one) is far outside the bound
    shifted = torch.zeros_like(ref_lp)
    for (r, t), row in ref_rows.items():
        shifted[r, t] = row[batch["input_ids"][r, PROMPT + t + 1] if t + 1 < RESPONSE else 0]
    assert (lp.double() - shifted)[scored].abs().max() > 100 * TOL
    ids, tlp = compute_teacher_topk(teacher, *args(batch), topk=6, vocab_size=TOKENIZER_VOCAB,
                                    use_remove_padding=rmpad, logits_chunk_size=7, vocab_chunk_size=29)
    for (r, t), row in ref_rows.items():
        want = row.topk(6)
        assert torch.equal(ids[r, t], want.indices)
        assert (tlp[r, t].double() - want.values).abs().max() < TOL
    assert (ids[~scored] == 0).all() and (tlp[~scored] == 0).all()


def test_student_log_probs_at_the_teachers_topk_and_the_negative_control(models, batch):
    teacher, student = models
    ids, _ = compute_teacher_topk(teacher, *args(batch), topk=6, vocab_size=TOKENIZER_VOCAB, use_remove_padding=True)
    _, student_rows = alone(student, batch, TOKENIZER_VOCAB)
    lp = compute_log_probs_at(student, *args(batch), ids, vocab_size=TOKENIZER_VOCAB, use_remove_padding=True,
                              logits_chunk_size=5)
    assert lp.requires_grad
    own_topk = torch.zeros_like(lp, dtype=torch.float64)
    worst = 0.0
    for (r, t), row in student_rows.items():
        worst = max(worst, float((lp[r, t].detach().double() - row[ids[r, t]]).abs().max()))
        own_topk[r, t] = row.topk(6).values
    assert worst < TOL
    # negative control: the student's own top-k in place of the teacher's is far outside the bound
    scored = batch["response_mask"].bool()
    assert (lp.detach().double() - own_topk)[scored].abs().max() > 100 * TOL


def test_bad_topk_and_vocab_size_are_refused_before_compute(models, batch):
    teacher, _ = models
    with pytest.raises(ValueError, match="topk must be an int in"):
        compute_teacher_topk(teacher, *args(batch), topk=0, use_remove_padding=True)
    with pytest.raises(ValueError, match="vocab_size must be an int in"):
        compute_teacher_topk(teacher, *args(batch), topk=2, vocab_size=TEACHER_VOCAB + 1, use_remove_padding=True)
    with pytest.raises(ValueError, match="ids must lie in"):
        chunked_log_probs_at(torch.zeros(2, 4), torch.zeros(5, 4), torch.tensor([[0, 5], [1, 2]]))
