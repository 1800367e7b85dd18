"""bf16 remove-padding vs bf16 padded sdpa vs an fp32 oracle (each sequence alone), per token.

On CUDA (selected when present) ``rlpad_varlen`` runs torch's FlashAttention varlen kernel, one
call per layer on the packed row (checked with the profiler); on CPU the same test runs the
per-sequence sdpa path in bf16. The oracle runs the SAME bf16-rounded weights in fp32, every
sequence alone with no padding, so the differences are the bf16 compute error only.

Tolerances (per token, log-prob and entropy, nats): max <= 0.03 and mean <= 0.005 against the
oracle, for the packed and the padded path alike; and the packed path's mean error at most
1.5x the padded path's + 0.002 (remove-padding costs no accuracy beyond bf16's own).
Measured on CPU (torch 2.13, the 4 architectures): log-prob max 2.0e-3..2.3e-3, mean 5.8e-4..6.5e-4
for both paths; entropy max <= 2.0e-4. Not yet measured on a GPU (the table prints with ``-s``).
"""

import pytest
import torch

from rlpad.core.attention import torch_varlen_missing
from rlpad.core.forward import compute_log_probs
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

ARCHS = sorted(ARCHITECTURES)  # qwen2 (GQA, tied), llama (MHA), mistral (sliding window 8), qwen3 (qk-norm)
PROMPT, RESPONSE, VOCAB, ROWS = 24, 40, 128, 8
MAX_TOL, MEAN_TOL = 0.03, 0.005
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="selected when CUDA is present")])]


def oracle(model32, batch):
    """Every sequence alone in fp32 (float64 softmax): log-probs and entropies (B, R)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lp = torch.zeros(ids.shape[0], RESPONSE, dtype=torch.float64)
    ent = torch.zeros_like(lp)
    for row in range(ids.shape[0]):
        seq = ids[row][mask[row].bool()]
        n_prompt = int(mask[row, :PROMPT].sum())
        logp = model32(seq[None], use_cache=False).logits[0].double().log_softmax(-1)
        n_resp = int(mask[row, PROMPT:].sum())
        pos = torch.arange(n_prompt - 1, n_prompt - 1 + n_resp, device=seq.device)
        lp[row, :n_resp] = logp[pos, seq[pos + 1]].cpu()
        ent[row, :n_resp] = (-(logp[pos].exp() * logp[pos]).sum(-1)).cpu()
    return lp, ent


def bf16_path(model, batch, rmpad):
    lp, ent = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                RESPONSE, use_remove_padding=rmpad, calculate_entropy=True)
    return lp.double().cpu(), ent.double().cpu()


def stats(a, b, mask):
    diff = (a - b).abs()[mask]
    return float(diff.max()), float(diff.mean())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_rmpad_vs_padded_vs_fp32_alone(arch, device):
    batch = {k: v.to(device) for k, v in rollout_batch(ROWS, PROMPT, RESPONSE, vocab_size=VOCAB, seed=7).items()}
    model = tiny_model(arch, vocab_size=VOCAB, seed=1, dtype=torch.bfloat16, attn_implementation="rlpad_varlen")
    model = model.to(device).eval()
    model32 = tiny_model(arch, vocab_size=VOCAB, seed=1, dtype=torch.float32, attn_implementation="sdpa")
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the same bf16 weights
    model32 = model32.to(device).eval()
    mask = batch["response_mask"].bool().cpu()
    with torch.no_grad():
        ref_lp, ref_ent = oracle(model32, batch)
        if device == "cuda":
            assert torch_varlen_missing() is None, torch_varlen_missing()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                rm = bf16_path(model, batch, True)
            calls = sum(e.count for e in prof.key_averages() if "_varlen_attn" in e.key)
            assert calls >= model.config.num_hidden_layers, "the torch varlen kernel was not used"
        else:
            rm = bf16_path(model, batch, True)
        model.set_attn_implementation("sdpa")
        pad = bf16_path(model, batch, False)
    table = {}
    for name, (lp, ent) in (("rmpad", rm), ("padded", pad)):
        table[name] = {"lp": stats(lp, ref_lp, mask), "ent": stats(ent, ref_ent, mask)}
        assert not lp[~mask].any() and not ent[~mask].any()  # zero on padding
    print(f"\n{arch} {device} bf16 vs fp32 alone (max, mean): {table}")
    for name, row in table.items():
        for quantity, (mx, mean) in row.items():
            assert mx <= MAX_TOL and mean <= MEAN_TOL, (name, quantity, mx, mean)
    for quantity in ("lp", "ent"):
        assert table["rmpad"][quantity][1] <= 1.5 * table["padded"][quantity][1] + 2e-3, table
    # Negative control: the bf16 error is real (so the oracle is independent of the paths it checks).
    assert table["padded"]["lp"][0] > 1e-4
