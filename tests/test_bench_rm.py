"""``rlpad bench rm``: the reward model's padded and packed scoring forward measured in one run, their ratio
beside the FLOP ideal (no timing asserted: the figures are reported, not checked)."""

from rlpad.bench.reward_model import run_rm_bench, tables
from rlpad.cli import main


def test_rm_bench_reports_both_paths_and_the_ideal():
    result = run_rm_bench("tiny", batch=4, prompt=16, response=16, reps=1)
    m = result["fwd"]
    assert m["padded_s"] > 0 and m["rmpad_s"] > 0
    assert m["flop_ideal_speedup"] > 1.0  # the batch has padding: the packed path does less work
    assert abs(m["speedup_vs_ideal"] - m["speedup"] / m["flop_ideal_speedup"]) < 1e-12
    assert tables(result)[0].rows[0][0] == "tiny"


def test_rm_bench_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "rm.json"
    assert main(["bench", "rm", "--models", "tiny", "--reps", "1", "--out", str(out)]) == 0
    assert out.exists() and "reward-model scoring forward" in capsys.readouterr().out
