"""``actor_rollout_ref.model.use_liger`` on CUDA: liger-kernel's fused RMSNorm / SwiGLU / rotary
applied by rlpad's hook (rlpad/core/fused_modules.py) to the tiny Qwen2 and Llama models in bf16,
forward AND backward against the fp32 oracle within BF16_BOUNDS (as the plain model, measured in the
same test); a boundary leak through the fused model is the negative control. Needs liger-kernel on
the GPU machine (skipped with the reason otherwise)."""

import pytest
from lane import model_pair

from rlpad.core.fused_modules import apply_fused_modules, liger_missing
from rlpad.embedded.exactness import BF16_BOUNDS, LEAK_DETECTING, errors, leaky_packed, oracle, scored, violations
from rlpad.embedded.synthetic import rollout_batch

PROMPT, RESPONSE, VOCAB = 24, 40, 128


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_liger_modules_within_the_bf16_bounds(arch, record):
    if liger_missing():
        pytest.skip(f"needs liger-kernel (not installed): {liger_missing()}")
    batch = rollout_batch(8, PROMPT, RESPONSE, vocab_size=VOCAB, seed=7)
    mask = batch["attention_mask"][:, -RESPONSE:]
    plain, model32 = model_pair(arch)
    ref = oracle(model32, batch, RESPONSE)
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    table = {"plain": errors(scored(plain, cuda_batch, RESPONSE, rmpad=True), ref, mask)}
    fused, _ = model_pair(arch)
    replaced = apply_fused_modules(fused, "liger", key="actor_rollout_ref.model.use_liger", device_type="cuda")
    table["liger"] = errors(scored(fused, cuda_batch, RESPONSE, rmpad=True), ref, mask)
    table["liger_leak"] = errors(leaky_packed(fused, cuda_batch, RESPONSE), ref, mask)
    record(arch=arch, errors=table, bounds=BF16_BOUNDS, replaced=replaced)
    layers = fused.config.num_hidden_layers
    assert sum(name.endswith("mlp") for name in replaced) == layers and "model.norm" in replaced, replaced
    for name in ("plain", "liger"):
        assert not violations(table[name]), (name, violations(table[name]))
    missed = [k for k in LEAK_DETECTING if not violations({k: table["liger_leak"][k]})]
    assert not missed, f"the leak stays within {missed}: {table['liger_leak']}"
