"""Multi-turn rows: tool output inside the response is attended (attention_mask 1) and never scored
(response_mask 0). Per token against each sequence run alone; the loss gradient at tool positions."""

import pytest
import torch

from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.algorithms.losses import agg_loss, compute_policy_loss, kl_penalty
from rlpad.core.forward import compute_log_probs
from rlpad.core.host_plan import HostBatch, packed_plan
from rlpad.core.layout import position_ids_from_mask
from rlpad.core.value import ValueModel
from rlpad.embedded.synthetic import grpo_batch, ppo_batch, with_tool_spans
from rlpad.embedded.tiny import tiny_model
from workers.actor import ActorWorker
from tests.test_workers_local import actor_config

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

PROMPT, RESPONSE, VOCAB = 10, 16, 128
TOL = FP32_LOGPROB_TOL  # derivation: rlpad/embedded/exactness.py


@pytest.fixture(scope="module")
def batch():
    """4 prompt groups of 3 rows (shared prompts), random lengths, tool spans inside the responses."""
    b = grpo_batch(4, 3, PROMPT, RESPONSE, vocab_size=VOCAB, seed=3, min_prompt=2)
    b["position_ids"] = position_ids_from_mask(b["attention_mask"])
    b["response_mask"] = with_tool_spans(b["attention_mask"][:, PROMPT:], seed=5)
    tool = b["attention_mask"][:, PROMPT:].bool() & ~b["response_mask"].bool()
    assert tool.sum() >= 10 and tool.any(1).sum() >= 6  # many rows hold tool output
    return b


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=1)


def alone(model, b):
    """Each sequence by itself (no padding, no packing), every valid response token scored: fp64 log-softmax."""
    ids, mask = b["input_ids"], b["attention_mask"]
    lp = torch.zeros(ids.shape[0], RESPONSE, dtype=torch.float64)
    with torch.no_grad():
        for row in range(ids.shape[0]):
            seq = ids[row][mask[row].bool()]
            n_prompt = int(mask[row, :PROMPT].sum())
            logp = model(seq[None], use_cache=False).logits[0].double().log_softmax(-1)
            for t in range(int(mask[row, PROMPT:].sum())):
                lp[row, t] = logp[n_prompt + t - 1, seq[n_prompt + t]]
    return lp


PATHS = {"padded": dict(use_remove_padding=False), "rmpad": dict(use_remove_padding=True),
         "shared": dict(use_remove_padding=True, share_prompts=True)}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_generated_tokens_equal_alone_tool_tokens_exactly_zero(model, batch, path):
    ref = alone(model, batch)
    gen, tool = batch["response_mask"].bool(), batch["attention_mask"][:, PROMPT:].bool() & ~batch["response_mask"].bool()
    with torch.no_grad():
        lp, ent = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE,
                                    calculate_entropy=True, response_mask=batch["response_mask"], **PATHS[path])
    torch.testing.assert_close(lp[gen].double(), ref[gen], atol=TOL, rtol=0)
    assert (lp[~gen] == 0).all() and (ent[~gen] == 0).all() and (ent[gen] != 0).all()
    # The tool tokens were context: scored without response_mask they have real log-probs.
    with torch.no_grad():
        full, _ = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                    RESPONSE, **PATHS[path])
    torch.testing.assert_close(full[tool].double(), ref[tool], atol=TOL, rtol=0)
    assert (full[tool] != 0).all()
    torch.testing.assert_close(full[gen], lp[gen], atol=TOL, rtol=0)


@pytest.mark.parametrize("share", [False, True])
def test_values_zero_on_tool_tokens(model, batch, share):
    critic = ValueModel(model, seed=2)
    with torch.no_grad():
        v = critic(batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE,
                   share_prompts=share, response_mask=batch["response_mask"])
        full = critic(batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE, share_prompts=share)
    gen = batch["response_mask"].bool()
    assert (v[~gen] == 0).all()
    torch.testing.assert_close(v[gen], full[gen], atol=TOL, rtol=0)


def actor_loss(model, b, response_mask, rmpad):
    """The actor's loss (as workers.actor._policy_loss: clipped PG + entropy bonus + low-var KL)."""
    lp, ent = compute_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE,
                                use_remove_padding=rmpad, calculate_entropy=True, response_mask=response_mask)
    pg, _ = compute_policy_loss(b["old_log_probs"], lp, b["advantages"], response_mask, 0.2, 0.2, 3.0, "token-mean")
    kl = agg_loss(kl_penalty(lp, b["ref_log_probs"], "low_var_kl"), response_mask, "token-mean")
    return pg - 0.01 * agg_loss(ent, response_mask, "token-mean") + 0.1 * kl


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "rmpad"])
def test_loss_gradient_at_tool_positions_is_exactly_zero(rmpad):
    """A hook on the final norm's output (the LM head's input, one row per position: its gradient is
    that of the logits there) records the gradient at the slot scoring each response token. Tool
    slots: exactly 0. Negative control: tool tokens treated as generated -> another loss, and
    nonzero gradient there."""
    model = tiny_model("qwen2", seed=4)
    b = ppo_batch(8, PROMPT, RESPONSE, vocab_size=VOCAB, seed=7).tensors
    attn_resp = b["attention_mask"][:, PROMPT:]
    mask = with_tool_spans(attn_resp, seed=9)
    tool = attn_resp.bool() & ~mask.bool()
    # the slot (flat index into the norm's output) scoring each valid response token
    if rmpad:
        plan = packed_plan(HostBatch.of(b["input_ids"], b["attention_mask"], b["position_ids"]), RESPONSE)
        slots = torch.full((8 * RESPONSE,), -1, dtype=torch.long)
        slots[plan.response_idx] = plan.score_slots
    else:
        rows, cols = torch.meshgrid(torch.arange(8), torch.arange(RESPONSE), indexing="ij")
        slots = (rows * (PROMPT + RESPONSE) + PROMPT - 1 + cols).reshape(-1)
    slots = slots.view(8, RESPONSE)
    grads = {}

    def hook(_module, _inputs, out):
        out.register_hook(lambda g: grads.__setitem__("g", g.reshape(-1, g.shape[-1]).clone()))

    handle = model.model.norm.register_forward_hook(hook)
    losses = {}
    for name, m in (("multi_turn", mask), ("control", attn_resp)):
        model.zero_grad()
        loss = actor_loss(model, b, m, rmpad)
        loss.backward()
        losses[name] = (loss.item(), grads["g"])
    handle.remove()
    loss, g = losses["multi_turn"]
    assert (g[slots[tool]] == 0).all()
    assert (g[slots[mask.bool()]].abs().sum(-1) > 0).all()  # the generated tokens do get gradient
    control_loss, control_g = losses["control"]
    assert control_loss != loss
    assert (control_g[slots[tool]].abs().sum(-1) > 0).all()


def test_first_mini_batch_exactly_on_policy_with_tool_turns():
    """ActorWorker (world 1): old log-probs in the update's layout (two mini-batches, token-budget
    micro-batches), then the update: ratio == 1 bitwise on the first mini-batch of multi-turn rows."""
    w = ActorWorker(actor_config(use_kl_loss=True, entropy_coeff=0.01, ppo_mini_batch_size=4,
                                 use_dynamic_bsz=True, ppo_max_token_len_per_gpu=60), device="cpu")
    w.init_model()
    for step in range(2):
        b = ppo_batch(8, PROMPT, RESPONSE, vocab_size=VOCAB, seed=20 + step)
        b["response_mask"] = with_tool_spans(b["attention_mask"][:, PROMPT:], seed=step)
        for k in ("advantages", "ref_log_probs"):
            b[k] = b[k] * b["response_mask"]
        old = w.compute_log_prob(b, update_layout=True)
        tool = b["attention_mask"][:, PROMPT:].bool() & ~b["response_mask"].bool()
        assert tool.any() and (old["old_log_probs"][tool] == 0).all() and (old["entropy"][tool] == 0).all()
        b.update(old)
        m = w.update_actor(b)
        assert m["actor/first_mini_batch/ppo_kl"] == 0.0 and m["actor/first_mini_batch/log_ratio_abs_max"] == 0.0
        assert m["actor/log_ratio_abs_max"] > 1e-4  # the second mini-batch sees the moved policy


def test_bad_response_mask_is_named(model, batch):
    args = (model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    bad = batch["response_mask"].clone()
    bad[0, -1] = 1  # row 0 of a grpo batch is full length: find a padded row instead
    pad_row = int((batch["attention_mask"][:, -1] == 0).nonzero()[0])
    bad[pad_row, -1] = 1
    with pytest.raises(ValueError, match="response_mask is 1 on padding"):
        compute_log_probs(*args, use_remove_padding=True, response_mask=bad)
    with pytest.raises(ValueError, match="response_mask must be a"):
        compute_log_probs(*args, use_remove_padding=True, response_mask=batch["response_mask"][:, :-1])
    with pytest.raises(ValueError, match="only 0 and 1"):
        compute_log_probs(*args, use_remove_padding=True, response_mask=batch["response_mask"] * 2)
