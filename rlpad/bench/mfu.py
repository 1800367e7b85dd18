"""Achieved TFLOP/s and model-FLOP utilisation (MFU) against a GPU's dense bf16 peak.

Peaks are NVIDIA's datasheet figures for dense bf16 Tensor Core math (the datasheets print the
2:4-sparsity figure, twice the dense one, with a footnote): H100 SXM5 989 TFLOP/s, H100 NVL 835,
H100 PCIe 756 (NVIDIA H100 Tensor Core GPU datasheet); H200 SXM 989, H200 NVL 835 (NVIDIA H200
datasheet); A100 SXM4 and PCIe 312 (NVIDIA A100 Tensor Core GPU datasheet).
"""

from __future__ import annotations

__all__ = ["PEAK_BF16_TFLOPS", "achieved_tflops", "mfu", "peak_bf16_tflops"]

# (substrings that must all be in torch.cuda.get_device_name(), label, dense bf16 TFLOP/s); first match wins,
# so the specific variants come before the family's default.
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("H100", "NVL"), "H100 NVL", 835.0),
    (("H100", "PCIe"), "H100 PCIe", 756.0),
    (("H100",), "H100 SXM5", 989.0),
    (("H200", "NVL"), "H200 NVL", 835.0),
    (("H200",), "H200 SXM", 989.0),
    (("A100",), "A100", 312.0),
)
PEAK_SOURCE = "NVIDIA datasheets (H100, H200, A100), dense bf16 Tensor Core = half the sparsity figure"


def peak_bf16_tflops(device_name: str) -> tuple[str, float] | None:
    """``(label, dense bf16 TFLOP/s)`` of the GPU called ``device_name``, or None if not in the table."""
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str, got {type(device_name).__name__}")
    for needles, label, peak in PEAK_BF16_TFLOPS:
        if all(n.lower() in device_name.lower() for n in needles):
            return label, peak
    return None


def achieved_tflops(flops: float, seconds: float) -> float:
    """``flops / seconds`` in TFLOP/s."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if flops < 0:
        raise ValueError(f"flops must be >= 0, got {flops}")
    return flops / seconds / 1e12


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model-FLOP utilisation: achieved TFLOP/s over the peak (a fraction, 0.4 = 40 %)."""
    if not peak_tflops > 0:
        raise ValueError(f"peak_tflops must be > 0, got {peak_tflops}")
    return achieved_tflops(flops, seconds) / peak_tflops
