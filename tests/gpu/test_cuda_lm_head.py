"""The LM head on CUDA in bf16 against the fp64 reference (the CPU suite checks the same kernel in
fp16 / fp32 under Triton's interpreter, tests/test_lm_head.py): the fused Triton head (what the
dispatch picks) and the torch_cuda fallback, log-prob / entropy max error within HEAD_LP_BOUND, which
bf16-rounded logits (the old chunked path, run here too) must exceed; gradients w.r.t. hidden, weight
and bias within bf16's precision; the 7B head shape at 2048 tokens."""

import pytest
import torch

from rlpad.core.lm_head import TORCH, TORCH_CUDA, TRITON, head_path, triton_missing
from rlpad.core.logprob import chunked_log_probs_and_entropy
from rlpad.embedded.head_exactness import HEAD_LP_BOUND, fp64_head, head_bounds, head_errors, head_inputs

GRAD_REL = 1e-2  # bf16: dz and the gradients are rounded to bf16 (~4e-3 relative per element)


def named_head(chunk, path):
    def head(h, w, y, b, t):
        return chunked_log_probs_and_entropy(h, w, y, bias=b, temperature=t, chunk_size=chunk, head=path)
    return head


def triton_head(chunk):
    if triton_missing() is not None:  # CUDA torch ships Triton; a machine without it runs the torch_cuda head
        pytest.skip(f"needs triton (not installed): {triton_missing()}")
    return named_head(chunk, TRITON)


def torch_cuda_head(chunk):
    return named_head(chunk, TORCH_CUDA)


def rounded_head(chunk):  # the torch head in bf16, as before issue #26: logits rounded to bf16 (negative control)
    return named_head(chunk, TORCH)


def test_the_dispatch_picks_triton_in_bf16(record):
    x = head_inputs(4, 8, 16, dtype=torch.bfloat16, device="cuda")
    record(triton_missing=triton_missing(), path=head_path(x["hidden"], x["weight"]))
    if triton_missing() is not None:
        assert head_path(x["hidden"], x["weight"]) == TORCH_CUDA  # the fallback, never the bf16-rounded head
        pytest.skip(f"needs triton (not installed): {triton_missing()}")
    assert head_path(x["hidden"], x["weight"]) == TRITON
    assert head_path(x["hidden"].float(), x["weight"].float()) == "torch"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_head_vs_fp64_with_rounded_logits_control(temperature, bias, record):
    x = head_inputs(300, 256, 5003, dtype=torch.bfloat16, device="cuda", bias=bias, seed=int(bias))
    table = {}
    for chunk in (300, 64):  # one vocabulary slice in the backward; several
        table[f"triton/chunk{chunk}"] = head_errors(triton_head(chunk), x, temperature)
        table[f"torch_cuda/chunk{chunk}"] = head_errors(torch_cuda_head(chunk), x, temperature)
    table["rounded/chunk64"] = head_errors(rounded_head(64), x, temperature)
    record(errors=table, bound=HEAD_LP_BOUND, grad_rel=GRAD_REL)
    for name, errs in table.items():
        grads = max(v for k, v in errs.items() if k.startswith("grad_"))
        if name.startswith("rounded"):  # the control: outside the bound
            assert errs["lp_max"] > 10 * HEAD_LP_BOUND, (name, errs)
        else:
            assert errs["lp_max"] < HEAD_LP_BOUND and errs["ent_max"] < HEAD_LP_BOUND, (name, errs)
            assert grads < GRAD_REL, (name, errs)


def test_one_sided_gradients_and_one_token():
    x = head_inputs(1, 128, 1000, dtype=torch.bfloat16, device="cuda", bias=True, seed=3)
    errs = head_errors(triton_head(1), x, 1.3)
    assert errs["lp_max"] < HEAD_LP_BOUND and max(errs[k] for k in errs if k.startswith("grad_")) < GRAD_REL, errs
    x = head_inputs(200, 128, 1000, dtype=torch.bfloat16, device="cuda", seed=4)
    for lp_grad, ent_grad in ((True, False), (False, True)):
        errs = head_errors(triton_head(50), x, 1.0, lp_grad=lp_grad, entropy_grad=ent_grad)
        assert max(errs[k] for k in errs if k.startswith("grad_")) < GRAD_REL, (lp_grad, ent_grad, errs)


def test_7b_head_shape_errors_and_memory(record):
    """hidden 3584, vocab 152064, 2048 tokens: the issue's 5e-5 target at the real vocabulary; bf16
    rounding there is ~7e-3. Peak memory above the inputs of one forward+backward, chunk 1024."""
    x = head_inputs(2048, 3584, 152064, dtype=torch.bfloat16, device="cuda", seed=7)
    h, w = x["hidden"].requires_grad_(), x["weight"].requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = chunked_log_probs_and_entropy(h, w, x["labels"], chunk_size=1024)
    ((lp * x["g_lp"]).sum() + (ent * x["g_ent"]).sum()).backward()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    e = 512
    ref_lp, ref_ent = fp64_head(x["hidden"][:e].detach(), x["weight"].detach(), x["labels"][:e])
    rnd_lp, _ = fp64_head(x["hidden"][:e].detach(), x["weight"].detach(), x["labels"][:e], round_logits_to=torch.bfloat16)
    lp_err = (lp[:e].double() - ref_lp).abs().max().item()
    ent_err = (ent[:e].double() - ref_ent).abs().max().item()
    rounded_err = (rnd_lp - ref_lp).abs().max().item()
    record(tokens=2048, lp_err=lp_err, ent_err=ent_err, rounded_lp_err=rounded_err, peak_gib=peak_gib)
    assert lp_err < HEAD_LP_BOUND and ent_err < HEAD_LP_BOUND, (lp_err, ent_err)
    assert rounded_err > 10 * HEAD_LP_BOUND, rounded_err
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_19000_tokens_past_2_31_against_fp64_on_a_subset(record):
    """N = 19000 at the 7B head (N x V = 2.9e9 > 2^31, logits_chunk_size null: the dz slice bounded
    by bytes, 6 slices): log-prob / entropy of 384 rows spread over N (the last included) and their
    grad_hidden rows (row i depends on row i only) against fp64; grad_weight finite. The table's
    tiles and order, the peak above the inputs (issue #34's target: <= 10.5 GiB)."""
    from rlpad.core.lm_head_plan import dz_columns

    n, hidden, vocab = 19000, 3584, 152064
    x = head_inputs(n, hidden, vocab, dtype=torch.bfloat16, device="cuda", seed=19)
    h, w = x["hidden"].requires_grad_(), x["weight"].requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = chunked_log_probs_and_entropy(h, w, x["labels"], chunk_size=n)  # what logits_chunk_size null runs
    ((lp * x["g_lp"]).sum() + (ent * x["g_ent"]).sum()).backward()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    rows = torch.cat([torch.arange(0, n, 50, device="cuda")[:383], torch.tensor([n - 1], device="cuda")])
    h64 = x["hidden"][rows].detach().double().requires_grad_()
    ref_lp, ref_ent = fp64_head(h64, x["weight"].detach(), x["labels"][rows])
    ((ref_lp * x["g_lp"][rows]).sum() + (ref_ent * x["g_ent"][rows]).sum()).backward()
    lp_err = (lp[rows].double() - ref_lp).abs().max().item()
    ent_err = (ent[rows].double() - ref_ent).abs().max().item()
    g = h.grad[rows].double()
    grad_rel = ((g - h64.grad).norm() / h64.grad.norm()).item()
    slices = -(-vocab // dz_columns(n, vocab, 128, n, 2))
    lp_bound, ent_bound = head_bounds(x["hidden"][rows].detach(), x["weight"].detach(), x["labels"][rows],
                                      ref_lp.detach(), ref_ent.detach())
    record(tokens=n, rows=len(rows), lp_err=lp_err, ent_err=ent_err, grad_hidden_rel=grad_rel, peak_gib=peak_gib,
           dz_slices_at_block_v_128=slices, lp_bound=lp_bound, ent_bound=ent_bound)
    # within the bound, or as close as fp32 logits of torch's GEMM get on these rows. The H200 runs of 2026-11-27
    # and -28 read 5.16e-5 (256x128x32 tiles), 4.97e-5 (128x256x64): the tensor cores' truncating accumulation
    # over hidden 3584 biases the logits toward zero; the table's tiles now move the partial sums out every 256
    # products (rlpad.core.lm_head_plan.PROMOTE): ~1.6e-6 by the fp64 emulation of both accumulators
    assert lp_err < lp_bound, (lp_err, lp_bound)
    assert ent_err < ent_bound, (ent_err, ent_bound)
    assert grad_rel < GRAD_REL, grad_rel
    assert torch.isfinite(w.grad).all()
