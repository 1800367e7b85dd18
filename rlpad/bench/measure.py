"""Timing two scoring paths on one batch, and the arithmetic from their times to rates.

:func:`interleaved_medians` times the passes of a benchmark (a first round warms up; the passes
alternate so they share the machine's drift; CUDA is synchronised around each pass).
:func:`path_rates` is pure arithmetic: tokens/s, speedup, FLOP-ideal speedup and its fraction,
TFLOP/s and MFU; the CPU and CUDA benchmarks all report through it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from rlpad.bench.mfu import achieved_tflops, mfu, peak_bf16_tflops

__all__ = ["device_peak", "interleaved_medians", "median_seconds", "path_rates", "require_cuda", "timed"]


def require_cuda() -> torch.device:
    """The current CUDA device; ValueError naming the problem when torch sees none."""
    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda needs a CUDA GPU, but torch {torch.__version__} sees none "
                         f"(torch.cuda.is_available() is False; CUDA build: {torch.version.cuda})")
    return torch.device("cuda", torch.cuda.current_device())


def device_peak(device: torch.device) -> tuple[str, tuple[str, float] | None]:
    """``(device name, (peak label, dense bf16 TFLOP/s) or None)``; None on a CPU or an unknown GPU."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, peak_bf16_tflops(name)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of ``fn()``; on CUDA synchronised before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], reps: int, device: torch.device = torch.device("cpu")) -> float:
    """Median of ``reps`` :func:`timed` calls of ``fn``."""
    return statistics.median(timed(fn, device) for _ in range(reps))


def interleaved_medians(passes: Mapping[str, Callable[[], object]], reps: int, device: torch.device, *,
                        warmup: bool = True) -> dict[str, float]:
    """Median seconds of each pass over ``reps`` rounds (after one untimed round with ``warmup``);
    every round runs every pass once, in order."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    times: dict[str, list[float]] = {name: [] for name in passes}
    for rep in range(reps + int(warmup)):
        for name, fn in passes.items():
            t = timed(fn, device)
            if rep or not warmup:
                times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def path_rates(tokens: int, seconds: Mapping[str, float], flops: Mapping[str, float], *, base: str, other: str,
               factor: int = 1, peak_tflops: float | None = None) -> dict[str, float]:
    """Two paths (``base`` and ``other``) on the same batch of ``tokens`` valid tokens.

    ``seconds``/``flops``: each path's time and forward FLOPs (:mod:`rlpad.bench.flops`); ``factor``
    scales the FLOPs to the pass (3 for forward+backward: backward = 2x forward). Returns per path
    ``{p}_s``, ``{p}_tok_s`` (valid tokens / s), ``{p}_tflops`` (the FLOPs it executes / s) and,
    with ``peak_tflops``, ``{p}_mfu``; and ``speedup`` = base / other seconds, ``flop_ideal_speedup``
    = base / other FLOPs, ``speedup_vs_ideal`` = their ratio (1.0: the time saved is what the FLOPs allow).
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    out: dict[str, float] = {}
    for p in (base, other):
        out[f"{p}_s"] = seconds[p]
        out[f"{p}_tok_s"] = tokens / seconds[p]
        out[f"{p}_tflops"] = achieved_tflops(factor * flops[p], seconds[p])
        if peak_tflops is not None:
            out[f"{p}_mfu"] = mfu(factor * flops[p], seconds[p], peak_tflops)
    out["speedup"] = seconds[base] / seconds[other]
    out["flop_ideal_speedup"] = flops[base] / flops[other]
    out["speedup_vs_ideal"] = out["speedup"] / out["flop_ideal_speedup"]
    return out
