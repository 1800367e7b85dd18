"""Two training runs that must agree: which metrics are compared, and to what bound.

The runs compared here do the same arithmetic in another order: another stack (local vs Ray: other
thread counts), another split over ranks or sequence-parallel ranks, another placement. So they agree
to rounding, not bitwise, and the bounds below are derived from that rounding, not from one
machine's run. Measured: Intel Xeon (AMX), default kernels and AVX2-only ones, 2026-11-26.

- Per token, a reordered fp32 forward moves a log-prob |lp| < 16 by a few ulps (ulp = 2^-20 =
  9.5e-7 there). After an update the two runs' weights differ by what AdamW made of gradients that
  differed in their last bits (Adam divides by sqrt(v), so a near-zero gradient element's rounding
  can move its update by up to lr): a log-ratio maximum after three updates differs by up to 9.5e-6
  (sp = 2 vs 1), and by 1.8e-5 between the same run on two vector units.
- A metric that is a mean of terms of size <= ~1 built on those log-probs (a loss with |advantage|
  <= 1.5 at n = 4, a KL, a ratio) differs by at most that per-token drift (every token moved the
  same way), however small its value: GRPO's ``pg_loss`` is a near-cancelling mean (5.7e-4 of terms
  ~1), so a relative bound on it measures cancellation, not error (relative spread measured: up to
  7.4e-5, absolute 2.2e-8). :data:`RUN_ABS` is that per-token scale, 1e-5.
- Metrics that scale with their value (``grad_norm``, entropies, log-ratio maxima) get
  :data:`RUN_REL`: 5-10x the worst relative spread measured on them (1.0e-5 between sp = 2 and 1,
  1.9e-5 between vector units).
- The bugs these comparisons guard move metrics far more: one token scored by the wrong position or
  dropped from a 700-token batch moves ``pg_loss`` by ~|A| / 700 ~ 1e-3 (100x RUN_ABS); a gradient
  0.1% off moves ``grad_norm`` by 1e-3 relative (10x RUN_REL); a loss normalised by a rank's own
  count instead of the global one moves it by tens of percent.
- Two runs' HF folders (trainer.save_hf) hold the same model up to that rounding, not byte for byte:
  measured on an Intel Xeon (AMX) with AVX2-only kernels, the local and the Ray stack's folders after 3
  steps differed in the last bit of one weight (issue 59). :func:`assert_same_hf_folder` holds every
  file but the weights byte for byte, every weight within what AdamW could move it apart (each update
  moves an element by at most lr x max |m_hat / sqrt(v_hat)|, the Cauchy-Schwarz bound of the update's
  ratio, :func:`adam_reach`, in each run) and the two models' log-probs of the same tokens within
  :data:`FOLDER_LOGPROB_ABS`: 5x the worst per-token drift measured between two runs' weights after
  three updates (1.8e-5, two vector units; above). One more step moves them by > 1e-3.
- ``mismatch/*`` (engine vs actor log-probs of the same weights, two kernel sets) is rounding noise by
  construction: means ~3e-7, maxima up to 10 ulps at |lp| < 16 (9.5e-6 measured). A maximum of noise
  differs between two runs by up to the maximum itself (measured 6.0e-6), so these are compared
  absolutely at that scale, :data:`NOISE_ABS`; an engine serving stale or wrong weights moves them by
  > 1e-3 (tests/test_rollout_correction_stacks.py).
"""

from __future__ import annotations

import pytest

__all__ = ["FOLDER_LOGPROB_ABS", "NOISE", "NOISE_ABS", "RUN_ABS", "RUN_REL", "WALL_CLOCK", "adam_reach",
           "assert_same_hf_folder", "assert_same_metrics", "compared_keys"]

WALL_CLOCK = ("timing_s/", "tokens_per_s/", "worker_s/", "async/overlap", "async/gen_s",  # differ in any two runs
              "stream/engine_idle_share", "stream/trainer_wait_share")
RUN_REL = 1e-4  # metrics that scale with their value: 5-10x the worst relative spread measured (1.0e-5, 1.9e-5)
RUN_ABS = 1e-5  # means of terms <= 1 built on log-probs: the per-token drift between two orders (<= 9.5e-6)
NOISE = "mismatch/"  # in a key (``val/mismatch/`` too): rounding noise by construction
NOISE_ABS = 5e-5  # 5x the largest noise maximum measured (9.5e-6); rel 0
FOLDER_LOGPROB_ABS = 1e-4  # two runs' saved models, per token: 5x the worst drift measured after 3 updates (1.8e-5)


def compared_keys(a: dict, b: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """The numeric metrics of two step records, less wall-clock figures (both must hold the same ones)."""
    keys = [{k for k in r if k != "step" and not k.startswith(WALL_CLOCK + skip)} for r in (a, b)]
    assert keys[0] == keys[1], sorted(keys[0] ^ keys[1])
    return [k for k in a if k in keys[0] and isinstance(a[k], (int, float))]


def assert_same_metrics(a: dict[int, dict], b: dict[int, dict], steps=None, skip: tuple[str, ...] = (),
                        rel: float = RUN_REL, abs_: float = RUN_ABS) -> int:
    """Every compared metric of ``steps`` (default: all of ``a``'s) agrees within ``rel`` / ``abs_``;
    returns how many values were compared. The message names the step, the key and both values."""
    compared = 0
    for step in sorted(a) if steps is None else steps:
        for key in compared_keys(a[step], b[step], skip):
            x, y = a[step][key], b[step][key]
            bound = dict(rel=0, abs=NOISE_ABS) if NOISE in key else dict(rel=rel, abs=abs_)
            assert x == pytest.approx(y, **bound), f"step {step}: {key} {x!r} vs {y!r}"
            compared += 1
    return compared


def adam_reach(lr: float, updates: int, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.01,
               weight_max: float = 1.0) -> float:
    """The most one element can move in ``updates`` AdamW updates at ``lr``, whatever the gradients: update t
    moves it by lr x |m_hat_t / sqrt(v_hat_t)| (at most sqrt(sum_k a_k^2 / b_k) over the bias-corrected
    weights a_k of m and b_k of v, by Cauchy-Schwarz) plus lr x weight_decay x |w| (|w| <= ``weight_max``)."""
    b1, b2 = betas
    reach = 0.0
    for t in range(1, updates + 1):
        a = [(1 - b1) * b1 ** (t - k) / (1 - b1 ** t) for k in range(1, t + 1)]
        b = [(1 - b2) * b2 ** (t - k) / (1 - b2 ** t) for k in range(1, t + 1)]
        reach += lr * (sum(x * x / y for x, y in zip(a, b)) ** 0.5 + weight_decay * weight_max)
    return reach


def assert_same_hf_folder(a: str, b: str, reach: float, rows: int = 8, length: int = 24) -> float:
    """Two HF folders hold the same model up to rounding (see the module doc): the same files, every file but
    ``*.safetensors`` byte for byte; the same tensors (names, shapes, dtypes), each element of the two within
    ``2 x reach`` (both runs moved by at most :func:`adam_reach` from the same start); the two models' fp32
    log-probs of ``rows`` x ``length`` random tokens within :data:`FOLDER_LOGPROB_ABS`. Returns the largest
    log-prob difference; the message names the file or tensor that differs."""
    import os

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)), (names, sorted(os.listdir(b)))
    for name in names:
        if not name.endswith(".safetensors"):
            with open(os.path.join(a, name), "rb") as x, open(os.path.join(b, name), "rb") as y:
                assert x.read() == y.read(), name
            continue
        x, y = load_file(os.path.join(a, name)), load_file(os.path.join(b, name))
        assert sorted(x) == sorted(y), name
        for key in x:
            assert (x[key].shape, x[key].dtype) == (y[key].shape, y[key].dtype), key
            gap = float((x[key].double() - y[key].double()).abs().max()) if x[key].numel() else 0.0
            assert gap <= 2 * reach, f"{name}: {key} differs by {gap:.3g} > 2 x {reach:.3g}"
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (a, b)]
    ids = torch.randint(0, models[0].config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lps = [m(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]) for m in models]
    drift = float((lps[0] - lps[1]).abs().max())
    assert drift <= FOLDER_LOGPROB_ABS, f"log-probs of the two models differ by up to {drift:.3g} > {FOLDER_LOGPROB_ABS}"
    return drift
