"""The half-precision exactness harness: an fp32 oracle, a boundary-leak control, errors and bounds.

A scoring path (padded, packed, shared-prompt) in bf16 is compared per token with an ORACLE:
the same bf16-rounded weights in fp32, every sequence run alone with no padding (log-softmax in
float64), so what remains is the half-precision compute error. Gradients are those of one
token-mean loss, ``mean(log_prob + 0.1 * entropy)`` over the valid response tokens.

The NEGATIVE CONTROL is a boundary leak: the packed row with position ids restarting per sequence
but ONE ``cu_seqlens`` segment, so attention crosses sequence boundaries (the bug remove-padding
must not have). :data:`BF16_BOUNDS` are set below what that leak gives (measured on CPU, see
tests/test_attention_bf16.py) and above the bf16 error of correct paths, so a path within them
has no leak of that size. Used by the CPU suite and the GPU lane (tests/gpu/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpad.core.attention import BOUNDS_KWARG, PackedBounds
from rlpad.core.forward import backbone_of, compute_log_probs
from rlpad.core.logprob import log_probs_and_entropy
from rlpad.core.padding import index_first_axis, pad_input, unpad_input

__all__ = ["BF16_BOUNDS", "ENGINE_LOGPROB_TOL", "FP32_GRAD_REL", "FP32_LOGPROB_TOL", "LEAK_DETECTING", "PathResult", "errors", "leaky_packed", "oracle", "scored", "violations"]

ENTROPY_WEIGHT = 0.1  # loss = token-mean of (log_prob + ENTROPY_WEIGHT * entropy)

# fp32 per-token bound (nats) between two correct scoring paths, or a path and the fp64 oracle: the
# project's fp32 exactness claim (`rlpad check`, the CPU suite). A log-prob or entropy |x| < 16 has
# ulp 2^-20 = 9.5e-7; padded vs packed differ by at most that one ulp on every CPU met (AMD EPYC
# AVX-512, Intel Xeon AMX, and each restricted to AVX2 kernels: 9.54e-7, `rlpad check`). 2e-5 = 21
# ulps leaves room for longer reductions (rounding grows ~ sqrt(terms) ulps) and stays 500x below the
# smallest bug the suite plants: a one-segment boundary leak moves later rows' log-probs > 1e-2.
FP32_LOGPROB_TOL = 2e-5
# fp32 gradients of one loss summed in another order (padded vs packed, micro-batches, ranks, shared
# prompts), compared as |g - g'| / |g| per parameter: each element sums N token contributions, and a
# reordered sum moves it by ~sqrt(N) eps relative (N ~ 1e3 tokens: 3.8e-6). A token dropped or counted
# twice moves a gradient by ~1/N >= 1e-3, a micro-batch weighted wrongly by far more.
FP32_GRAD_REL = 1e-5
# Per token, a rollout engine's log-probs (vLLM's CPU kernels) vs the actor's on the same fp32 weights:
# two kernel sets round through every layer differently (measured up to 9.5e-6: mismatch/abs_diff_max
# of the runs tests/run_compare.py compares; 10x that). A stale or wrong weight moves them by >= 1e-2.
ENGINE_LOGPROB_TOL = 1e-4

# Per-token errors against the oracle (nats, over valid response tokens) and gradient errors
# (all parameters as one vector): a path passes when every figure is within its bound.
# Measured on CPU (torch 2.13, bf16, the 4 tiny architectures, rollout and GRPO-shaped batches of
# tests/test_attention_bf16.py): correct paths (padded, packed, shared-prompt) vs the boundary leak.
BF16_BOUNDS: dict[str, float] = {
    "lp_max": 0.02,  # max |log-prob - oracle|: correct <= 2.5e-3, leak >= 0.18
    "lp_mean": 2.5e-3,  # mean |log-prob - oracle|: correct <= 6.7e-4, leak >= 5.3e-3
    "ent_max": 1e-3,  # max |entropy - oracle|: correct <= 2.3e-4, leak >= 2.3e-3
    "ent_mean": 2e-4,  # mean |entropy - oracle|: correct <= 5.3e-5, leak >= 6e-4 (8.6e-5 with a window of 8)
    "grad_rel": 0.05,  # |g - g_oracle| / |g_oracle|: correct <= 8e-3, leak >= 0.14
    "grad_cos_min": 0.998,  # cosine(g, g_oracle), a lower bound: correct >= 0.99997, leak <= 0.990
}
# The bounds every boundary leak exceeds (ent_mean only where no sliding window hides the leak).
LEAK_DETECTING = ("lp_max", "lp_mean", "ent_max", "grad_rel", "grad_cos_min")


@dataclass
class PathResult:
    """Per-token log-probs and entropies (B, R) in float64 on the CPU, and the loss gradients by
    parameter name (float32 on the CPU; None for a forward-only run)."""

    lp: torch.Tensor
    ent: torch.Tensor
    grads: dict[str, torch.Tensor] | None


def _finish(model, lp, ent, mask, backward: bool) -> PathResult:
    grads = None
    if backward:
        model.zero_grad(set_to_none=True)
        m = mask.to(lp.dtype)
        (((lp + ENTROPY_WEIGHT * ent) * m).sum() / m.sum()).backward()
        grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return PathResult(lp.detach().double().cpu(), ent.detach().double().cpu(), grads)


def scored(model, batch: dict[str, torch.Tensor], response_length: int, *, rmpad: bool, share: bool = False,
           backward: bool = True) -> PathResult:
    """One scoring path of rlpad (:func:`rlpad.core.forward.compute_log_probs`) on ``batch``."""
    with torch.set_grad_enabled(backward):
        lp, ent = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                    response_length, use_remove_padding=rmpad, share_prompts=share,
                                    calculate_entropy=True)  # fmt: skip
    return _finish(model, lp, ent, batch["attention_mask"][:, -response_length:], backward)


def oracle(model32, batch: dict[str, torch.Tensor], response_length: int, *, backward: bool = True) -> PathResult:
    """Every sequence alone through ``model32`` (fp32, plain sdpa), log-softmax in float64."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    prompt = ids.shape[1] - response_length
    lps, ents = [], []
    with torch.set_grad_enabled(backward):
        for row in range(ids.shape[0]):
            seq = ids[row][mask[row].bool()]
            n_prompt, n_resp = int(mask[row, :prompt].sum()), int(mask[row, prompt:].sum())
            logp = model32(seq[None], use_cache=False).logits[0].double().log_softmax(-1)
            pos = torch.arange(n_prompt - 1, n_prompt - 1 + n_resp, device=seq.device)
            pad = response_length - n_resp
            lps.append(torch.nn.functional.pad(logp[pos, seq[pos + 1]], (0, pad)))
            ents.append(torch.nn.functional.pad(-(logp[pos].exp() * logp[pos]).sum(-1), (0, pad)))
    return _finish(model32, torch.stack(lps), torch.stack(ents), mask[:, prompt:], backward)


def leaky_packed(model, batch: dict[str, torch.Tensor], response_length: int, *, backward: bool = True) -> PathResult:
    """The negative control: the packed row with restarting positions but one ``cu_seqlens`` segment,
    so every token also attends to the sequences packed before it."""
    ids, mask, positions = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    batch_size, seqlen = ids.shape
    prompt = seqlen - response_length
    packed, indices, _, _, _ = unpad_input(ids.unsqueeze(-1), mask)
    nnz = packed.shape[0]
    one = torch.tensor([0, nnz], dtype=torch.int32, device=ids.device)  # no boundary between sequences
    with torch.set_grad_enabled(backward):
        hidden = backbone_of(model)(
            input_ids=packed.view(1, -1), position_ids=index_first_axis(positions.reshape(-1, 1), indices).view(1, -1),
            attention_mask=None, use_cache=False, cu_seq_lens_q=one, cu_seq_lens_k=one, max_length_q=nnz,
            max_length_k=nnz, **{BOUNDS_KWARG: PackedBounds(one, nnz)},
        ).last_hidden_state[0]  # fmt: skip
        response_idx = mask[:, prompt:].reshape(-1).nonzero().flatten()
        rows, cols = response_idx // response_length, response_idx % response_length
        slot = torch.full((batch_size * seqlen,), -1, dtype=torch.long, device=ids.device)
        slot[indices] = torch.arange(nnz, device=ids.device)
        h = hidden.index_select(0, slot[rows * seqlen + prompt - 1 + cols])
        labels = ids[:, prompt:].reshape(-1)[response_idx]
        lp, ent = log_probs_and_entropy(model.get_output_embeddings()(h), labels, 1.0, True)
        lp = pad_input(lp.unsqueeze(-1), response_idx, batch_size, response_length).squeeze(-1)
        ent = pad_input(ent.unsqueeze(-1), response_idx, batch_size, response_length).squeeze(-1)
    return _finish(model, lp, ent, mask[:, prompt:], backward)


def errors(got: PathResult, ref: PathResult, mask: torch.Tensor) -> dict[str, float]:
    """Per-token max/mean |difference| of log-probs and entropies over ``mask`` (B, R), and, when
    both have gradients, the relative error and cosine of all gradients as one vector."""
    mask = mask.bool().cpu()
    out: dict[str, float] = {}
    for name, a, b in (("lp", got.lp, ref.lp), ("ent", got.ent, ref.ent)):
        diff = (a - b).abs()[mask]
        out[f"{name}_max"], out[f"{name}_mean"] = float(diff.max()), float(diff.mean())
    if got.grads is not None and ref.grads is not None:
        names = sorted(ref.grads)
        if sorted(got.grads) != names:
            raise ValueError(f"gradients of different parameters: {sorted(set(got.grads) ^ set(names))[:4]}")
        g = torch.cat([got.grads[n].double().flatten() for n in names])
        r = torch.cat([ref.grads[n].double().flatten() for n in names])
        out["grad_rel"] = float((g - r).norm() / r.norm())
        out["grad_cos_min"] = float(torch.nn.functional.cosine_similarity(g, r, dim=0))
    return out


def violations(errs: dict[str, float], bounds: dict[str, float] = BF16_BOUNDS) -> list[str]:
    """The figures of ``errs`` outside ``bounds`` (``*_min`` keys are lower bounds), as readable
    strings; NaN is outside every bound."""
    bad = []
    for key, bound in bounds.items():
        if key not in errs:
            continue
        value = errs[key]
        if not ((value >= bound) if key.endswith("_min") else (value <= bound)):
            bad.append(f"{key}={value:.3g} (bound {bound:g})")
    return bad
