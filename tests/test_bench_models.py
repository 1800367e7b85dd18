"""The one table of benchmark model shapes, the one /proc memory reader, the LM-head memory benchmark."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlpad.embedded.exactness import FP32_GRAD_REL
from rlpad.bench.head_memory import VARIANTS, head_fwd_bwd, head_inputs, measure_in_subprocess
from rlpad.bench.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rlpad.bench.models import MODEL_SHAPES, bench_config, bench_model, model_shape


def test_table_rows_and_parameter_counts():
    counts = {}
    for name in MODEL_SHAPES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(bench_config(name))
        counts[name] = sum(p.numel() for p in model.parameters())
    # The figures in docs/performance.md: 40m 45.6M; one 160m, 168.3M (the 40m shape doubled); Qwen2.5-0.5B 494M.
    assert round(counts["40m"] / 1e5) == 456 and round(counts["160m"] / 1e5) == 1683
    assert round(counts["qwen2.5-0.5b"] / 1e6) == 494
    # 4 layers of Qwen2.5-7B (7.62B = 28 layers x 233.0M + 2 x 545.0M embeddings + norms): 2.022B.
    layer = 3584 * (3584 + 2 * 512) + (3584 + 2 * 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert counts["7b-layers"] == 4 * layer + 2 * 152064 * 3584 + 3584
    assert counts["tiny"] < 1e6 and counts["tiny-llama"] < 1e6
    with pytest.raises(ValueError, match="unknown benchmark model 'nope'; choose one of"):
        model_shape("nope")
    a, b = bench_model("tiny", seed=3), bench_model("tiny", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_table_is_torch_light():
    code = "import sys, rlpad.bench.models; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_peak_rss_reader_sees_an_allocation_and_resets():
    reset_peak_rss()
    before, base_peak = rss_bytes(), peak_rss_bytes()
    assert 0 < before <= base_peak
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    grown = peak_rss_bytes() - before
    del block
    assert grown >= 60 * 2**20, grown
    reset_peak_rss()
    assert peak_rss_bytes() - rss_bytes() < 60 * 2**20  # the reset dropped the old peak


def test_head_memory_variants_agree_and_chunking_saves_memory():
    """The LM-head memory benchmark's computation (shared by its CPU and CUDA measurements): both
    variants give the same sum and gradients; in fresh processes the chunked peak is far lower."""
    grads = {}
    for variant in VARIANTS:
        h, w, labels = head_inputs(64, 32, 1000, device=torch.device("cpu"), dtype=torch.float32)
        total = head_fwd_bwd(variant, h, w, labels, chunk=16)
        grads[variant] = (total, h.grad.clone(), w.grad.clone())
    (t_full, *g_full), (t_chunk, *g_chunk) = grads["full"], grads["chunked"]
    assert t_full == pytest.approx(t_chunk, rel=FP32_GRAD_REL)  # a sum of 64 log-probs in another order
    assert all((a - b).norm() <= FP32_GRAD_REL * b.norm() for a, b in zip(g_full, g_chunk))  # rlpad/embedded/exactness.py
    with pytest.raises(ValueError, match="unknown memory variant 'half'"):
        head_fwd_bwd("half", h, w, labels, chunk=16)
    peak = {v: measure_in_subprocess(v, tokens=2048, hidden=64, vocab=32768, chunk=64)["peak_gib"] for v in VARIANTS}
    assert peak["full"] > 0.5 and peak["chunked"] < peak["full"] / 5, peak  # full: several 256 MiB (T, V) tensors
