"""MFU arithmetic and the peak table of `rlpad bench logprob --device cuda`, and its CPU-side behaviour."""

import pytest
import torch

from rlpad.bench.logprob_cuda import measure_speed, print_cuda_tables, require_cuda
from rlpad.bench.mfu import achieved_tflops, mfu, peak_bf16_tflops
from rlpad.cli import main as cli


def test_peak_table_matches_torch_device_names():
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == ("H100 SXM5", 989.0)
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == ("H100 PCIe", 756.0)
    assert peak_bf16_tflops("NVIDIA H100 NVL") == ("H100 NVL", 835.0)
    assert peak_bf16_tflops("NVIDIA H200") == ("H200 SXM", 989.0)
    assert peak_bf16_tflops("NVIDIA H200 NVL") == ("H200 NVL", 835.0)
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == ("A100", 312.0)
    assert peak_bf16_tflops("NVIDIA A100 80GB PCIe") == ("A100", 312.0)
    assert peak_bf16_tflops("NVIDIA GeForce RTX 4090") is None
    with pytest.raises(TypeError):
        peak_bf16_tflops(None)


def test_mfu_arithmetic():
    # 6 * N * T for a 0.5B model on 100k tokens in 1 s: 3e17 FLOP -> 300 TFLOP/s -> 30.3 % of 989
    flops = 6 * 0.5e9 * 1e5
    assert achieved_tflops(flops, 1.0) == pytest.approx(300.0)
    assert achieved_tflops(flops, 2.0) == pytest.approx(150.0)
    assert mfu(flops, 1.0, 989.0) == pytest.approx(300.0 / 989.0)
    assert mfu(989e12, 1.0, 989.0) == pytest.approx(1.0)
    for bad in (lambda: achieved_tflops(1.0, 0.0), lambda: achieved_tflops(-1.0, 1.0), lambda: mfu(1.0, 1.0, 0.0)):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="--device cuda needs a CUDA GPU.*torch.cuda.is_available\\(\\) is False"):
        require_cuda()
    assert cli(["bench", "logprob", "--device", "cuda", "--no-memory"]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err
    assert cli(["bench", "rollout", "--device", "cuda"]) == 2


def test_speed_measurement_runs_end_to_end_on_a_small_shape(capsys):
    """The benchmark's own code path (both attention paths, micro-batches, FLOPs) on a CPU-sized model."""
    spec = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, head_dim=32, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=128, tie_word_embeddings=True)
    r = measure_speed(torch.device("cpu"), spec, rows=4, prompt=8, response=12, micro_rows=2, chunk=16, reps=1)
    assert r["packed_attention"] == "rlpad_varlen" and r["peak"] is None
    assert 1.0 < r["flop_ideal_speedup"] < 4.0 and 0 < r["valid_fraction"] < 1
    for mode in ("fwd", "fwdbwd"):
        m = r[mode]
        assert m["speedup"] == pytest.approx(m["padded_s"] / m["rmpad_s"])
        assert m["speedup_vs_ideal"] == pytest.approx(m["speedup"] / r["flop_ideal_speedup"])
        factor = 3 if mode == "fwdbwd" else 1
        assert m["rmpad_tflops"] == pytest.approx(factor * r["valid_tflop"] / m["rmpad_s"])
        assert "rmpad_mfu" not in m  # no known peak on a CPU
    with pytest.raises(ValueError, match="micro_rows=3 must be >= 1 and divide rows=4"):
        measure_speed(torch.device("cpu"), spec, rows=4, prompt=8, response=12, micro_rows=3, chunk=16, reps=1)
    print_cuda_tables({"speed": r, "memory": []})
    assert "packed attention: rlpad_varlen" in capsys.readouterr().out
