"""forward_kl_topk's tail bucket when the top-k holds nearly all the mass: the teacher's tail (rlpad.core.topk)
and the student's (rlpad.core.logprob.chunked_log_probs_at), each a log-sum-exp over the logits outside the
ids, and the KL's gradient through them, in fp32 against fp64 for tail masses from 1e-1 down to 1e-9.

The head is the identity (H = V), so the fp32 logits are the hidden states exactly and the fp64 reference
reads the same logits. Negative control: the tail as ``log(1 - sum_k q_k)`` of the fp32 top-k (rlpad's
earlier computation, floored at -eps once the sum rounds to 1) misses the gradient by far more than the bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlpad.algorithms.distillation import topk_forward_kl
from rlpad.core.logprob import chunked_log_probs_at
from rlpad.core.topk import teacher_topk

pytestmark = pytest.mark.exactness

V, K = 64, 8
TAILS = (1e-1, 1e-3, 1e-5, 1e-6, 1e-7, 1e-9)
# fp32 logits of size <= 25: each log-sum-exp and log-prob carries ~1e-6 absolute error (measured: <= 3.4e-7
# relative on every figure here); the earlier subtraction 1 - sum_k q_k is off by ~6e-8 / tail: 7% at 1e-6.
BOUND = 1e-5


def logits(top_mass: float, seed: int) -> torch.Tensor:
    """fp32 logits (1, V): ids 0..K-1 share ``top_mass`` unevenly, the other V - K ids the rest evenly."""
    g = torch.Generator().manual_seed(seed)
    shape = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
    p = torch.cat([shape / shape.sum() * top_mass, torch.full((V - K,), (1 - top_mass) / (V - K), dtype=torch.float64)])
    return p.log().float().view(1, V)


def fp64_coarse(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(1, K + 1) fp64 log-probs of ``ids`` then of the rest, from logits ``z`` (promoted)."""
    lp = z.double().log_softmax(-1)
    rest = torch.ones(V, dtype=torch.bool)
    rest[ids] = False
    return torch.cat([lp[:, ids], lp[:, rest].logsumexp(-1, keepdim=True)], dim=-1)


@pytest.mark.parametrize("tail", TAILS)
def test_teacher_tail_is_exact_down_to_1e_9(tail):
    z = logits(1 - tail, seed=1)
    ids, lp = teacher_topk(z, torch.eye(V), K, vocab_chunk=11)
    assert ids.dtype == torch.int32 and sorted(ids[0].tolist()) == list(range(K))
    want = fp64_coarse(z, ids[0].long())
    assert abs(math.exp(lp[0, K].item()) / math.exp(want[0, K].item()) - 1) < BOUND  # the tail's mass, relative
    assert (lp.double() - want).abs().max() < BOUND


@pytest.mark.parametrize("tail", TAILS)
def test_student_tail_and_the_kl_gradient_are_exact_down_to_1e_9(tail):
    teacher = logits(1 - 1e-2, seed=2)
    t_ids, t_lp = teacher_topk(teacher, torch.eye(V), K)
    hidden = logits(1 - tail, seed=3).requires_grad_()
    at, _, _ = chunked_log_probs_at(hidden, torch.eye(V), t_ids, chunk_size=1)
    kl, _ = topk_forward_kl(t_lp, at)
    kl.sum().backward()
    ref_z = hidden.detach().double().requires_grad_()
    ids = t_ids[0].long()
    ref_kl, _ = topk_forward_kl(fp64_coarse(teacher, ids), fp64_coarse(ref_z, ids))
    ref_kl.sum().backward()
    assert abs(math.exp(at[0, K].item()) / math.exp(fp64_coarse(hidden.detach(), ids)[0, K].item()) - 1) < BOUND
    assert abs(kl.item() / ref_kl.item() - 1) < BOUND
    err = float((hidden.grad.double() - ref_z.grad).norm() / ref_z.grad.norm())
    assert err < BOUND, err
    # the push to give mass back to the tail (the gradient summed over the tail's ids), relative
    back = lambda g: float(g[0, K:].sum())  # noqa: E731
    assert abs(back(hidden.grad) / back(ref_z.grad) - 1) < BOUND
    # negative control: the tail as log(1 - sum_k q_k) in fp32, floored at -eps (the earlier computation):
    # 7% short at 1e-6, and from 1e-7 (the top-k mass rounds to 1) no push at all
    z = hidden.detach().clone().requires_grad_()
    top = z.log_softmax(-1)[:, ids]
    mass = top.logsumexp(-1, keepdim=True).clamp(max=-torch.finfo(torch.float32).eps)
    old, _ = topk_forward_kl(t_lp, torch.cat([top, torch.log(-torch.expm1(mass))], dim=-1))
    old.sum().backward()
    if tail <= 1e-6:
        assert abs(back(z.grad) / back(ref_z.grad) - 1) > 100 * BOUND
    if tail <= 1e-7:
        assert abs(back(z.grad)) < 1e-3 * abs(back(ref_z.grad))
