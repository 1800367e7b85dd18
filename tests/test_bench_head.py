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


def test_bench_head_sweep_under_the_interpreter_keeps_its_time_budget(tmp_path):
    """The sweep's CLI on the CPU (Triton's interpreter, fp32, tiny shape): with --budget-s 0 the first
    configuration runs (exact against fp64, at both token counts) and every later one is a row
    saying the budget was spent, so the JSON is written inside the step's limit."""
    import os
    import subprocess
    import sys

    from rlpad.bench.head_sweep import DRY_SWEEP

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    side = os.environ.get("RLPAD_TRITON_INTERPRETER") or os.path.join(sys.prefix, "triton-interpreter")
    out = tmp_path / "sweep.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, side])}
    done = subprocess.run([sys.executable, "-m", "rlpad.cli", "bench", "head", "--sweep", "--tokens", "9", "20",
                           "--hidden", "16", "--vocab", "50", "--reps", "1", "--budget-s", "0", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(out.read_text())
    assert [(row["tokens"], row["tiles"]) for row in r["rows"]] == [(n, t.name) for n in (9, 20) for t in DRY_SWEEP]
    for n in (9, 20):
        first, *rest = [row for row in r["rows"] if row["tokens"] == n]
        assert first["ok"] and first["lp_err"] < HEAD_LP_BOUND and r["best"][str(n)] == first["tiles"], first
        assert all(row["error"] == "not run: the sweep's time budget (0 s) was spent" for row in rest), rest
