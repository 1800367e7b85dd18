"""The GPU benchmarks (`rlpad bench logprob|prefix --device cuda`) as far as a CPU runs them: the
clear error without CUDA, what the command imports, and their measuring code on a tiny bf16 model."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlpad.bench.kernels import KINDS, kernel_kind, profile_pass
from rlpad.bench.logprob_cuda import COLUMNS, cuda_tables, measure_shape
from rlpad.bench.measure import require_cuda
from rlpad.bench.models import bench_model
from rlpad.bench.prefix import N, bench_shape
from rlpad.bench.table import format_text
from rlpad.bench.command import CUDA_BENCHES
from rlpad.cli import main as cli
from rlpad.core.forward import compute_log_probs

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


# Kernel names as torch.profiler reports them on an H100 (torch 2.11, CUDA 13), with what each is.
KERNEL_NAMES = [
    ("cutlass_80_simt_sgemm_128x32_8x5_nn_align1", (), "fp32 GEMM"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nt_align1>(cutlass_80_simt_sgemm_256x128_8x4_nt_align1"
     "::Params)", (), "fp32 GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", (), "bf16 GEMM"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", ("c10::BFloat16", "c10::BFloat16"), "bf16 GEMM"),
    ("nvjet_tst_128x128_64x4_1x2_h_bz_TNN", ("float", "float", "float"), "fp32 GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, false>", (), "fp32 GEMM"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", (), "GEMM, dtype unknown"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false>"
     "(pytorch_flash::Flash_fwd_params)", (), "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, "
     "2, false, false, cutlass::bfloat16_t>>(pytorch_flash::Flash_bwd_params)", (), "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, at::native::BinaryFunctor<float, "
     "float, float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)", (), "elementwise/reduce"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, "
     "float, 4, 4> >(at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, float, 4, 4>)", (),
     "elementwise/reduce"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", (), "elementwise/reduce"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", (), "elementwise/reduce"),
    ("triton_red_fused__to_copy_mul_sum_0", (), "elementwise/reduce"),
    ("Memcpy DtoD (Device -> Device)", (), "copy/index"),
    ("Memset (Device)", (), "copy/index"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
     "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(c10::BFloat16)#1}>", (), "copy/index"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...> >(long, ...)", (), "copy/index"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
     "unsigned int, 2, 128, 1>", (), "copy/index"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>",
     (), "copy/index"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 8, ...>", (), "copy/index"),
    ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel", (), "elementwise/reduce"),
    ("void at::native::radixSortKVInPlace<-2, -1, 16, 4, float, long, unsigned int>", (), "other"),
    ("_stats_kernel", (), "LM head (Triton)"),  # rlpad's fused head (rlpad/core/lm_head_triton.py)
    ("_dz_kernel", (), "LM head (Triton)"),
    # aten ops: what the CPU profile folds
    ("aten::mm", ("c10::BFloat16", "c10::BFloat16"), "bf16 GEMM"),
    ("aten::addmm", ("float", "float", "float", "Scalar", "Scalar"), "fp32 GEMM"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", ("c10::BFloat16",) * 3, "attention"),
    ("aten::index_select", ("float", "long int"), "copy/index"),
    ("aten::exp", ("float",), "elementwise/reduce"),
]


def test_kernel_kinds_of_real_kernel_names():
    got = [(name[:50], kernel_kind(name, dtypes)) for name, dtypes, _ in KERNEL_NAMES]
    assert got == [(name[:50], kind) for name, _, kind in KERNEL_NAMES]
    assert {kind for *_, kind in KERNEL_NAMES} == set(KINDS)
    with pytest.raises(TypeError, match="name must be a str, got int"):
        kernel_kind(3)


def test_the_fused_head_kernels_are_the_ones_its_file_defines():
    """HEAD_KERNELS names exactly the @triton.jit kernels of rlpad/core/lm_head_triton.py (read from
    the source: its helpers inlined into them excluded), so a renamed kernel fails here."""
    import re

    from rlpad.bench.kernels import HEAD_KERNELS

    text = (ROOT / "rlpad" / "core" / "lm_head_triton.py").read_text()
    kernels = re.findall(r"^@triton\.jit[^\n]*\ndef (\w+)\(", text, flags=re.M)
    assert sorted(k for k in kernels if k.endswith("_kernel")) == sorted(HEAD_KERNELS), kernels


def test_profile_folds_a_known_workload_on_cpu():
    """Counted by hand: a bf16 (8, 16) x (16, 32) matmul forward + backward is 3 bf16 GEMMs (out,
    grad input, grad weight), an fp32 matmul 1, an index_select and a copy 2 copy/index ops, an exp 1."""
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    idx = torch.tensor([0, 2])
    buf = torch.empty(2, 8)

    def work():
        (x @ w).float().sum().backward()
        buf.copy_((a @ b).index_select(0, idx).exp())

    p = profile_pass(work, torch.device("cpu"))
    counts = {k: v["count"] for k, v in p["kinds"].items()}
    assert counts["bf16 GEMM"] == 3 and counts["fp32 GEMM"] == 1 and counts["attention"] == 0, counts
    assert counts["copy/index"] >= 2 and counts["elementwise/reduce"] >= 2, counts  # + sum, fill of the grad seed
    assert p["launches"] == sum(counts.values())
    assert p["device_ms"] == pytest.approx(sum(v["ms"] for v in p["kinds"].values()))
    assert 0 < p["host_ms"] and 0 < p["wall_ms"]
    assert p["top"] and all(t["kind"] in KINDS for t in p["top"])


def test_op_dtypes_come_from_the_raw_events_on_a_torch_without_input_dtypes():
    """GEMM kernels without a dtype in their name take the launching op's dtypes; where a torch's
    FunctionEvent lacks ``input_dtypes`` they come from the profiler's raw event of the same id."""
    from torch.profiler import ProfilerActivity, profile

    from rlpad.bench.kernels import _dtypes_of

    x = torch.randn(4, 4, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        x @ x
    mm = next(e for e in prof.events() if e.name == "aten::mm")
    bare = type("Bare", (), {"id": mm.id})()  # an event without input_dtypes
    dtypes = _dtypes_of(prof)
    assert list(dtypes(mm)) == list(dtypes(bare)) == ["c10::BFloat16", "c10::BFloat16"]
    assert kernel_kind("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", dtypes(bare)) == "bf16 GEMM"
    assert dtypes(None) == ()


def test_launches_per_decoder_layer_on_cpu():
    """The per-layer count against an independent one: a 4-layer model's packed forward makes
    2 x (launches per layer) more launches than the same model with 2 layers, and each layer's
    forward is counted once."""
    from rlpad.embedded.synthetic import rollout_batch
    from rlpad.embedded.tiny import tiny_model

    data = rollout_batch(2, 8, 12, vocab_size=1024, seed=0, edge_rows=False)
    got = {}
    for layers in (2, 4):
        model = tiny_model("qwen2", dtype=torch.bfloat16, vocab_size=1024, num_hidden_layers=layers)

        def fwd(model=model):
            with torch.no_grad():
                compute_log_probs(model, data["input_ids"], data["attention_mask"], data["position_ids"], 12,
                                  use_remove_padding=True, calculate_entropy=True, logits_chunk_size=16)
        fwd()
        got[layers] = profile_pass(fwd, torch.device("cpu"), layers=model.model.layers)
        assert got[layers]["layer_calls"] == layers
        assert not model.model.layers[0]._forward_hooks  # the ranges' hooks are gone
    per_layer = got[2]["launches_per_layer"]
    assert per_layer > 10 and per_layer == got[4]["launches_per_layer"]
    assert got[4]["launches"] - got[2]["launches"] == 2 * per_layer
    assert "launches_per_layer" not in profile_pass(lambda: None, torch.device("cpu"))


def test_logprob_columns_code_runs_on_a_small_shape():
    """The CUDA benchmark's own code on CPU in bf16, tiny shape: the 4 columns on the same tokens
    (micro-batches, FLOPs, rates), their agreement with rmpad, the profile of one micro-batch."""
    r = measure_shape(torch.device("cpu"), "tiny", rows=4, prompt=8, response=12, micro_rows=2, chunk=16, reps=1)
    assert r["packed_attention"] == "rlpad_varlen" and r["peak"] is None and r["model"] == "tiny" and r["layers"] == 2
    assert 0 < r["valid_fraction"] < 1
    assert r["skipped"] == {"fwdbwd.packed_flex": "FlexAttention has no backward on the CPU",
                            "packed_liger": "liger-kernel's kernels need CUDA"}
    ran = [c for c in COLUMNS if c != "packed_liger"]
    assert list(r["fwd"]) == ran and list(r["fwdbwd"]) == ["rmpad", "padded", "packed_sdpa", "packed_compiled"]
    compiled = r["compile"]  # compiled before the timing: the timed rounds compile nothing more
    assert compiled["graphs"] > 0 and compiled["seconds"] > 0 and compiled["graphs_after_warmup"] == 0, compiled
    assert r["tflop"]["packed_compiled"] == r["tflop"]["rmpad"]
    tf = r["tflop"]  # executed FLOPs: padded > sdpa-packed (nnz x nnz, head on nnz) > flex-packed > rmpad
    assert tf["padded"] > tf["packed_sdpa"] > tf["packed_flex"] > tf["rmpad"]
    for mode, factor in (("fwd", 1), ("fwdbwd", 3)):
        rm = r[mode]["rmpad"]
        for c, m in r[mode].items():
            assert m["tok_s"] == pytest.approx(r["valid_tokens"] / m["s"])
            assert m["tflops"] == pytest.approx(factor * tf[c] / m["s"])
            assert m["rmpad_speedup"] == pytest.approx(m["s"] / rm["s"])
            assert m["flop_ideal_speedup"] == pytest.approx(tf[c] / tf["rmpad"])
            assert "mfu" not in m and m["peak_gib"] is None  # no known peak, no CUDA memory on a CPU
    # Same tokens, same model: every column scores the response tokens as rmpad does, within bf16
    # (the packed peers differ from rmpad by the head's bf16 logits; padded by its layout).
    for c in ran:
        assert r["agreement"][c]["lp_max_diff"] < 0.02 and r["agreement"][c]["ent_max_diff"] < 0.02, r["agreement"]
    assert r["agreement"]["rmpad"] == {"lp_max_diff": 0.0, "ent_max_diff": 0.0}
    prof = r["profile"]
    for mode in ("fwd", "fwdbwd"):
        p = prof[mode]
        assert p["kinds"]["bf16 GEMM"]["count"] > 0 and p["kinds"]["attention"]["count"] > 0
        assert p["launches"] == sum(k["count"] for k in p["kinds"].values())
    assert prof["fwdbwd"]["launches"] > prof["fwd"]["launches"]
    assert prof["fwd"]["layer_calls"] == 2 and 0 < prof["fwd"]["launches_per_layer"] < prof["fwd"]["launches"] / 2
    with pytest.raises(ValueError, match="micro_rows=3 must be >= 1 and divide rows=4"):
        measure_shape(torch.device("cpu"), "tiny", rows=4, prompt=8, response=12, micro_rows=3, chunk=16, reps=1)
    with pytest.raises(ValueError, match="columns must include 'rmpad'"):
        measure_shape(torch.device("cpu"), "tiny", rows=4, prompt=8, response=12, micro_rows=2, chunk=16, reps=1,
                      columns=("padded",))
    text = format_text(cuda_tables({"shapes": [r], "memory": []}))
    assert "rmpad attention: rlpad_varlen" in text and "not run: fwdbwd.packed_flex" in text
    assert "launches" in text and "bf16 GEMM" in text


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


def test_column_sets_and_a_bad_column_list():
    """`--columns`: the lane's three named sets (peers, compiled, flex) cover COLUMNS, the compiling
    columns each in a set of its own with rmpad; a bad list is one line."""
    from rlpad.bench.logprob_cuda import COLUMN_SETS, column_list

    lane = ("peers", "compiled", "flex")
    assert set().union(*(COLUMN_SETS[n] for n in lane)) == set(COLUMNS) == set(column_list("all"))
    assert COLUMN_SETS["compiled"] == ("rmpad", "packed_compiled") and COLUMN_SETS["flex"] == ("rmpad", "packed_flex")
    assert not {"packed_compiled", "packed_flex"} & set(COLUMN_SETS["peers"])
    assert column_list("packed_compiled, rmpad") == ("rmpad", "packed_compiled")
    with pytest.raises(ValueError, match=r"--columns 'rmpad,packed_jit'.*unknown \['packed_jit'\]"):
        column_list("rmpad,packed_jit")
    with pytest.raises(ValueError, match="including 'rmpad'"):
        column_list("padded")
