"""The FLOP model behind the benchmarks' 'FLOP-ideal speedup': a hand count on a tiny batch, and
torch's FLOP counter on the real forward of each scoring path."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from rlpad.bench.flops import (AttentionBlock, ForwardWork, forward_flops, packed_peer_work, packed_work,
                               padded_and_packed_flops, padded_work, shared_prompt_work)
from rlpad.core.forward import compute_log_probs
from rlpad.core.layout import position_ids_from_mask
from rlpad.core.shared_prompt import prompt_groups
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import tiny_config, tiny_model

# Three rows, 3 prompt + 3 response columns. Rows 0 and 1 share a 3-token prompt (responses of 2
# and 3 tokens); row 2 has a 2-token prompt and a 1-token response.
MASK = torch.tensor([[1, 1, 1, 1, 1, 0],
                     [1, 1, 1, 1, 1, 1],
                     [0, 1, 1, 1, 0, 0]])
R = 3
GROUPS = [[0, 1], [2]]
# 2 layers of hidden 64, 2 heads x 32, intermediate 128, vocab 100, no GQA.
CFG = dict(hidden_size=64, head_dim=32, num_hidden_layers=2, intermediate_size=128, vocab_size=100)
LAYER_WEIGHTS = 64 * (64 + 2 * 64) + 64 * 64 + 3 * 64 * 128  # q, k, v; o; gate, up, down = 40960


def test_work_by_hand():
    padded = padded_work(MASK, R)
    assert (padded.tokens, padded.head_tokens) == (3 * 6, 2 + 3 + 1)  # the head runs on the 6 scored tokens only
    assert padded.pairs == padded.rectangle_pairs == 3 * 6 * 6  # masked sdpa computes every (query, key) pair

    packed = packed_work(MASK, R)
    assert (packed.tokens, packed.head_tokens) == (5 + 6 + 3, 6)
    assert packed.pairs == 15 + 21 + 6  # causal n(n+1)/2 for sequences of 5, 6, 3
    assert packed.rectangle_pairs == 25 + 36 + 9

    for causal, responses in ((True, (2 * 3 + 3) + (3 * 3 + 6) + (1 * 2 + 1)),  # L*P + L(L+1)/2
                              (False, 2 * 5 + 3 * 6 + 1 * 3)):  # L*(P+L): the masked sdpa of the CPU branch
        shared = shared_prompt_work(MASK, R, GROUPS, causal_responses=causal)
        assert (shared.tokens, shared.head_tokens) == (3 + 2 + 3 + 2 + 1, 6)  # each prompt once
        assert shared.pairs == 6 + 3 + responses  # prompts causal: 3*4/2 + 2*3/2

    # transformers packed: the 14 valid tokens in one row, full logits on all of them.
    sdpa, flex = packed_peer_work(MASK, R, masked=True), packed_peer_work(MASK, R, masked=False)
    assert (sdpa.tokens, sdpa.head_tokens) == (flex.tokens, flex.head_tokens) == (14, 14)
    assert sdpa.pairs == 14 * 14  # one explicit (block-diagonal) mask: sdpa computes every pair
    assert flex.pairs == packed.pairs == 15 + 21 + 6  # the block mask skips what is masked (causal per sequence)


def test_flops_by_hand():
    cfg = tiny_config("llama", **CFG)
    padded, packed = padded_and_packed_flops(cfg, MASK, R)
    per_pair = 2 * 2 * 2 * 32 * 2  # QK^T and PV, 2 FLOPs per multiply-add, 2 heads x 32, 2 layers
    assert padded == {"linear": 2 * 18 * LAYER_WEIGHTS * 2, "attention": 108 * per_pair, "head": 2 * 6 * 64 * 100,
                      "total": 2_949_120 + 55_296 + 76_800}
    assert packed == {"linear": 2 * 14 * LAYER_WEIGHTS * 2, "attention": 42 * per_pair, "head": 2 * 6 * 64 * 100,
                      "total": 2_293_760 + 21_504 + 76_800}
    # The model before it modelled the core: head on all 3 x 3 response columns, causal padded pairs.
    old_padded = 2_949_120 + 3 * 21 * per_pair + 2 * 9 * 64 * 100
    assert abs(padded["total"] / packed["total"] - 3_081_216 / 2_392_064) < 1e-12
    assert old_padded != padded["total"]


def test_ideal_speedup_is_one_without_padding_and_grows_with_it():
    cfg = tiny_config("qwen2")
    full = torch.ones(4, 16, dtype=torch.long)
    padded, packed = padded_and_packed_flops(cfg, full, response_length=8)
    assert padded == packed  # no padding: transformers passes no mask, sdpa runs causal like the packed path
    half = full.clone()
    half[:, :4] = 0
    half[:, -4:] = 0
    padded2, packed2 = padded_and_packed_flops(cfg, half, response_length=8)
    assert padded2["linear"] == padded["linear"] and padded2["attention"] > padded["attention"]  # now masked: S x S
    assert padded2["head"] == packed2["head"] == padded["head"] / 2  # 4 of 8 response tokens scored per row
    assert 2.0 < padded2["total"] / packed2["total"] < 2.5


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="response_length=7 must be in"):
        packed_work(MASK, 7)
    with pytest.raises(ValueError, match="groups must partition the 3 rows"):
        shared_prompt_work(MASK, R, [[0, 1]], causal_responses=True)
    assert AttentionBlock(2, 3, 5, causal=True).pairs == 2 * (3 * 2 + 6)
    assert ForwardWork(1, (), 0).pairs == 0


def _counted(model, data, response, **kw) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        compute_log_probs(model, data["input_ids"], data["attention_mask"], data["position_ids"], response,
                          calculate_entropy=True, **kw)
    return counter.get_total_flops()


def _rotary_flops(model, tokens: int) -> int:
    """What the counter sees of the rotary table for ``tokens`` positions (0 where it is elementwise)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model.rotary_emb(torch.zeros(1), torch.arange(tokens)[None])
    return counter.get_total_flops()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # GQA + qkv bias + tied head; MHA + untied head
def test_flop_model_matches_torch_flop_counter_on_the_real_forward(arch):
    """torch's counter sees every matmul of the real forward. CPU's fused sdpa kernel has no FLOP
    formula (it counts 0), so with it the counter checks tokens x weights and the head; with the
    math backend sdpa decomposes into bmm over every (query, key) pair, which checks the attention
    problems each path runs (their full rectangles: the math kernel skips nothing). The counter
    also sees what the model leaves out: the rotary table where a transformers version builds it
    with a matmul (counted here on its own). The chunked head counts the same matmuls as the whole
    logits: its E_p[z] is an elementwise centred sum, not a GEMV."""
    model = tiny_model(arch, vocab_size=96, hidden_size=64, head_dim=32, num_hidden_layers=2, intermediate_size=96)
    cfg = model.config
    prompt, response = 6, 5
    data = grpo_batch(3, 3, prompt, response, vocab_size=96, seed=3)
    data["position_ids"] = position_ids_from_mask(data["attention_mask"])
    mask = data["attention_mask"]
    groups = prompt_groups(data["input_ids"], mask, data["position_ids"], response)
    assert len(groups) == 3 and int(mask.sum()) < mask.numel()  # real padding, real sharing
    per_pair = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    paths = {"padded": (padded_work(mask, response), dict(use_remove_padding=False)),
             "packed": (packed_work(mask, response), dict(use_remove_padding=True)),
             "shared": (shared_prompt_work(mask, response, groups, causal_responses=False),
                        dict(use_remove_padding=True, share_prompts=True))}
    for name, (work, kw) in paths.items():
        f = forward_flops(cfg, work)
        rotary = _rotary_flops(model, work.tokens)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            assert _counted(model, data, response, **kw) == f["linear"] + f["head"] + rotary, name
            chunked = _counted(model, data, response, logits_chunk_size=4, **kw)
            assert chunked == f["linear"] + f["head"] + rotary, name
        with sdpa_kernel(SDPBackend.MATH):
            counted = _counted(model, data, response, **kw)
        assert counted == f["linear"] + f["head"] + rotary + work.rectangle_pairs * per_pair, name
    # Negative control: the head on every response column (the old padded count) is not what runs.
    padded = paths["padded"][0]
    wrong = ForwardWork(padded.tokens, padded.attention, mask.shape[0] * response)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        counted = _counted(model, data, response, use_remove_padding=False)
    f = forward_flops(cfg, wrong)
    assert counted != f["linear"] + f["head"] + _rotary_flops(model, padded.tokens)
