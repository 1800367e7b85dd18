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
- ``mismatch/*`` (engine vs actor log-probs of the same weights, two kernel sets) is rounding noise by
  construction: means ~3e-7, maxima up to 10 ulps at |lp| < 16 (9.5e-6 measured). A maximum of noise
  differs between two runs by up to the maximum itself (measured 6.0e-6), so these are compared
  absolutely at that scale, :data:`NOISE_ABS`; an engine serving stale or wrong weights moves them by
  > 1e-3 (tests/test_rollout_correction_stacks.py).
"""

from __future__ import annotations

import pytest

__all__ = ["NOISE", "NOISE_ABS", "RUN_ABS", "RUN_REL", "WALL_CLOCK", "assert_same_metrics", "compared_keys"]

WALL_CLOCK = ("timing_s/", "tokens_per_s/", "worker_s/", "async/overlap", "async/gen_s")  # differ in any two runs
RUN_REL = 1e-4  # metrics that scale with their value: 5-10x the worst relative spread measured (1.0e-5, 1.9e-5)
RUN_ABS = 1e-5  # means of terms <= 1 built on log-probs: the per-token drift between two orders (<= 9.5e-6)
NOISE = "mismatch/"  # in a key (``val/mismatch/`` too): rounding noise by construction
NOISE_ABS = 5e-5  # 5x the largest noise maximum measured (9.5e-6); rel 0


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
