"""The LM head's fp64 reference and its error measure, shared by the CPU tests, the interpreter
check of the Triton kernel, the GPU lane and `rlpad bench head`."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FP32_SLACK", "HEAD_LP_BOUND", "fp32_logits_errors", "fp64_head", "head_bounds", "head_errors", "head_inputs"]

# Max |log-prob - fp64| and |entropy - fp64| of a head that keeps its logits in fp32 (issue #26's
# target); bf16-rounded logits are ~7e-3 at vocab 152064, fp16-rounded ~1e-3 at the tests' sizes.
HEAD_LP_BOUND = 5e-5
# ... or within this factor of fp32 logits from torch's own GEMM of the same bf16 rows: at hidden 3584 the
# bound sits at fp32's rounding there (the H200 run of 2026-11-27: torch's fp32 head itself 5.5e-5 on the
# 4800-token rows, every tile configuration of the fused head the same)
FP32_SLACK = 1.25


def fp64_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
              temperature: float = 1.0, *, round_logits_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_prob (N,), entropy (N,))`` in fp64 from full fp64 logits of the given (already rounded)
    inputs, differentiable. ``round_logits_to``: the logits rounded to that dtype first (what a head
    that writes bf16 logits computes: the negative control)."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if round_logits_to is not None:
        z = z.to(round_logits_to).double()
    z = z / temperature
    lse = z.logsumexp(dim=-1)
    return z.gather(-1, labels[:, None])[:, 0] - lse, lse - (z.softmax(dim=-1) * z).sum(dim=-1)


def fp32_logits_errors(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ref_lp: torch.Tensor,
                       ref_ent: torch.Tensor) -> tuple[float, float]:
    """Max |log-prob| / |entropy| error vs the fp64 ``ref_lp`` / ``ref_ent`` of fp32 logits from torch's
    GEMM (TF32 off) of the same rows: the floor a head keeping fp32 logits can reach on them."""
    z = (hidden.float() @ weight.float().t()).log_softmax(-1)
    lp = z.gather(-1, labels[:, None])[:, 0]
    ent = -(z.exp() * z).sum(-1)
    return (lp.double() - ref_lp).abs().max().item(), (ent.double() - ref_ent).abs().max().item()


def head_bounds(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ref_lp: torch.Tensor,
                ref_ent: torch.Tensor) -> tuple[float, float]:
    """``(log-prob bound, entropy bound)`` of a head on these rows: HEAD_LP_BOUND, or FP32_SLACK x what
    fp32 logits from torch's GEMM reach on them (:func:`fp32_logits_errors`), whichever is larger."""
    fp32_lp, fp32_ent = fp32_logits_errors(hidden, weight, labels, ref_lp, ref_ent)
    return max(HEAD_LP_BOUND, FP32_SLACK * fp32_lp), max(HEAD_LP_BOUND, FP32_SLACK * fp32_ent)


def head_inputs(tokens: int, hidden: int, vocab: int, *, dtype: torch.dtype, device: str | torch.device = "cpu",
                bias: bool = False, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Random head inputs (logits of a few nats' spread, like a trained LM's), the last label V-1,
    and random upstream gradients ``g_lp`` / ``g_ent`` (N,) fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    out = {"hidden": randn(tokens, hidden).to(dtype), "weight": (randn(vocab, hidden) * (2.0 / hidden**0.5)).to(dtype),
           "bias": (randn(vocab) * 0.5).to(dtype) if bias else None,
           "labels": torch.randint(0, vocab, (tokens,), generator=gen, device=device),
           "g_lp": randn(tokens), "g_ent": randn(tokens)}
    out["labels"][-1] = vocab - 1
    return out


def head_errors(head: Callable, x: dict, temperature: float = 1.0, *, entropy_grad: bool = True,
                lp_grad: bool = True) -> dict[str, float]:
    """Run ``head(hidden, weight, labels, bias, temperature) -> (log_prob, entropy)`` and the fp64
    reference on the same inputs ``x`` (:func:`head_inputs`), backward of ``g_lp . lp + g_ent . ent``
    (either term dropped by the flags); returns max |error| of log-prob / entropy (``lp_max``,
    ``ent_max``) and each gradient's relative error ``|g - g64| / |g64|`` (``grad_hidden`` ...)."""
    names = [k for k in ("hidden", "weight", "bias") if x[k] is not None]
    got, ref = ({k: x[k].detach().clone().requires_grad_() for k in names},
                {k: x[k].detach().double().requires_grad_() for k in names})
    out = {}
    for side, p in (("got", got), ("ref", ref)):
        fn = head if side == "got" else fp64_head
        lp, ent = fn(p["hidden"], p["weight"], x["labels"], p.get("bias"), temperature)
        out[side] = (lp.detach().double(), ent.detach().double())
        terms = [(lp * x["g_lp"].to(lp.dtype)).sum()] if lp_grad else []
        terms += [(ent * x["g_ent"].to(ent.dtype)).sum()] if entropy_grad else []
        sum(terms).backward()
    errs = {"lp_max": (out["got"][0] - out["ref"][0]).abs().max().item(),
            "ent_max": (out["got"][1] - out["ref"][1]).abs().max().item()}
    for k in names:
        g, g64 = got[k].grad.double(), ref[k].grad
        errs[f"grad_{k}"] = ((g - g64).norm() / g64.norm().clamp(min=1e-300)).item()
    return errs
