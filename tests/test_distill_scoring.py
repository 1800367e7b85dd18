"""What distillation reads from the packed row: the teacher's top-k and tail in vocabulary chunks, the
student's log-probs at given ids, its tail, its sampled tokens and entropy through ONE pass of the chunked
head, the teacher's log-probs of the sampled tokens; each against an independent fp64 computation, with
negative controls that must fail the bound. (The tails near a top-k mass of 1: tests/test_distill_tail.py.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlpad.core.distill_scoring import (compute_student_topk, compute_teacher_topk, jagged_positions, join_rows,
                                        split_rows)
from rlpad.core.forward import compute_log_probs
from rlpad.core.logprob import chunked_log_probs_and_entropy, chunked_log_probs_at
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


def with_tail(log_softmax: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``(..., K + 1)``: the log-probs at ``ids (..., K)``, then the log of the mass outside them (fp64)."""
    outside = torch.ones_like(log_softmax, dtype=torch.bool).scatter_(-1, ids.long(), False)
    tail = torch.where(outside, log_softmax, -torch.inf).logsumexp(-1, keepdim=True)
    return torch.cat([log_softmax.gather(-1, ids.long()), tail], dim=-1)


@pytest.mark.parametrize("tokens,token_chunk,vocab_chunk,k", [(13, 5, 7, 4), (9, 9, 53, 1), (6, 2, 3, 10), (1, 4, 16, 53)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_in_vocabulary_chunks_equals_torch_topk_of_full_log_softmax(tokens, token_chunk, vocab_chunk, k, temperature):
    hidden, weight, bias, exact = head(tokens, 24, 53, torch.float64, seed=tokens + k)
    ids, lp = teacher_topk(hidden, weight, k, bias=bias, temperature=temperature, token_chunk=token_chunk,
                           vocab_chunk=vocab_chunk)
    full = fp64_log_softmax(*exact, temperature)
    ref = full.topk(k, dim=-1)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref.indices)
    torch.testing.assert_close(lp, with_tail(full, ref.indices), atol=1e-12, rtol=0)  # k = 53: the tail is -inf
    # fp32 operands: the same ids, log-probs and tail within the fp32 bound
    ids32, lp32 = teacher_topk(hidden.float(), weight.float(), k, bias=bias.float(), temperature=temperature,
                               token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    assert torch.equal(ids32.long(), ref.indices)
    assert (lp32.double() - with_tail(full, ref.indices)).nan_to_num(neginf=0).abs().max() < TOL


def test_topk_of_a_padded_head_chooses_among_the_tokenizer_rows_and_softmaxes_over_all():
    hidden, weight, bias, exact = head(7, 16, TEACHER_VOCAB, torch.float32, seed=3)
    bias[TOKENIZER_VOCAB + 2] = 30.0  # a padding row the head likes: in the tail, never in the top-k
    full = fp64_log_softmax(exact[0], exact[1], bias)
    ids, lp = teacher_topk(hidden, weight, 5, bias=bias, vocab_chunk=32, candidates=TOKENIZER_VOCAB)
    ref = full[:, :TOKENIZER_VOCAB].topk(5, dim=-1)
    assert torch.equal(ids.long(), ref.indices) and (lp.double() - with_tail(full, ref.indices)).abs().max() < TOL
    assert int(ids.max()) < TOKENIZER_VOCAB and float(lp[:, -1].exp().min()) > 0.99  # the padding row's mass


@pytest.mark.parametrize("chunk", [4, 13])
def test_one_head_pass_gives_labels_ids_tail_and_entropy_with_gradients(chunk):
    """chunked_log_probs_at: the sampled tokens' log-probs, the entropy, the log-probs at K ids and the tail,
    all from one pass, against a full fp64 softmax; the labels' numbers equal the plain head's bit for bit."""
    hidden, weight, bias, exact = head(13, 24, 53, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(53, generator=gen)[:6] for _ in range(13)]).int()
    ids[0] = torch.arange(47, 53)  # the last rows of the head
    labels = torch.randint(0, 53, (13,), generator=gen)
    g_at, g_lp, g_ent = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((13, 7), (13,), (13,)))
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    at, lp, ent = chunked_log_probs_at(leaves[0], leaves[1], ids, labels=labels, bias=leaves[2], temperature=0.8,
                                       chunk_size=chunk, calculate_entropy=True)
    ((at.double() * g_at).sum() + (lp.double() * g_lp).sum() + (ent.double() * g_ent).sum()).backward()
    ref_leaves = [x.clone().requires_grad_() for x in exact]
    full = fp64_log_softmax(*ref_leaves, 0.8)
    ref_at, ref_lp, ref_ent = with_tail(full, ids), full.gather(-1, labels[:, None])[:, 0], -(full.exp() * full).sum(-1)
    ((ref_at * g_at).sum() + (ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    for got, want in ((at, ref_at), (lp, ref_lp), (ent, ref_ent)):
        assert (got.detach().double() - want.detach()).abs().max() < TOL
    for got, want in zip(leaves, ref_leaves):
        rel = (got.grad.double() - want.grad).norm() / want.grad.norm()
        assert rel < FP32_GRAD_REL, rel
    plain_lp, plain_ent = chunked_log_probs_and_entropy(hidden, weight, labels, bias=bias, temperature=0.8,
                                                        chunk_size=chunk)
    assert torch.equal(plain_lp, lp.detach()) and torch.equal(plain_ent, ent.detach())
    # negative control: the tail of the wrong ids (the student's own top-k) is far outside the bound
    own = full.detach().topk(6, dim=-1).indices
    assert (with_tail(full.detach(), own)[:, -1] - at.detach()[:, -1].double()).abs().max() > 100 * TOL


def test_the_sampled_tokens_do_not_depend_on_the_ids_on_the_cuda_arithmetic():
    """On CUDA in bf16 the distilling actor's old log-probs (no ids) and its update (K ids + tail) both run the
    torch_cuda arithmetic (run here on the CPU): the sampled tokens' log-probs and entropies are bit-identical,
    so the first mini-batch's ratio is exactly 1 there too."""
    hidden, weight, bias, _ = head(13, 24, 53, torch.bfloat16, seed=8)
    ids = torch.stack([torch.randperm(53, generator=torch.Generator().manual_seed(r))[:6] for r in range(13)]).int()
    labels = torch.randint(0, 53, (13,), generator=torch.Generator().manual_seed(3))
    kw = dict(labels=labels, bias=bias, chunk_size=4, calculate_entropy=True, head="torch_cuda")
    _, old_lp, old_ent = chunked_log_probs_at(hidden, weight, ids[:, :0], **kw)
    at, lp, ent = chunked_log_probs_at(hidden, weight, ids, **kw)
    assert torch.equal(old_lp, lp) and torch.equal(old_ent, ent) and at.dtype == torch.float32


class LogitGemms(TorchDispatchMode):
    """Counts the GEMMs that produce logits: (n, vocab) outputs of aten mm / addmm."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == self.vocab:
            self.count += 1
        return out


def test_one_head_pass_runs_the_logits_gemm_once_per_chunk():
    """The sampled tokens AND the K ids from one logits GEMM per chunk in forward, one recompute per chunk
    in backward."""
    hidden, weight, bias, _ = head(13, 24, 53, torch.float32, seed=6)
    ids = torch.stack([torch.randperm(53, generator=torch.Generator().manual_seed(r))[:6] for r in range(13)]).int()
    labels = torch.randint(0, 53, (13,), generator=torch.Generator().manual_seed(0))
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    with LogitGemms(53) as forward:
        at, lp, ent = chunked_log_probs_at(leaves[0], leaves[1], ids, labels=labels, bias=leaves[2], chunk_size=5,
                                           calculate_entropy=True)
    with LogitGemms(53) as backward:
        (at.sum() + lp.sum() + ent.sum()).backward()
    assert forward.count == backward.count == 3  # ceil(13 / 5) chunks


@pytest.fixture(scope="module")
def models():
    teacher = tiny_model("qwen2", vocab_size=TEACHER_VOCAB, seed=7)
    student = tiny_model("llama", vocab_size=STUDENT_VOCAB, seed=1)
    return teacher, student


@pytest.fixture(scope="module")
def batch():
    return rollout_batch(5, PROMPT, RESPONSE, vocab_size=TOKENIZER_VOCAB, seed=4)


def alone(model, batch):
    """Each sequence by itself, the full logits in fp64: ``(lp of the sampled token, log-softmax rows)``."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lp = torch.zeros(ids.shape[0], RESPONSE, dtype=torch.float64)
    rows = {}
    for r in range(ids.shape[0]):
        seq = ids[r][mask[r].bool()]
        n_prompt = int(mask[r, :PROMPT].sum())
        with torch.no_grad():
            logp = model(seq[None], use_cache=False).logits[0].double().log_softmax(-1)
        for t in range(int(mask[r, PROMPT:].sum())):
            pos = n_prompt + t - 1
            lp[r, t] = logp[pos, seq[pos + 1]]
            rows[(r, t)] = logp[pos]
    return lp, rows


def args(batch):
    return batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE


def positions(batch) -> list[tuple[int, int]]:
    """The scored (row, column) pairs in the jagged layout's order: row after row."""
    return [tuple(p) for p in batch["response_mask"].bool().nonzero().tolist()]


@pytest.mark.parametrize("rmpad", [True, False])
def test_teacher_on_the_packed_row_equals_each_sequence_alone(models, batch, rmpad):
    teacher, _ = models
    ref_lp, ref_rows = alone(teacher, batch)
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
    assert ids.shape == (int(scored.sum()), 6) and tlp.shape == (int(scored.sum()), 7) and ids.dtype == torch.int32
    for j, (r, t) in enumerate(positions(batch)):  # the jagged layout: scored positions only, row after row
        want = ref_rows[(r, t)][:TOKENIZER_VOCAB].topk(6).indices  # ids among the tokenizer's, softmax over all rows
        assert torch.equal(ids[j].long(), want)
        assert (tlp[j].double() - with_tail(ref_rows[(r, t)], want)).abs().max() < TOL
    rows = split_rows(ids, scored)
    assert len(rows) == scored.shape[0] and torch.equal(join_rows(rows), ids)
    assert all(r.untyped_storage().nbytes() == r.nbytes for r in rows)  # own storage: a row pickles alone


def test_student_one_pass_at_the_teachers_topk_and_the_negative_control(models, batch):
    teacher, student = models
    ids, _ = compute_teacher_topk(teacher, *args(batch), topk=6, vocab_size=TOKENIZER_VOCAB, use_remove_padding=True)
    ref_lp, student_rows = alone(student, batch)
    with LogitGemms(STUDENT_VOCAB) as gemms:
        lp, ent, at, idx = compute_student_topk(student, *args(batch), at_ids=ids, use_remove_padding=True,
                                                logits_chunk_size=5, calculate_entropy=True)
    scored = batch["response_mask"].bool()
    assert gemms.count == -(-int(scored.sum()) // 5)  # one logits GEMM per chunk: sampled tokens and ids at once
    assert at.requires_grad and at.shape == (int(scored.sum()), 7)
    where = jagged_positions(scored, idx)
    worst, own_topk = 0.0, []
    for j in range(idx.numel()):
        r, t = divmod(int(idx[j]), RESPONSE)
        row = student_rows[(r, t)]
        worst = max(worst, float((at[j].detach().double() - with_tail(row, ids[where[j]])).abs().max()))
        own_topk.append(with_tail(row, row.topk(6).indices))
    assert worst < TOL
    assert (lp.detach().double() - ref_lp)[scored].abs().max() < TOL
    plain, plain_ent = compute_log_probs(student, *args(batch), use_remove_padding=True, logits_chunk_size=5,
                                         calculate_entropy=True)
    assert torch.equal(plain, lp.detach()) and torch.equal(plain_ent, ent.detach())  # the old log-probs' arithmetic
    # negative control: the student's own top-k in place of the teacher's is far outside the bound
    assert (at.detach().double() - torch.stack(own_topk)).abs().max() > 100 * TOL


def test_bad_topk_and_vocab_size_are_refused_before_compute(models, batch):
    teacher, student = models
    with pytest.raises(ValueError, match="topk must be an int in"):
        compute_teacher_topk(teacher, *args(batch), topk=0, use_remove_padding=True)
    with pytest.raises(ValueError, match="vocab_size must be an int in"):
        compute_teacher_topk(teacher, *args(batch), topk=2, vocab_size=TEACHER_VOCAB + 1, use_remove_padding=True)
    with pytest.raises(ValueError, match="ids must lie in"):
        chunked_log_probs_at(torch.zeros(2, 4), torch.zeros(5, 4), torch.tensor([[0, 5], [1, 2]]))
    with pytest.raises(ValueError, match="at_ids must be"):
        compute_student_topk(student, *args(batch), at_ids=torch.zeros(3, 2, dtype=torch.int32), use_remove_padding=True)


def test_the_heads_chunk_by_a_byte_budget_by_default():
    """logits_chunk_size null: the student's head (and the teacher's top-k) run in chunks whose fp32 logits
    fit rlpad.core.lm_head.HEAD_CHUNK_BYTES: 220 tokens at Qwen's 151936 rows (before: one chunk of all N
    tokens, an (N, V) fp32 block: +1.3 GiB at N = 1024)."""
    from rlpad.core.lm_head import HEAD_CHUNK_BYTES, chunk_tokens

    vocab = 151936
    assert chunk_tokens(None, vocab) == HEAD_CHUNK_BYTES // (4 * vocab) == 220 and chunk_tokens(64, vocab) == 64
    student = tiny_model("qwen2", vocab_size=vocab, hidden_size=8, head_dim=4, intermediate_size=8, seed=1)
    big = rollout_batch(64, PROMPT, RESPONSE, vocab_size=TOKENIZER_VOCAB, seed=5)
    n = int(big["response_mask"].sum())
    with torch.no_grad(), LogitGemms(vocab) as gemms:
        compute_student_topk(student, *args(big), use_remove_padding=True)
    assert n > 220 and gemms.count == -(-n // 220)
    with torch.no_grad(), LogitGemms(vocab) as gemms:
        compute_student_topk(student, *args(big), use_remove_padding=True, logits_chunk_size=n)  # negative control
    assert gemms.count == 1
