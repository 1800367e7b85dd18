"""rlpad.core.reward_model: one score per sequence at its last valid token, packed = padded = alone = HF."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from rlpad.core.reward_model import compute_scores, last_token_columns, load_reward_model, score_head
from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import build_tokenizer, tiny_model, tiny_reward_model

PROMPT, RESPONSE, VOCAB = 12, 10, 128
TOL = FP32_LOGPROB_TOL  # fp32, per sequence (derivation: rlpad/embedded/exactness.py)
FAR = 100 * TOL  # a negative control must miss the bound by this much


@pytest.fixture(scope="module")
def batch():
    # left-padded prompts, right-padded responses, ragged; row 0 full length, row 1 a one-token response
    return rollout_batch(6, PROMPT, RESPONSE, vocab_size=VOCAB, seed=3)


def sequences(batch) -> list[torch.Tensor]:
    return [row[m.bool()] for row, m in zip(batch["input_ids"], batch["attention_mask"])]


def hidden_alone(model, seq: torch.Tensor) -> torch.Tensor:
    """(L, H): the backbone on one sequence, no padding."""
    return getattr(model, model.base_model_prefix)(input_ids=seq[None], use_cache=False).last_hidden_state[0]


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("head", ["sequence", "token"])
def test_packed_padded_alone_and_hf_agree(arch, head, batch, tmp_path):
    rm = tiny_reward_model(arch, head=head, seed=1, vocab_size=VOCAB)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    seqs = sequences(batch)
    assert min(len(s) for s in seqs) < max(len(s) for s in seqs)  # ragged
    assert int(batch["attention_mask"][1, PROMPT:].sum()) == 1  # a one-token response
    rm.save_pretrained(tmp_path)
    auto = AutoModelForSequenceClassification if head == "sequence" else AutoModelForTokenClassification
    hf = auto.from_pretrained(tmp_path, attn_implementation="eager").eval()  # Hugging Face's own forward
    with torch.no_grad():
        packed = compute_scores(rm, *args, use_remove_padding=True)
        padded = compute_scores(rm, *args, use_remove_padding=False)
        alone = torch.stack([rm.score(hidden_alone(rm, s)[-1]).float()[0] for s in seqs])
        hf_logits = [hf(input_ids=s[None]).logits for s in seqs]
        hf_alone = torch.stack([lg[0, 0] if head == "sequence" else lg[0, -1, 0] for lg in hf_logits])
        # HF batched, right-padded (its default positions arange are right for right padding)
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)], mask[i, :len(s)] = s, 1
        out = hf(input_ids=ids, attention_mask=mask).logits
        hf_batched = out[:, 0] if head == "sequence" else out[torch.arange(len(seqs)), mask.sum(1) - 1, 0]
    assert packed.shape == padded.shape == (6,) and packed.dtype == torch.float32
    for other in (padded, alone, hf_alone, hf_batched):
        torch.testing.assert_close(packed, other.float(), atol=TOL, rtol=0)
    assert packed.std() > FAR  # the sequences' scores differ: the comparison can tell them apart


@pytest.mark.exactness
def test_negative_controls_one_early_and_a_pad_position(batch):
    """Reading the head one position early, or at a pad column, misses the bound by far."""
    rm = tiny_reward_model("qwen2", seed=1, vocab_size=VOCAB)
    mask = batch["attention_mask"]
    with torch.no_grad():
        packed = compute_scores(rm, batch["input_ids"], mask, batch["position_ids"])
        early = torch.stack([rm.score(hidden_alone(rm, s)[-2]).float()[0] for s in sequences(batch)])
        hidden = rm.model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                          use_cache=False).last_hidden_state
        padded_rows = (mask == 0).any(1).nonzero().flatten()
        pad_cols = (mask[padded_rows] == 0).long().argmax(1)  # each padded row's first pad column
        at_pad = rm.score(hidden[padded_rows, pad_cols]).float()[:, 0]
    assert padded_rows.numel() >= 3
    assert (early - packed).abs().min() > FAR
    assert (at_pad - packed[padded_rows]).abs().min() > FAR


@pytest.mark.exactness
def test_scores_on_text_equal_hf(tmp_path):
    """Through the saved folder and its tokenizer: rlpad's loader + packed scoring = HF on the same text."""
    tok = build_tokenizer(tmp_path)
    tiny_reward_model("qwen2", seed=2, vocab_size=VOCAB).save_pretrained(tmp_path)
    texts = ["3+4=7", "12+30=42#", "1+1=3", "9"]
    enc = tok(texts, return_tensors="pt", padding=True)  # left padding
    rm = load_reward_model(str(tmp_path))
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        ours = compute_scores(rm, enc["input_ids"], enc["attention_mask"])
        theirs = torch.stack([hf(**tok(t, return_tensors="pt")).logits[0, 0] for t in texts])
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)


def test_last_token_columns():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]])
    assert last_token_columns(mask).tolist() == [2, 3, 2]


def test_not_a_reward_model_is_refused_naming_its_head(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        load_reward_model(str(tmp_path / "lm"))
    tiny_reward_model("llama", num_labels=2).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="num_labels=2"):
        load_reward_model(str(tmp_path / "two"))
    with pytest.raises(ValueError, match="causal LM built in code"):
        load_reward_model("tiny:qwen2")
    with pytest.raises(ValueError, match="not a local directory"):
        load_reward_model(str(tmp_path / "missing"))


def test_bad_inputs_refused_before_compute(batch):
    rm = tiny_reward_model("qwen2", vocab_size=VOCAB)
    holed = batch["attention_mask"].clone()
    holed[0, 3] = 0
    with pytest.raises(ValueError, match="holes"):
        compute_scores(rm, batch["input_ids"], holed)
    bad = batch["input_ids"].clone()
    bad[0, -1] = VOCAB
    with pytest.raises(ValueError, match="vocabulary"):
        compute_scores(rm, bad, batch["attention_mask"])
    sdpa = tiny_reward_model("qwen2", vocab_size=VOCAB, attn_implementation="sdpa")
    with pytest.raises(ValueError):
        compute_scores(sdpa, batch["input_ids"], batch["attention_mask"], use_remove_padding=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_reward_models_head_runs_in_fp32(dtype, batch):
    """Issue 51 item 17: a bf16 / fp16 reward model's one-output head runs in fp32: scores 3.170 and 3.178 stay
    apart (a bf16 head rounds both to 3.171875), and each score is the fp64 product of the model's own (half)
    hidden state and head weights to fp32's rounding; the half-precision head (the negative control) misses."""
    head = torch.nn.Linear(2, 1).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 1.0]]))
        head.bias.zero_()
    model = torch.nn.Module()
    model.score = head
    last = torch.tensor([[3.0, 0.170], [3.0, 0.178]], dtype=dtype)
    scores = score_head(model, last)
    assert scores.dtype == torch.float32 and scores[0] != scores[1]
    expected = last.double().sum(1)  # the half hidden states' exact sum
    assert (scores.double() - expected).abs().max() < 1e-6
    if dtype == torch.bfloat16:
        assert head(last).float().squeeze(-1).tolist() == [3.171875, 3.171875]  # what the bf16 head gave
    rm = tiny_reward_model("qwen2", seed=1, vocab_size=VOCAB).to(dtype)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    with torch.no_grad():
        got = compute_scores(rm, *args)
        states = torch.stack([hidden_alone(rm, s)[-1] for s in sequences(batch)])
        exact = states.double() @ rm.score.weight.double().T
        half = rm.score(states).double()
    # the fp32 sum of H products of half numbers (exact in fp32): |error| <= gamma_H * sum |w x|, gamma_H ~ H * 2^-24
    bound = states.shape[-1] * 2.0 ** -24 * float((states.double().abs() @ rm.score.weight.detach().double().abs().T).max())
    assert (score_head(rm, states).double() - exact.squeeze(-1)).abs().max() < bound
    assert (half.squeeze(-1) - exact.squeeze(-1)).abs().max() > bound  # the half head rounds past it
    assert got.dtype == torch.float32 and bool((got != got.to(dtype).float()).any())  # not rounded to half on the way
