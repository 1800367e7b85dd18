"""The one kernel dispatch (rlpad.core.attn_dispatch), checked on CPU.

* the choice itself, from stated device facts (a CUDA-like device included);
* torch's varlen signatures: 2.10 (is_causal) is refused, 2.11 (window_size, no enable_gqa) and
  2.12+ (enable_gqa) are accepted; GQA K/V are expanded only for a kernel without enable_gqa;
* the CUDA wiring end to end on CPU: a CUDA-like dispatch in bf16 sends the packed and the
  shared-prompt attention to STAND-IN varlen kernels with each signature (plain-torch reference
  implementations of the kernels' contract, causal bottom-right, sliding window, GQA), forward
  and backward, and the results meet the bf16 bounds against the fp32 oracle while a boundary
  leak through the same stand-ins does not; fp32 with the same dispatch takes the sdpa fallback.
"""

import sys
import types

import pytest
import torch

from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.core import attn_dispatch
from rlpad.core.attn_dispatch import (
    FLASH_ATTN, SDPA, TORCH_VARLEN, DeviceKernels, choose_kernel, varlen_api_missing, varlen_gqa_arguments,
    varlen_has_gqa,
)
from rlpad.core.forward import compute_log_probs
from rlpad.embedded.exactness import LEAK_DETECTING, errors, leaky_packed, oracle, scored, violations
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import tiny_model

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

H100 = dict(cuda=True, capability=(9, 0))
PROMPT, RESPONSE, VOCAB = 24, 40, 128  # the GRPO batch of tests/test_attention_bf16.py


# ---- stand-in kernels: one reference of the varlen contract, three signatures -----------------


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, left, gqa, calls):
    """Causal varlen attention in plain torch (fp32 math): query j of a sequence with Lq queries and
    Lk keys sits at position Lk - Lq + j and sees key t <= that position (and within ``left`` when
    >= 0). Checks what the real kernels need: int32 cu_seqlens that end exactly at the token
    counts (torch's backward gives NaN past them) and Python-int max lengths (no device read)."""
    assert cu_q.dtype == cu_k.dtype == torch.int32
    assert type(max_q) is int and type(max_k) is int
    bq, bk = cu_q.tolist(), cu_k.tolist()
    assert bq[-1] == q.shape[0] and bk[-1] == k.shape[0], "tokens past cu_seqlens[-1]"
    assert max_q == max(b - a for a, b in zip(bq, bq[1:])) and max_k == max(b - a for a, b in zip(bk, bk[1:]))
    calls.append({"q_heads": q.shape[1], "k_heads": k.shape[1], "left": left})  # the heads as passed
    if k.shape[1] != q.shape[1]:
        if not gqa:
            raise ValueError("Expect query and key/value to have the same number of heads")
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    outs = []
    for (qa, qb), (ka, kb) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
        lq, lk = qb - qa, kb - ka
        qpos = torch.arange(lk - lq, lk)[:, None]
        diff = qpos - torch.arange(lk)[None, :]
        mask = (diff >= 0) & ((diff <= left) if left >= 0 else True)
        qi, ki, vi = (t[a:b].transpose(0, 1).float() for t, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb)))
        outs.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
                    .transpose(0, 1))  # fmt: skip
    return torch.cat(outs).to(q.dtype)


def torch_2_11(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):  # fmt: skip
        assert window_size[1] == 0
        return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                left=window_size[0], gqa=False, calls=calls)  # fmt: skip
    return varlen_attn


def torch_2_12(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert window_size[1] == 0
        return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                left=window_size[0], gqa=enable_gqa, calls=calls)  # fmt: skip
    return varlen_attn


def flash_attn_module(calls):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1)):  # fmt: skip
        assert causal and window_size[1] == 0 and dropout_p == 0.0
        return reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                                left=window_size[0], gqa=True, calls=calls)  # fmt: skip
    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.fixture(params=["torch_2_11", "torch_2_12", "flash_attn"])
def cuda_like(request, monkeypatch):
    """A CUDA-like dispatch on this CPU: an sm90 device whose varlen kernel is a stand-in."""
    calls: list[dict] = []
    if request.param == "flash_attn":
        monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_module(calls))
        offer = DeviceKernels(**H100, flash_attn=True, torch_varlen=False)
    else:
        fn = (torch_2_11 if request.param == "torch_2_11" else torch_2_12)(calls)
        monkeypatch.setattr(attn_dispatch, "_varlen_attn", lambda: fn)
        offer = DeviceKernels(**H100, torch_varlen=True)
    monkeypatch.setattr(attn_dispatch, "device_kernels", lambda device: offer)
    return request.param, calls


# ---- the choice -------------------------------------------------------------------------------


def test_choice_from_device_facts():
    both = DeviceKernels(**H100, flash_attn=True, torch_varlen=True)
    torch_only = DeviceKernels(**H100, torch_varlen=True)
    assert choose_kernel(both, torch.bfloat16) == FLASH_ATTN  # flash-attn first where installed
    assert choose_kernel(torch_only, torch.bfloat16) == choose_kernel(torch_only, torch.float16) == TORCH_VARLEN
    # The fallback: fp32 (or fp64) on CUDA, a pre-sm80 GPU, CPU, no varlen kernel.
    for dtype in (torch.float32, torch.float64):
        assert choose_kernel(both, dtype) == SDPA
    assert choose_kernel(DeviceKernels(cuda=True, capability=(7, 5), flash_attn=True, torch_varlen=True),
                         torch.bfloat16) == SDPA  # fmt: skip
    assert choose_kernel(DeviceKernels(cuda=False), torch.bfloat16) == SDPA
    assert choose_kernel(DeviceKernels(**H100), torch.bfloat16) == SDPA
    # Dropout: torch's kernel has none, flash-attn has.
    assert choose_kernel(torch_only, torch.bfloat16, dropout=0.1) == SDPA
    assert choose_kernel(both, torch.bfloat16, dropout=0.1) == FLASH_ATTN
    assert attn_dispatch.attention_kernel(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)) == SDPA  # this CPU


def test_varlen_signatures_of_torch_2_10_to_2_13():
    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        """2.10: causal as a flag, no window, no GQA."""

    assert "window_size" in varlen_api_missing(torch_2_10)
    for fn in (torch_2_11([]), torch_2_12([])):
        assert varlen_api_missing(fn) is None
    assert not varlen_has_gqa(torch_2_11([])) and varlen_has_gqa(torch_2_12([]))
    from torch.nn.attention.varlen import varlen_attn  # this torch (2.13)

    assert varlen_api_missing(varlen_attn) is None and varlen_has_gqa(varlen_attn)


def test_gqa_expanded_only_for_a_kernel_without_enable_gqa():
    assert varlen_gqa_arguments(TORCH_VARLEN, 14, 2, has_enable_gqa=True) == (False, {"enable_gqa": True})
    assert varlen_gqa_arguments(TORCH_VARLEN, 14, 2, has_enable_gqa=False) == (True, {})
    assert varlen_gqa_arguments(TORCH_VARLEN, 14, 14, has_enable_gqa=True) == (False, {})
    assert varlen_gqa_arguments(FLASH_ATTN, 14, 2, has_enable_gqa=False) == (False, {})


# ---- the CUDA wiring, end to end on CPU -------------------------------------------------------


def make_batch():
    b = grpo_batch(3, 4, PROMPT, RESPONSE, vocab_size=VOCAB, seed=5, shuffle=True, min_prompt=2)
    return {k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])  # GQA; GQA with a sliding window of 8
def test_cuda_like_dispatch_runs_the_varlen_kernel_exactly(arch, cuda_like):
    kernel, calls = cuda_like
    batch = make_batch()
    mask = batch["attention_mask"][:, -RESPONSE:]
    model = tiny_model(arch, vocab_size=VOCAB, seed=1, dtype=torch.bfloat16).train()
    model32 = tiny_model(arch, vocab_size=VOCAB, seed=1, attn_implementation="sdpa").train()
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    cfg = model.config
    ref = oracle(model32, batch, RESPONSE)
    layers = cfg.num_hidden_layers
    for share in (False, True):  # one call per layer: the packed row; the shared row (prompts and responses)
        calls.clear()
        got = scored(model, batch, RESPONSE, rmpad=True, share=share)
        assert len(calls) == layers, (share, len(calls))
        assert not violations(errors(got, ref, mask)), (share, errors(got, ref, mask))
        # K/V keep their heads where the kernel does GQA (torch >= 2.12, flash-attn); torch 2.11 expands.
        expected_k = cfg.num_attention_heads if kernel == "torch_2_11" else cfg.num_key_value_heads
        assert {c["k_heads"] for c in calls} == {expected_k} and cfg.num_key_value_heads < cfg.num_attention_heads
        assert {c["left"] for c in calls} == {cfg.sliding_window - 1 if arch == "mistral" else -1}
    leak = errors(leaky_packed(model, batch, RESPONSE), ref, mask)  # the same kernel, one segment
    assert all(violations({k: leak[k]}) for k in LEAK_DETECTING), leak


def test_cuda_like_dispatch_in_fp32_takes_the_exact_fallback(cuda_like):
    """share_prompts (and the packed row) in fp32 on a CUDA-like device: no varlen call, exact."""
    _, calls = cuda_like
    batch = make_batch()
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    with torch.no_grad():
        ref = oracle(model, batch, RESPONSE, backward=False)
        for share in (False, True):
            lp, ent = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                        RESPONSE, use_remove_padding=True, share_prompts=share, calculate_entropy=True)
            torch.testing.assert_close(lp.double(), ref.lp, atol=FP32_LOGPROB_TOL, rtol=0)
            torch.testing.assert_close(ent.double(), ref.ent, atol=FP32_LOGPROB_TOL, rtol=0)
    assert calls == []



def test_the_sdpa_path_reads_the_bounds_once_per_forward(monkeypatch):
    """The packed row's Python bounds come from the device once per forward, not once per layer."""
    from rlpad.core import attention

    reads = []
    real = attention.sequence_bounds
    monkeypatch.setattr(attention, "sequence_bounds", lambda *a: reads.append(1) or real(*a))
    model = tiny_model("llama", vocab_size=VOCAB, seed=1, num_hidden_layers=4)
    batch = make_batch()
    with torch.no_grad():
        compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE,
                          use_remove_padding=True)  # fmt: skip
    assert len(reads) == 1


def test_the_packed_row_attention_writes_nothing_but_the_kernel_per_layer(cuda_like, monkeypatch):
    """Per layer, rlpad_varlen around the varlen kernel only takes views of q/k/v (no copy, no index
    built per layer): every op it dispatches outside the kernel returns storage of its inputs.
    Control: torch 2.11's kernel has no GQA, so K and V are expanded, 2 writes per layer, which the
    same count sees."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rlpad.core import attention

    kernel, calls = cuda_like
    state = {"rlpad": False, "kernel": False}
    writes: list[str] = []

    def flagged(key, fn):
        def inner(*args, **kwargs):
            state[key] = True
            try:
                return fn(*args, **kwargs)
            finally:
                state[key] = False
        return inner

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, attention.VARLEN_ATTENTION,
                        flagged("rlpad", attention.varlen_attention_forward))
    monkeypatch.setattr(attention, "varlen_attention", flagged("kernel", attention.varlen_attention))
    monkeypatch.setattr(attn_dispatch, "expand_kv", flagged("expand", attn_dispatch.expand_kv))  # counted as rlpad's

    class Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inner_kernel = state["kernel"] and not state.get("expand")
            if state["rlpad"] and not inner_kernel:
                inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)}
                outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                if any(t.untyped_storage().data_ptr() not in inputs for t in outs):
                    writes.append(str(func))
            return out

    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1, dtype=torch.bfloat16, num_hidden_layers=3)
    batch = make_batch()
    with Writes(), torch.no_grad():
        compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE,
                          use_remove_padding=True)  # fmt: skip
    assert len(calls) == 3  # the kernel ran once per layer
    assert len(writes) == (2 * 3 if kernel == "torch_2_11" else 0), writes
