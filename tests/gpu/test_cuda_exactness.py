"""CUDA exactness, forward AND backward, on the four tiny architectures (GQA, MHA, sliding window,
q/k-norm): bf16 packed (the dispatch's varlen kernel), bf16 padded sdpa and bf16 shared prompts
against the fp32 oracle (each sequence alone, on the CPU), within rlpad.embedded.exactness's
BF16_BOUNDS, which a boundary leak through the same kernel must exceed; the profiler shows the
varlen kernel ran forward and backward. The padded path stays finite under every sdpa backend.
In fp32 the same model takes the exact sdpa fallback.
No path waits on the device once per layer: a deeper model makes no more synchronizing calls.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from lane import cuda_kernel, kernel_calls, model_pair, profiled, ran_forward_and_backward

from rlpad.bench.host_cuda import cuda_syncs
from rlpad.core.attn_dispatch import FLASH_ATTN, SDPA, flash_attn_installed, torch_varlen_missing
from rlpad.core.forward import compute_log_probs
from rlpad.core.host_plan import HostBatch
from rlpad.embedded.exactness import BF16_BOUNDS, LEAK_DETECTING, errors, leaky_packed, oracle, scored, violations
from rlpad.embedded.synthetic import grpo_batch, rollout_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

ARCHS = sorted(ARCHITECTURES)  # qwen2 (GQA, tied), llama (MHA), mistral (sliding window 8), qwen3 (qk-norm)
PROMPT, RESPONSE, VOCAB = 24, 40, 128  # the batches of tests/test_attention_bf16.py (the CPU side of the bounds)
FP32_TOL = 2e-5


def batches() -> dict[str, dict[str, torch.Tensor]]:
    """The rollout batch (8 rows) for packed / padded, the GRPO batch (3 groups x 4) for shared prompts."""
    grpo = grpo_batch(3, 4, PROMPT, RESPONSE, vocab_size=VOCAB, seed=5, shuffle=True, min_prompt=2)
    return {"rollout": rollout_batch(8, PROMPT, RESPONSE, vocab_size=VOCAB, seed=7),
            "grpo": {k: grpo[k] for k in ("input_ids", "attention_mask", "position_ids")}}


def on_cuda(batch):
    return {k: v.cuda() for k, v in batch.items()}


def test_the_dispatch_picks_a_varlen_kernel_in_bf16(record):
    kernel = cuda_kernel(torch.bfloat16)
    record(kernel_bf16=kernel, kernel_fp32=cuda_kernel(torch.float32), torch_varlen_missing=torch_varlen_missing(),
           capability=".".join(map(str, torch.cuda.get_device_capability())), flash_attn=flash_attn_installed())
    assert torch_varlen_missing() is None or flash_attn_installed(), torch_varlen_missing()
    assert kernel != SDPA and cuda_kernel(torch.float32) == SDPA


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_forward_and_backward_within_bounds(arch, record):
    kernel = cuda_kernel(torch.bfloat16)
    assert kernel != SDPA, "no varlen kernel on this GPU (test_the_dispatch_picks_a_varlen_kernel_in_bf16 says why)"
    model, model32 = model_pair(arch)
    layers = model.config.num_hidden_layers
    table, calls = {}, {}
    for kind, batch in batches().items():
        mask = batch["attention_mask"][:, -RESPONSE:]
        ref = oracle(model32, batch, RESPONSE)
        cuda_batch = on_cuda(batch)
        paths = {"rmpad": dict(rmpad=True)} if kind == "rollout" else {"shared": dict(rmpad=True, share=True)}
        for name, kw in paths.items():
            got, counts = profiled(lambda: scored(model, cuda_batch, RESPONSE, **kw))  # noqa: B023
            table[f"{name}/{kind}"] = errors(got, ref, mask)
            calls[name] = kernel_calls(counts, kernel)
        table[f"leak/{kind}"] = errors(leaky_packed(model, cuda_batch, RESPONSE), ref, mask)
        # The padded path as the product runs it: rlpad_varlen's padded branch is transformers' sdpa.
        table[f"padded/{kind}"] = errors(scored(model, cuda_batch, RESPONSE, rmpad=False), ref, mask)
    record(arch=arch, kernel=kernel, errors=table, calls=calls, bounds=BF16_BOUNDS)
    for name, errs in table.items():
        if not name.startswith("leak/"):
            assert not violations(errs), (name, violations(errs))
        else:  # the negative control: a leak through the same kernel is outside the bounds
            missed = [k for k in LEAK_DETECTING if not violations({k: errs[k]})]
            assert not missed, f"{name} stays within {missed}: {errs}"
    # The varlen kernel ran, forward and backward: one call per layer (shared prompts too).
    assert ran_forward_and_backward(calls["rmpad"], layers), calls
    assert ran_forward_and_backward(calls["shared"], layers), calls


# The sdpa backends that take a boolean mask (torch's FLASH_ATTENTION backend takes none, so the
# padded path never reaches it).
MASKED_SDPA_BACKENDS = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def masked_sdpa_backends() -> dict[str, str | None]:
    """Each sdpa backend -> None when it runs a bf16 call with a boolean mask on this GPU, else why not."""
    q = torch.randn(2, 2, 16, 32, dtype=torch.bfloat16, device="cuda")
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device="cuda").tril()
    out = {}
    for backend in (getattr(SDPBackend, name) for name in MASKED_SDPA_BACKENDS):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            out[backend.name] = None
        except RuntimeError as err:
            out[backend.name] = str(err).splitlines()[0][:120]
    return out


@pytest.mark.parametrize("backend", MASKED_SDPA_BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_padded_bf16_finite_under_each_sdpa_backend(arch, backend, record):
    """The padded path (left-padded prompts, right-padded responses, a sliding window for mistral)
    within the bounds, gradients finite, whichever kernel sdpa runs: no query row reaches it fully
    masked (rlpad.core.attention.unmask_unattended_rows)."""
    why = masked_sdpa_backends()[backend]
    if why is not None:
        pytest.skip(f"needs sdpa's {backend} kernel for a masked bf16 call (not available in this torch / GPU): {why}")
    model, model32 = model_pair(arch)
    table = {}
    for kind, batch in batches().items():
        ref = oracle(model32, batch, RESPONSE)
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            got = scored(model, on_cuda(batch), RESPONSE, rmpad=False)
        table[f"padded/{kind}"] = errors(got, ref, batch["attention_mask"][:, -RESPONSE:])
    record(arch=arch, backend=backend, errors=table)
    for name, errs in table.items():
        assert not violations(errs), (name, violations(errs))


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_fp32_on_cuda_takes_the_exact_fallback(arch, record):
    kernel = cuda_kernel(torch.bfloat16)
    model, model32 = model_pair(arch, torch.float32)
    out = {}
    for kind, batch in batches().items():
        ref = oracle(model32, batch, RESPONSE)
        share = kind == "grpo"
        got, counts = profiled(lambda: scored(model, on_cuda(batch), RESPONSE, rmpad=True, share=share))  # noqa: B023
        errs = errors(got, ref, batch["attention_mask"][:, -RESPONSE:])
        out["shared" if share else "rmpad"] = {**errs, "varlen_calls": kernel_calls(counts, kernel)["any_varlen_op"]}
    record(arch=arch, fp32=out, tolerance=FP32_TOL)
    for name, errs in out.items():
        assert errs["varlen_calls"] == 0, (name, "a varlen kernel ran in fp32")
        assert errs["lp_max"] <= FP32_TOL and errs["ent_max"] <= FP32_TOL, (name, errs)
        assert errs["grad_rel"] <= 1e-4, (name, errs)


@pytest.mark.skipif(not flash_attn_installed(), reason="needs flash-attn (not installed): flash_attention_2 vs oracle")
@pytest.mark.parametrize("arch", ARCHS)
def test_flash_attention_2_within_bounds(arch, record):
    assert cuda_kernel(torch.bfloat16) == FLASH_ATTN
    model, model32 = model_pair(arch)
    model.set_attn_implementation("flash_attention_2")
    batch = batches()["rollout"]
    errs = errors(scored(model, on_cuda(batch), RESPONSE, rmpad=True), oracle(model32, batch, RESPONSE),
                  batch["attention_mask"][:, -RESPONSE:])  # fmt: skip
    record(arch=arch, flash_attention_2=errs)
    assert not violations(errs), violations(errs)


def host_syncs(fn, where: dict | None = None) -> int:
    """The synchronizing CUDA calls ``fn`` makes (``torch.cuda.set_sync_debug_mode``: c10's own warning, not
    the mode's once-per-process prototype notice, which made the first measured forward read 2 on the H200);
    ``where`` collects the Python line of each."""
    n, lines = cuda_syncs(fn)
    if where is not None:
        for line, count in lines.items():
            where[line] = where.get(line, 0) + count
    return n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_no_host_sync_per_layer(dtype, record):
    """The packed and the shared-prompt row with 2 and 6 layers: at most ONE synchronizing call per
    forward (the read of the batch the index plan is built from, rlpad.core.host_plan), none with the
    batch's host copy given, and forward + backward the same count at any depth, run after run."""
    counts, where = {}, {}
    for layers in (2, 6):
        model = tiny_model("qwen2", vocab_size=VOCAB, seed=1, dtype=dtype, num_hidden_layers=layers).cuda().train()
        for kind, batch in batches().items():
            b, share = on_cuda(batch), kind == "grpo"
            path = "shared" if share else "rmpad"

            def forward(host=None):
                return compute_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE,  # noqa: B023
                                         use_remove_padding=True, share_prompts=share, calculate_entropy=True,  # noqa: B023
                                         check=False, host=host)

            def step():
                lp, ent = forward()
                (lp + 0.1 * ent).sum().backward()

            step()  # warm-up (lazy initialisation) of each measured call
            forward()
            host = HostBatch.of(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
            counts[f"{path}/{layers} layers/forward"] = host_syncs(forward, where)
            counts[f"{path}/{layers} layers/forward, host copy given"] = host_syncs(lambda: forward(host), where)  # noqa: B023
            counts[f"{path}/{layers} layers/forward+backward"] = [host_syncs(step, where) for _ in range(2)]
    record(dtype=str(dtype), synchronizing_calls=counts, sync_lines=where)
    for path in ("rmpad", "shared"):
        for layers in (2, 6):
            assert counts[f"{path}/{layers} layers/forward"] <= 1, counts
            assert counts[f"{path}/{layers} layers/forward, host copy given"] == 0, counts
        runs = counts[f"{path}/2 layers/forward+backward"] + counts[f"{path}/6 layers/forward+backward"]
        assert len(set(runs)) == 1, counts
    assert {line.split(":")[0] for line in where} <= {"rlpad/core/host_plan.py"}, where  # the batch's one read
