"""`rlpad bench logprob`'s distillation memory rows measure one computation two ways: the full-logits and the
chunked variants agree on their result (small shape, in this process), and the table reports the ratios."""

import pytest
import torch

from rlpad.bench.head_memory import DISTILL_VARIANTS, head_fwd_bwd, head_inputs
from rlpad.bench.logprob import tables

pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("what", ["topk", "at_ids"])
def test_full_and_chunked_variants_compute_the_same(what):
    results, grads = {}, {}
    for variant in (f"{what}_full", f"{what}_chunked"):
        h, w, labels = head_inputs(37, 16, 211, device=torch.device("cpu"), dtype=torch.float64)
        results[variant] = head_fwd_bwd(variant, h, w, labels, chunk=8)
        grads[variant] = (h.grad.clone(), w.grad.clone())
    assert abs(results[f"{what}_full"] - results[f"{what}_chunked"]) < 1e-9 * abs(results[f"{what}_full"])
    for a, b in zip(grads[f"{what}_full"], grads[f"{what}_chunked"]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # negative control: another k ids (the labels shifted) give another result
    h, w, labels = head_inputs(37, 16, 211, device=torch.device("cpu"), dtype=torch.float64)
    assert abs(head_fwd_bwd(f"{what}_full", h, w, (labels + 1) % 211, chunk=8) - results[f"{what}_full"]) > 1e-6 \
        or what == "topk"  # the teacher's top-k does not read the labels


def test_table_reports_the_ratios():
    mem = [{"variant": v, "tokens": 4096, "vocab": 151936, "peak_gib": p, "seconds": 1.0}
           for v, p in zip(DISTILL_VARIANTS, (4.0, 0.5, 8.0, 1.0))]
    (table,) = [t for t in tables({"speed": [], "distill_memory": mem}) if "distillation" in t.title]
    assert "teacher top-k chunked / full peak memory: 0.125" in table.notes
    assert "student at k ids chunked / full peak memory: 0.125" in table.notes


def test_teacher_bytes_jagged_against_padded():
    """`rlpad bench logprob`'s teacher bytes: the padded grid holds B x R x k x (8 + 4) bytes scored or not;
    the jagged layout n x (4 k + 4 (k + 1)) for its n scored positions; both pickle to about that."""
    from rlpad.bench.teacher_bytes import run_teacher_bytes

    out = run_teacher_bytes(rows=6, response=64, topk=8)
    n, k = out["scored"], 8
    assert out["padded"]["bytes"] == 6 * 64 * k * 12 and out["jagged"]["bytes"] == n * (4 * k + 4 * (k + 1))
    for layout in ("padded", "jagged"):
        assert out[layout]["bytes"] < out[layout]["pickled"] < out[layout]["bytes"] + 6 * 2048  # per-row headers
    assert abs(out["padded"]["step_gb"] - 1024 * 8192 * 128 * 12 / 1e9) < 1e-9  # 12.9 GB at the driver per step
    assert out["ratio"] < 1
