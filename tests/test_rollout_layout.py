"""Rollout layout and bad input (no vLLM engine), and the HF rollout backend on a tiny model.

Also holds the helpers the vLLM and Ray rollout tests import: the test model and the layout checks.
"""

import copy

import pytest
import torch

from rlpad.batch import Batch
from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.core.forward import compute_log_probs
from rlpad.rollout.vllm import VLLMRollout
from rlpad.rollout.hf import HFRollout
from rlpad.rollout.layout import build_rollout_batch, prompt_token_lists
from rlpad.embedded.tiny import build_tokenizer, tiny_model

PAD, EOS = 0, 1
P, R = 10, 16


def make_model(seed: int = 0):
    """A tied-embedding Qwen2 that vLLM-CPU can run (head size 32); EOS made likely enough to occur."""
    model = tiny_model("qwen2", hidden_size=128, head_dim=32, initializer_range=0.1, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[EOS] *= 3.0
    return model


def perturbed(model, seed: int = 3, scale: float = 0.5):
    """A copy of ``model`` with every weight moved by ``scale`` x its std of Gaussian noise."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=0.02))
    return new


def save_model(model, path) -> str:
    model.save_pretrained(path)
    build_tokenizer(path)
    return str(path)


def prompt_batch(lengths=(10, 3, 7, 1, 5, 10), seed: int = 0) -> Batch:
    """Left-padded prompts of the given lengths (width P), pad id 0, uids u0, u1, ..."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(P) >= P - lengths.unsqueeze(1)).long()
    ids = torch.randint(3, 80, (len(lengths), P), generator=gen) * mask
    return Batch({"input_ids": ids, "attention_mask": mask},
                 {"uid": [f"u{i}" for i in range(len(lengths))], "ground_truth": [str(i) for i in range(len(lengths))]})


def assert_rollout_layout(out: Batch, prompts: Batch, n: int, response_length: int = R) -> None:
    """The invariants of the rollout layout (docs/design.md) on a generated batch."""
    rows = len(prompts) * n
    width = prompts["input_ids"].shape[1]
    shapes = {"prompts": (rows, width), "responses": (rows, response_length), "response_mask": (rows, response_length),
              "rollout_log_probs": (rows, response_length), "input_ids": (rows, width + response_length),
              "attention_mask": (rows, width + response_length), "position_ids": (rows, width + response_length)}
    for key, shape in shapes.items():
        assert tuple(out[key].shape) == shape, key
    order = torch.arange(len(prompts)).repeat_interleave(n)
    prompt_mask = prompts["attention_mask"][order]
    # Prompt left padding preserved, tokens unchanged.
    assert torch.equal(out["attention_mask"][:, :width], prompt_mask)
    assert torch.equal(out["prompts"] * prompt_mask, prompts["input_ids"][order] * prompt_mask)
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], dim=1))
    assert torch.equal(out["attention_mask"][:, width:], out["response_mask"])
    # Responses: a prefix of ones, ending at the first EOS or at the length limit; pad after.
    mask, resp = out["response_mask"], out["responses"]
    assert (mask[:, 1:] <= mask[:, :-1]).all() and (mask[:, 0] == 1).all()
    for row, length in enumerate(mask.sum(1).tolist()):
        tokens = resp[row, :length].tolist()
        assert EOS not in tokens[:-1], f"row {row}: EOS before the end of the response"
        assert length == response_length or tokens[-1] == EOS, f"row {row}: stops at {length} without EOS"
        assert (resp[row, length:] == PAD).all()
    # Position ids continue from the prompt into the response.
    attn = out["attention_mask"]
    assert torch.equal(out["position_ids"], (attn.cumsum(1) - 1).clamp(min=0))
    for row in range(rows):
        valid = out["position_ids"][row][attn[row].bool()]
        assert torch.equal(valid, torch.arange(int(attn[row].sum())))
    lp = out["rollout_log_probs"]
    assert (lp[mask == 0] == 0).all() and (lp[mask == 1] <= 0).all()
    for key in prompts.non_tensors:
        assert list(out[key]) == [v for v in prompts[key] for _ in range(n)]


def max_log_prob_diff(model, out: Batch) -> float:
    """Largest |rollout_log_probs - compute_log_probs| over valid response tokens (both forward paths)."""
    worst = 0.0
    for rmpad in (True, False):
        lp, _ = compute_log_probs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                  out["responses"].shape[1], use_remove_padding=rmpad, temperature=out.meta["temperature"])
        mask = out["response_mask"].bool()
        worst = max(worst, float((lp.detach() - out["rollout_log_probs"])[mask].abs().max()))
    return worst


# --- bad input, before any compute -------------------------------------------------------------


def test_prompt_token_lists_strips_left_padding_and_truncates():
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert prompt_token_lists(ids, mask, max_prompt_length=5) == [[5, 6, 7], [3, 4, 5, 6, 7]]
    assert prompt_token_lists(ids, mask, max_prompt_length=3, truncation="left") == [[5, 6, 7], [5, 6, 7]]
    assert prompt_token_lists(ids, mask, max_prompt_length=3, truncation="right") == [[5, 6, 7], [3, 4, 5]]
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] have 5 tokens.*max_prompt_length=3.*truncation"):
        prompt_token_lists(ids, mask, max_prompt_length=3)


@pytest.mark.parametrize("mask, match", [
    ([[0, 0, 1], [0, 0, 0]], r"row\(s\) \[1\] are empty"),
    ([[0, 1, 1], [1, 1, 0]], r"row\(s\) \[1\] are not left-padded"),
    ([[1, 0, 1], [1, 1, 1]], r"row\(s\) \[0\] are not left-padded"),
    ([[0, 2, 1], [1, 1, 1]], "only 0 and 1"),
])
def test_prompt_token_lists_rejects_bad_masks(mask, match):
    with pytest.raises(ValueError, match=match):
        prompt_token_lists(torch.full((2, 3), 5), torch.tensor(mask), max_prompt_length=8)


def test_prompt_token_lists_rejects_bad_arguments():
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="truncation must be one of"):
        prompt_token_lists(ids, mask, max_prompt_length=8, truncation="middle")
    with pytest.raises(ValueError, match="shapes disagree"):
        prompt_token_lists(ids, mask[:, :2], max_prompt_length=8)
    with pytest.raises(ValueError, match="integer token ids"):
        prompt_token_lists(ids.float(), mask, max_prompt_length=8)


@pytest.mark.parametrize("backend", [VLLMRollout, HFRollout])
@pytest.mark.parametrize("field, value, match", [
    ("n", 0, r"rollout\.n must be an integer >= 1"),
    ("temperature", -1.0, "temperature must be >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_k", -5, "top_k must be -1"),
])
def test_bad_sampling_config_fails_before_the_engine_starts(backend, field, value, match):
    with pytest.raises(ValueError, match=match):
        backend("/nonexistent", RolloutConfig(**{field: value}), DataConfig())


def test_build_rollout_batch_cuts_at_eos_and_length():
    prompts = prompt_batch(lengths=(4, 2))
    tokens = prompt_token_lists(prompts["input_ids"], prompts["attention_mask"], max_prompt_length=P)
    responses = [[5, 6, EOS, 7], [8] * (R + 3), [EOS], [9, 9]]  # EOS mid-way, too long, EOS only, short w/o EOS
    log_probs = [[-1.0] * len(r) for r in responses]
    out = build_rollout_batch(prompts, tokens, responses, log_probs, n=2, prompt_width=P, response_length=R,
                              pad_token_id=PAD, eos_token_ids={EOS})
    assert out["response_mask"].sum(1).tolist() == [3, R, 1, 2]
    assert out["responses"][0, :4].tolist() == [5, 6, EOS, PAD]
    assert list(out["uid"]) == ["u0", "u0", "u1", "u1"]
    with pytest.raises(ValueError, match="expected 4 responses"):
        build_rollout_batch(prompts, tokens, responses[:3], log_probs, n=2, prompt_width=P, response_length=R,
                            pad_token_id=PAD, eos_token_ids={EOS})


# --- the HF backend --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory):
    model = make_model()
    path = save_model(model, tmp_path_factory.mktemp("hf_rollout"))
    rollout = RolloutConfig(name="hf", n=3, temperature=0.9, seed=0)
    return model, HFRollout(path, rollout, DataConfig(max_prompt_length=P, max_response_length=R))


def test_hf_rollout_layout_and_log_probs(hf_setup):
    model, backend = hf_setup
    prompts = prompt_batch()
    out = backend.generate(prompts)
    assert_rollout_layout(out, prompts, n=3)
    lengths = out["response_mask"].sum(1)
    assert (lengths < R).any() and (lengths == R).any()  # both EOS-ended and length-limited responses
    assert out.meta["temperature"] == 0.9
    assert max_log_prob_diff(model, out) <= 1e-4


def test_hf_rollout_validation_is_greedy(hf_setup):
    model, backend = hf_setup
    prompts = prompt_batch()
    first, second = backend.generate_validation(prompts), backend.generate_validation(prompts)
    assert_rollout_layout(first, prompts, n=1)
    assert torch.equal(first["responses"], second["responses"])
    assert first.meta["temperature"] == 1.0
    assert max_log_prob_diff(model, first) <= 1e-4


def test_sampled_validation_is_seeded(hf_setup, tmp_path):
    """With ``val_kwargs.do_sample`` the validation rollout depends on the seed the trainer passes (so a
    resumed run's val/* is the uninterrupted run's), not on how many calls the backend made before."""
    from rlpad.config.schema import ValidationSamplingConfig

    model, _ = hf_setup
    path = save_model(model, tmp_path)
    sampled = ValidationSamplingConfig(do_sample=True, temperature=1.0)
    backend = HFRollout(path, RolloutConfig(name="hf", n=3, temperature=0.9, seed=0, val_kwargs=sampled),
                        DataConfig(max_prompt_length=P, max_response_length=R))
    prompts = prompt_batch()
    first = backend.generate_validation(prompts, seed=7)["responses"]
    backend.generate(prompts)  # the backend's own call count moves on
    assert torch.equal(backend.generate_validation(prompts, seed=7)["responses"], first)
    assert not torch.equal(backend.generate_validation(prompts, seed=8)["responses"], first)  # the seed is used


def test_hf_rollout_rejects_bad_prompts(hf_setup):
    _, backend = hf_setup
    prompts = prompt_batch(lengths=(10, 3))
    prompts["attention_mask"] = prompts["attention_mask"].flip(1)  # right-padded
    with pytest.raises(ValueError, match="not left-padded"):
        backend.generate(prompts)
    with pytest.raises(ValueError, match="missing required key"):
        backend.generate(Batch({"input_ids": prompts["input_ids"]}))
