"""The one benchmark table formatter: console text, Markdown, and the marked block `--markdown PATH` writes."""

import pytest

from rlpad.bench.table import Table, begin_marker, end_marker, format_markdown, format_text, write_markdown

TABLE = Table(["model", "pass", "speedup"], [["tiny", "fwd", "1.82x"], ["40m", "fwdbwd", "2.15x"]],
              title="log-prob, padded vs remove-padding", notes=["chunked / full peak memory: 0.084"])
COMMAND = "rlpad bench logprob --reps 1 --markdown docs/performance.md"


def test_text_and_markdown_from_one_table():
    assert format_text([TABLE]) == (
        "log-prob, padded vs remove-padding\n"
        "model    pass  speedup\n"
        "----------------------\n"
        "tiny      fwd    1.82x\n"
        "40m    fwdbwd    2.15x\n"
        "chunked / full peak memory: 0.084")
    assert format_markdown([TABLE]) == (
        "log-prob, padded vs remove-padding\n\n"
        "| model | pass | speedup |\n"
        "|---|---:|---:|\n"
        "| tiny | fwd | 1.82x |\n"
        "| 40m | fwdbwd | 2.15x |\n\n"
        "chunked / full peak memory: 0.084\n")
    assert "| a \\| b |" in format_markdown([Table(["x"], [["a | b"]])])  # a pipe in a cell is escaped
    with pytest.raises(ValueError, match="a row has 2 cells for 3 columns"):
        Table(["a", "b", "c"], [["1", "2"]])


def test_write_creates_replaces_and_keeps_the_rest(tmp_path):
    path = tmp_path / "docs" / "performance.md"
    write_markdown(str(path), "logprob", [TABLE], command=COMMAND, load=(0.5, 0.25, 0.125), date="2026-11-23")
    first = path.read_text()
    assert first.startswith(begin_marker("logprob") + "\n`" + COMMAND + "`, 2026-11-23, ")
    assert "load average 0.50 / 0.25 / 0.12 at the start" in first and "| tiny | fwd | 1.82x |" in first
    assert first.rstrip().endswith(end_marker("logprob"))

    # hand-written text around the block, and a second bench's block
    path.write_text("# Performance\n\nIntro.\n\n" + first + "\nBetween.\n")
    write_markdown(str(path), "prefix", [Table(["P/R<="], [["512/256"]])], command="rlpad bench prefix",
                   date="2026-11-23")
    newer = Table(["model", "pass", "speedup"], [["tiny", "fwd", "1.90x"]])
    write_markdown(str(path), "logprob", [newer], command=COMMAND, date="2026-11-24")
    text = path.read_text()
    assert text.startswith("# Performance\n\nIntro.\n\n" + begin_marker("logprob"))
    assert "1.90x" in text and "1.82x" not in text and "2.15x" not in text and "2026-11-24" in text
    assert text.count(begin_marker("logprob")) == text.count(end_marker("logprob")) == 1
    assert "\nBetween.\n" in text and "| 512/256 |" in text  # the rest is untouched
    assert text.index("Between.") < text.index(begin_marker("prefix"))  # a new block goes at the end


def test_broken_markers_are_an_error(tmp_path):
    path = tmp_path / "doc.md"
    path.write_text(f"{begin_marker('sync')}\nold table\n")
    with pytest.raises(ValueError, match="markers of bench 'sync' are broken"):
        write_markdown(str(path), "sync", [TABLE], command="rlpad bench sync")
    assert path.read_text() == f"{begin_marker('sync')}\nold table\n"


def _rates(**extra):
    return {"padded_s": 0.5, "rmpad_s": 0.25, "shared_s": 0.2, "padded_tok_s": 100.0, "rmpad_tok_s": 200.0,
            "shared_tok_s": 250.0, "speedup": 2.0, "flop_ideal_speedup": 1.9, "speedup_vs_ideal": 1.05,
            "padded_tflops": 1.0, "rmpad_tflops": 1.1, "shared_tflops": 1.2, **extra}


def test_every_bench_formats_a_small_fake_result():
    """Each benchmark's table function on a fake result of its shape: the same Table serves print and Markdown."""
    from rlpad.bench import e2e, logprob, logprob_cuda, prefix, report, rollout
    from rlpad.bench import sync as bench_sync, worker_group as bench
    from rlpad.bench.kernels import KINDS

    speed = {"model": "tiny", "params_m": 0.6, "flop_ideal_speedup": 1.9, "fwd": _rates(), "fwdbwd": _rates()}
    memory = [{"variant": v, "peak_gib": g, "seconds": 1.0, "tokens": 4096, "vocab": 151936}
              for v, g in (("full", 11.6), ("chunked", 0.97))]
    workers = {"config": {"model": "40m", "world_size": 2, "rows": 16, "prompt_length": 128, "response_length": 128,
                          "valid_tokens": 2048, "padded_tokens": 4096, "reps": 3},
               "padded": {"compute_log_prob_tok_s": 1560.0, "update_actor_tok_s": 442.0},
               "rmpad": {"compute_log_prob_tok_s": 2456.0, "update_actor_tok_s": 777.0},
               "speedup": {"compute_log_prob": 1.57, "update_actor": 1.76}}
    mismatch = {"tokens": 5322.0, "abs_diff_mean": 1.7e-7, "abs_diff_max": 9.5e-7, "k3_kl": 4e-14, "pearson": 1.0}
    roll = {"backend": "vllm", "num_params": 510000, "batch_size": 16, "n": 4, "gen_tokens_per_s": 16307.0,
            "sync_s": 0.0063, "mismatch": {"float32": mismatch},
            "replicas": {"batch_size": 16, "n": 4, "cpus": 2, "speedup": {"1": 1.0, "2": 1.4},
                         "runs": [{"replicas": 1, "tokens_per_s": 1000.0}, {"replicas": 2, "tokens_per_s": 1400.0}]}}
    col = {"s": 1.326, "tok_s": 25000.0, "tflops": 220.0, "mfu": 0.22, "peak_gib": 24.0}
    peer = {"s": 0.826, "tok_s": 40000.0, "tflops": 300.0, "mfu": 0.3, "peak_gib": 45.0, "rmpad_speedup": 0.62,
            "flop_ideal_speedup": 1.2, "of_ideal": 0.52}
    kinds = {k: {"ms": 10.0, "count": 3} for k in KINDS}
    prof = {"wall_ms": 400.0, "host_ms": 50.0, "device_ms": 70.0, "launches": 21, "kinds": kinds,
            "top": [{"name": "cutlass_80_simt_sgemm", "kind": "fp32 GEMM", "ms": 70.0, "count": 2}]}
    cuda_shape = {"device": "NVIDIA H100", "torch": "2.11", "model": "7b-layers", "params_m": 2022.0, "layers": 4,
                  "rows": 32, "prompt": 512, "response": 1536, "micro_rows": 8, "valid_fraction": 0.5,
                  "packed_attention": "rlpad_varlen", "peak": {"bf16_tflops": 989.0, "label": "H100 SXM"}, "skipped": {},
                  "agreement": {"rmpad": {"lp_max_diff": 0.0}, "packed_flex": {"lp_max_diff": 0.0021}},
                  "fwd": {"rmpad": col, "packed_flex": peer}, "fwdbwd": {"rmpad": col, "packed_flex": peer},
                  "profile": {"micro_rows": 8, "valid_tokens": 10000, "fwd": {**prof, "launches_per_layer": 4.0},
                              "fwdbwd": prof}}
    mode = {"padding_ratio": 0.5, "overhead_s": 0.1, "step_s": 4.2, "overhead_pct": 2.4, "driver/reward": 0.05}
    cases = {
        "logprob": (logprob.tables({"speed": [speed], "memory": memory}), "| tiny | fwd | 0.500 | 0.250 | 200 |"),
        "logprob cuda": (logprob_cuda.cuda_tables({"shapes": [cuda_shape], "memory": memory}),
                         "| fwdbwd | packed_flex | 0.826 | 40000 | 300.0 | 30.0% | 45.0 | 0.62x | 1.20x | 0.52 | 0.0021 |"),
        "prefix": (prefix.tables({"model": "40m", "params_m": 45.6, "dtype": "torch.float32", "device": "cpu",
                                  "groups": 8, "peak": None, "shapes": [{"prompt": 512, "max_response": 256,
                                                                         "flop_ideal_speedup": 2.24, "fwd": _rates(),
                                                                         "fwdbwd": _rates()}]}),
                   "| 512/256 | fwd | 0.250 | 0.200 | 200 | 250 | 2.00x | 2.24x | 1.05x | 1.10 | 1.20 |"),
        "e2e": (e2e.tables({"recipe": "recipes/grpo_tiny.yaml", "steps": 4, "modes": {"rmpad": mode, "padded": mode},
                            "phases": [{"phase": "gen", "padded_s": 1.2, "rmpad_s": 0.9, "ratio": 1.33, "ideal": None},
                                       {"phase": "step", "padded_s": 3.4, "rmpad_s": 2.9, "ratio": 1.17,
                                        "ideal": 1.51}]}),
                "| step | 3.400 | 2.900 | 1.17x | 1.51x |"),
        "workers": (bench.tables(workers), "| compute_log_prob | 1560 | 2456 | 1.57x |"),
        "sync": (bench_sync.tables({"runs": [{"size": "40m", "params": 45.6e6, "sync_bytes": 182e6, "buckets": 1,
                                              "driver_hwm_growth_mib": 0.0, "driver_peak_rss_mib": 440.0,
                                              "via_driver_hwm_growth_mib": 496.0, "sync_s": 1.88, "sync_s_per_gb": 10.3,
                                              "via_driver_s": 2.47}],
                                    "model_bytes_ratio": 3.7, "growth_spread_mib": 0.14, "peak_rss_ratio": 1.0}),
                 "| 40m | 45.6M | 182 | 1 | 0.00 | 440 | 496 | 1.88 | 10.30 | 2.47 |"),
        "rollout": (rollout.tables(roll), "| 2 | 1400 | 1.40x |"),
        "all": (report.tables({"logprob": {"speed": [speed], "memory": memory}, "workers": workers, "rollout": roll}),
                "| worker group update_actor, 40m, 2 ranks, tokens/s | 442 | 777 | 1.76x |  |  |"),
    }
    for name, (tables, row) in cases.items():
        assert row in format_markdown(tables), (name, format_markdown(tables))
        text = format_text(tables)
        assert all(t.title in text for t in tables) and all(c in text for t in tables for c in t.columns), name
