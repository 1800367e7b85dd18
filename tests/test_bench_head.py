"""`rlpad bench head`: its whole code path on the CPU at a tiny shape (every variant, the floor
ratios, the fp64 errors), and the one-line error of `--device cuda` without a GPU."""

import json

import pytest
import torch

from rlpad.bench.head import VARIANTS
from rlpad.cli import main as cli
from rlpad.embedded.head_exactness import HEAD_LP_BOUND


def test_bench_head_on_the_cpu_at_a_tiny_shape(tmp_path, capsys):
    out = tmp_path / "head.json"
    md = tmp_path / "perf.md"
    assert cli(["bench", "head", "--tokens", "9", "20", "--hidden", "32", "--vocab", "101", "--reps", "1",
                "--out", str(out), "--markdown", str(md)]) == 0
    r = json.loads(out.read_text())
    assert r["head_path"] == "torch" and r["vocab"] == 101 and r["dtype"] == "bf16"
    assert [(row["tokens"], row["variant"]) for row in r["rows"]] == [(n, v) for n in (9, 20) for v in VARIANTS]
    for row in r["rows"]:
        floor = next(f for f in r["rows"] if f["tokens"] == row["tokens"] and f["variant"] == "floor")
        assert row["fwdbwd_vs_floor"] == pytest.approx(row["fwdbwd_s"] / floor["fwdbwd_s"])
        assert row["peak_gib"] is None  # CUDA only
        if row["variant"] == "torch_cuda":  # fp32-output logits: within the bound even in bf16
            assert row["lp_err"] < HEAD_LP_BOUND and row["ent_err"] < HEAD_LP_BOUND, row
        elif row["variant"] != "floor":  # bf16-rounded logits (the CPU's bf16 path): far outside
            assert row["lp_err"] > HEAD_LP_BOUND, row
    printed = capsys.readouterr().out
    assert "head (torch)" in printed and "<!-- rlpad bench head: begin -->" in md.read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_bench_head_cuda_without_cuda_is_one_line(capsys):
    assert cli(["bench", "head", "--device", "cuda", "--reps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --device cuda needs a CUDA GPU"), err


def test_bench_head_prints_the_launch_plan_with_the_hbm_model(tmp_path, capsys):
    """The plan table: per token count the tile table's choice (an H100's on the CPU) and the HBM
    model of each grid order, the chosen one starred and the cheapest of the three."""
    out = tmp_path / "head.json"
    assert cli(["bench", "head", "--tokens", "9", "--hidden", "32", "--vocab", "101", "--reps", "1", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())["plans"][0]
    assert plan["capability"] == "9.0" and plan["tokens"] == 9
    chosen = next(o for o in plan["orders"] if o["order"] == plan["order"])
    assert chosen["total_gb"] == min(o["total_gb"] for o in plan["orders"])
    assert "HBM model per grid order" in capsys.readouterr().out


def test_bench_head_sweep_on_the_cpu_needs_the_interpreter(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli(["bench", "head", "--sweep", "--reps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the sweep on the CPU runs Triton's interpreter: TRITON_INTERPRET=1 is not set" in err
