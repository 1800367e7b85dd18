"""The GPU benchmarks (`rlpad bench logprob|prefix --device cuda`) as far as a CPU runs them: the
clear error without CUDA, what the command imports, and their measuring code on a tiny bf16 model."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlpad.bench.logprob_cuda import cuda_tables, measure_speed
from rlpad.bench.measure import require_cuda
from rlpad.bench.models import bench_model
from rlpad.bench.prefix import N, bench_shape
from rlpad.bench.table import format_text
from rlpad.cli import CUDA_BENCHES, main as cli

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("omegaconf", "yaml", "ray", "vllm", "flash_attn", "pyarrow")  # what the GPU machine may lack
NEVER = ("omegaconf", "yaml", "ray", "vllm", "pyarrow")  # flash-attn is optional: imported only when installed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_is_one_clear_line(capsys):
    with pytest.raises(ValueError, match="--device cuda needs a CUDA GPU.*torch.cuda.is_available\\(\\) is False"):
        require_cuda()
    for what in ("logprob", "prefix"):
        assert cli(["bench", what, "--device", "cuda", "--reps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --device cuda needs a CUDA GPU"), err
    assert cli(["bench", "rollout", "--device", "cuda"]) == 2
    assert f"--device cuda is for `rlpad bench {'/'.join(CUDA_BENCHES)}`, not 'rollout'" in capsys.readouterr().err


def test_cuda_bench_commands_stay_light():
    """The modules `rlpad bench logprob|prefix --device cuda` loads import none of the packages the
    GPU machine lacks: none is loaded after the command (beyond what torch + transformers load
    themselves), and no loaded rlpad module names one (flash-attn aside: used when installed) in an
    import statement, even a lazy one."""
    code = f"""
import json, sys
import torch, transformers
from transformers import AutoModelForCausalLM
before = set(sys.modules)
from rlpad.cli import main
codes = [main(["bench", w, "--device", "cuda", "--reps", "1"]) for w in ("logprob", "prefix")]
print(json.dumps({{"codes": codes, "before": [m for m in {HEAVY!r} if m in before],
                  "after": [m for m in {HEAVY!r} if m in sys.modules],
                  "rlpad": sorted(m for m in sys.modules if m.split(".")[0] in ("rlpad", "workers"))}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not torch.cuda.is_available():
        assert got["codes"] == [2, 2]
    assert set(got["after"]) <= set(got["before"]), got
    assert "rlpad.bench.logprob_cuda" in got["rlpad"] and "rlpad.bench.prefix" in got["rlpad"]
    assert not [m for m in got["rlpad"] if m.startswith("workers")], got["rlpad"]
    for module in got["rlpad"]:
        path = ROOT / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] in NEVER], f"{module} imports {names}"


def test_logprob_speed_code_runs_on_a_small_shape():
    """The CUDA benchmark's own code (both attention paths, micro-batches, FLOPs, rates) on CPU in bf16."""
    r = measure_speed(torch.device("cpu"), "tiny", rows=4, prompt=8, response=12, micro_rows=2, chunk=16, reps=1)
    assert r["packed_attention"] == "rlpad_varlen" and r["peak"] is None and r["model"] == "tiny"
    assert 1.0 < r["flop_ideal_speedup"] < 4.0 and 0 < r["valid_fraction"] < 1
    for mode, factor in (("fwd", 1), ("fwdbwd", 3)):
        m = r[mode]
        assert m["speedup"] == pytest.approx(m["padded_s"] / m["rmpad_s"])
        assert m["flop_ideal_speedup"] == pytest.approx(r["flop_ideal_speedup"])
        assert m["speedup_vs_ideal"] == pytest.approx(m["speedup"] / r["flop_ideal_speedup"])
        assert m["rmpad_tflops"] == pytest.approx(factor * r["rmpad_tflop"] / m["rmpad_s"])
        assert "rmpad_mfu" not in m  # no known peak on a CPU
    with pytest.raises(ValueError, match="micro_rows=3 must be >= 1 and divide rows=4"):
        measure_speed(torch.device("cpu"), "tiny", rows=4, prompt=8, response=12, micro_rows=3, chunk=16, reps=1)
    assert "packed attention: rlpad_varlen" in format_text(cuda_tables({"speed": r, "memory": []}))


def test_prefix_shape_code_runs_in_micro_batches_of_whole_groups():
    """``rlpad bench prefix --device cuda``'s measuring code (bf16, micro-batches of whole groups) on
    CPU: its FLOP-ideal is the sum over the micro-batches, the rates follow from times and FLOPs."""
    model = bench_model("tiny", dtype=torch.bfloat16).train()
    r = bench_shape(model, 12, 8, reps=1, groups=2, micro_rows=N, chunk=16, warmup=True)
    assert r["rows"] == 2 * N and r["micro_rows"] == N
    assert r["shared_tokens"] < r["valid_tokens"] and r["flop_ideal_speedup"] > 1.0
    assert r["decoder_flop_ideal_speedup"] > r["flop_ideal_speedup"]  # the head is the same for both paths
    whole = bench_shape(model, 12, 8, reps=1, groups=2, chunk=16)  # one call for the whole batch: same FLOPs
    for key in ("rmpad_gflop", "shared_gflop"):
        assert whole[key] == pytest.approx(r[key])
    for mode, factor in (("fwd", 1), ("fwdbwd", 3)):
        m = r[mode]
        assert m["speedup"] == pytest.approx(m["rmpad_s"] / m["shared_s"])
        assert m["shared_tflops"] == pytest.approx(factor * r["shared_gflop"] / 1e3 / m["shared_s"])
    with pytest.raises(ValueError, match="micro_rows=4 must be a multiple of n=8"):
        bench_shape(model, 12, 8, reps=1, groups=2, micro_rows=4)
