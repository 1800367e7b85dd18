"""`rlpad bench sp` on a tiny row: it runs sp = 1 and 2 as spawned gloo ranks, reports per-rank peak
memory and tokens/s, and the split row's log-probs equal sp = 1; bad sizes fail before anything runs."""

import pytest

from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.bench.sp import long_row_batch, run_sp_bench, tables
from rlpad.bench.table import format_text


def test_long_row_batch_layout():
    b = long_row_batch(3, 10, 30, vocab=50)
    assert b["attention_mask"].sum(-1).tolist() == [16 + 10, 16 + 20, 16 + 30]  # 16-token prompts
    assert (b["input_ids"][b["attention_mask"] == 0] == 0).all()


def test_tiny_run_reports_every_size():
    result = run_sp_bench(model="tiny", sizes=(2, 1), seqs=2, min_len=24, max_len=40, reps=1)
    runs = result["runs"]
    assert [r["sp"] for r in runs] == [1, 2]
    assert all(r["peak_gib_per_rank"] > 0 and r["tokens_per_s"] > 0 for r in runs)
    assert len(runs[1]["peak_gib_by_rank"]) == 2 and runs[0]["peak_ratio_vs_sp1"] == 1.0
    assert runs[1]["max_abs_diff_vs_sp1"] <= FP32_LOGPROB_TOL
    assert "peak GiB/rank" in format_text(tables(result))


@pytest.mark.parametrize("sizes", [(2, 4), (1, 3), (1, 0)])
def test_bad_sizes_fail_first(sizes):
    with pytest.raises(ValueError, match="sizes must include 1 and divide the 4 query heads of tiny"):
        run_sp_bench(model="tiny", sizes=sizes)
