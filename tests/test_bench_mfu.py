"""The arithmetic from measured times to rates (tokens/s, FLOP-ideal ratios, TFLOP/s, MFU) and the
peak table, by hand; the timing loop's rounds."""

import pytest
import torch

from rlpad.bench.measure import interleaved_medians, path_rates
from rlpad.bench.mfu import achieved_tflops, mfu, peak_bf16_tflops


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


def test_path_rates_by_hand():
    # 1000 valid tokens; padded 2 s for 6 TFLOP forward, rmpad 1 s for 4 TFLOP; forward+backward (3x).
    r = path_rates(1000, {"padded": 2.0, "rmpad": 1.0}, {"padded": 6e12, "rmpad": 4e12}, base="padded", other="rmpad",
                   factor=3, peak_tflops=100.0)
    assert r["padded_tok_s"] == 500.0 and r["rmpad_tok_s"] == 1000.0
    assert r["speedup"] == 2.0 and r["flop_ideal_speedup"] == 1.5
    assert r["speedup_vs_ideal"] == pytest.approx(2.0 / 1.5)
    assert r["padded_tflops"] == pytest.approx(9.0) and r["rmpad_tflops"] == pytest.approx(12.0)  # 3 x 6 / 2, 3 x 4 / 1
    assert r["padded_mfu"] == pytest.approx(0.09) and r["rmpad_mfu"] == pytest.approx(0.12)
    no_peak = path_rates(1000, {"a": 1.0, "b": 1.0}, {"a": 1e12, "b": 1e12}, base="a", other="b")
    assert "a_mfu" not in no_peak and no_peak["speedup_vs_ideal"] == 1.0 and no_peak["a_tflops"] == pytest.approx(1.0)
    for bad in (dict(tokens=0), dict(factor=0)):
        with pytest.raises(ValueError):
            path_rates(**{"tokens": 1, "seconds": {"a": 1.0, "b": 1.0}, "flops": {"a": 1.0, "b": 1.0}, "base": "a",
                          "other": "b", **bad})


def test_interleaved_medians_rounds():
    calls: list[str] = []
    passes = {name: (lambda n=name: calls.append(n)) for name in ("a", "b")}
    out = interleaved_medians(passes, 3, torch.device("cpu"))
    assert calls == ["a", "b"] * 4 and set(out) == {"a", "b"}  # one warm-up round, then 3 timed, interleaved
    calls.clear()
    interleaved_medians(passes, 2, torch.device("cpu"), warmup=False)
    assert calls == ["a", "b"] * 2
    with pytest.raises(ValueError, match="reps must be >= 1"):
        interleaved_medians(passes, 0, torch.device("cpu"))
