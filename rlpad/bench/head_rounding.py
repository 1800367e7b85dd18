"""Why the fused LM head's log-probs sit above fp32's rounding at hidden 3584, and what promotion buys.

``python -m rlpad.bench.head_rounding [ROWS]``: the logits ``z = h . w`` of the 7B head's shape (bf16
inputs, :func:`rlpad.embedded.head_exactness.head_inputs`) summed over the hidden size by emulated
accumulators, each compared with fp64 on ``ROWS`` rows (the label's logit and the ``top`` logits that
carry the softmax's mass; the others' errors move the log-sum-exp by < 1e-3 of theirs):

* ``rn_sequential``: fp32 adds rounded to nearest, one product at a time (CUDA cores: torch's fp32 GEMM);
* ``tensor_core``: 16 exact products per step added into the fp32 accumulator with truncation (round
  toward zero): the tensor cores' accumulation (NVIDIA V100-H100; Fasi, Higham, Mikaitis and Pranesh,
  "Numerical behavior of NVIDIA tensor cores", 2021);
* ``tensor_core_pN``: the same, the partial sum moved out every ``N`` products by one fp32 add rounded to
  nearest (:data:`rlpad.core.lm_head_plan.PROMOTE`, the fused head's ``Tiles.promote``).

Products of bf16 values are exact in fp32, so the schemes differ by their additions alone. The
truncation's errors all point toward zero: they add up linearly over the 224 steps of hidden 3584,
where rounding to nearest cancels; that bias is the fused head's error on the GPU.
"""

from __future__ import annotations

import sys

import torch

from rlpad.embedded.head_exactness import head_inputs

__all__ = ["SCHEMES", "accumulation_errors"]

SCHEMES = ("rn_sequential", "tensor_core", "tensor_core_p256")
STEP = 16  # products a tensor-core step adds at once (bf16 mma k)


def _toward_zero(exact: torch.Tensor) -> torch.Tensor:
    """fp64 values rounded to fp32 toward zero (truncated)."""
    near = exact.float()
    return torch.where(near.double().abs() > exact.abs(), torch.nextafter(near, torch.zeros_like(near)), near)


def _sum(products: torch.Tensor, scheme: str) -> torch.Tensor:
    """fp32 sums over the last axis of exact ``products`` (fp64), by ``scheme``."""
    acc = torch.zeros(products.shape[:-1], dtype=torch.float32)
    if scheme == "rn_sequential":
        for k in range(products.shape[-1]):
            acc = acc + products[..., k].float()
        return acc.double()
    if not scheme.startswith("tensor_core"):
        raise ValueError(f"unknown scheme {scheme!r}; choose among {SCHEMES} or tensor_core_pN")
    every = int(scheme.rsplit("_p", 1)[1]) if "_p" in scheme else 0
    part = torch.zeros_like(acc)
    for k in range(0, products.shape[-1], STEP):
        part = _toward_zero(part.double() + products[..., k:k + STEP].sum(-1))
        if every and (k + STEP) % every == 0:
            acc, part = acc + part, torch.zeros_like(part)
    return (acc + part).double()


def accumulation_errors(rows: int = 32, *, hidden: int = 3584, vocab: int = 152064, top: int = 1024,
                        tokens: int = 19000, schemes=SCHEMES, seed: int = 19) -> dict[str, dict[str, float]]:
    """``{scheme: {"lp_max", "lp_mean", "dz_max", "dz_mean"}}``: log-prob and logit errors against fp64 on
    ``rows`` rows spread over ``tokens`` tokens of random head inputs (``seed``: the lane's 19000-token test's)."""
    x = head_inputs(tokens, hidden, vocab, dtype=torch.bfloat16, seed=seed)
    picked = torch.arange(0, tokens, tokens // rows)[:rows]
    h, w, labels = x["hidden"][picked].double(), x["weight"], x["labels"][picked]
    z64 = torch.cat([h @ w[i:i + 16384].double().t() for i in range(0, vocab, 16384)], 1)
    lp64 = z64.gather(1, labels[:, None])[:, 0] - z64.logsumexp(-1)
    cols = torch.cat([labels[:, None], z64.topk(top, dim=1).indices], 1)
    products = h[:, None, :] * w[cols].double()  # exact
    out = {}
    for scheme in schemes:
        z = _sum(products, scheme)
        dz = z - z64.gather(1, cols)
        lp = z[:, 0] - z64.scatter(1, cols, z).logsumexp(-1)
        err = (lp - lp64).abs()
        out[scheme] = {"lp_max": err.max().item(), "lp_mean": err.mean().item(), "dz_max": dz.abs().max().item(),
                       "dz_mean": dz.mean().item()}
    return out


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    schemes = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else SCHEMES
    for name, e in accumulation_errors(n, schemes=schemes).items():
        print(f"{name:18s} log-prob error max {e['lp_max']:.2e} mean {e['lp_mean']:.2e}; logit error max "
              f"{e['dz_max']:.2e}, mean {e['dz_mean']:+.2e}")
