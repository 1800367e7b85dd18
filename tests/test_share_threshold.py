"""When sharing does not pay, a batch runs plain remove-padding (issue #28).

``share_min_saved`` (config: ``model.share_prompts_min_saved_fraction``): a batch whose shared
prompts save less than that fraction of its valid tokens runs the packed row, giving exactly its
numbers, and the first such batch of a run logs it once. Unset, it depends on the device: on CUDA it
sits between the H100 bench's two shapes (docs/shared_prompts.md): P=128/R<=512 (lost) below it,
P=512/R<=256 above it; on the CPU sharing paid at both, and every micro-batch shares.
"""

import logging

import pytest
import torch

from rlpad.bench.prefix import GROUPS, N, SHAPES
from rlpad.config.schema import ModelConfig
from rlpad.recipe.load import load_config
from rlpad.core.forward import compute_log_probs
from rlpad.core.shared_prompt import SEGMENTS_KWARG, min_saved_for, prompt_groups, saved_fraction
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import tiny_model

PROMPT, RESPONSE, VOCAB = 12, 10, 128


def batch():
    return grpo_batch(3, 4, PROMPT, RESPONSE, vocab_size=VOCAB, seed=5, shuffle=True, min_prompt=2)


def expected_saving(b) -> float:
    """Independently: per group (b["group"]) every prompt copy but one, over all valid tokens."""
    mask = b["attention_mask"]
    saved = 0
    for g in b["group"].unique().tolist():
        rows = (b["group"] == g).nonzero().flatten()
        saved += (len(rows) - 1) * int(mask[rows[0], :PROMPT].sum())
    return saved / int(mask.sum())


class SharedRuns:
    """A registered forward pre-hook on the first decoder layer: did this forward carry segments?"""

    def __init__(self, model):
        self.seen: list[bool] = []
        model.model.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: self.seen.append(SEGMENTS_KWARG in kwargs), with_kwargs=True)


def scores(model, b, share, **kw):
    with torch.no_grad():
        return compute_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE,
                                 use_remove_padding=True, share_prompts=share, calculate_entropy=True,
                                 **kw)  # fmt: skip


def test_saved_fraction_counts_every_prompt_copy_but_one():
    b = batch()
    groups = prompt_groups(b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE)
    got = saved_fraction(b["attention_mask"], RESPONSE, groups)
    assert 0 < got < 1 and got == pytest.approx(expected_saving(b), abs=1e-12)


def test_below_the_threshold_gives_exactly_the_rmpad_numbers_and_logs_once(caplog):
    b = batch()
    saving = expected_saving(b)
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    runs = SharedRuns(model)
    plain = scores(model, b, share=False)
    threshold = round(saving + 0.01, 6)  # a value no other test uses: its one log line is this test's
    with caplog.at_level(logging.INFO, logger="rlpad.core.forward"):
        below = [scores(model, b, share=True, share_min_saved=threshold) for _ in range(2)]
    for lp, ent in below:
        assert torch.equal(lp, plain[0]) and torch.equal(ent, plain[1])
    lines = [r for r in caplog.records if "runs plain remove-padding" in r.getMessage()]
    assert len(lines) == 1 and f"{100 * saving:.1f}%" in lines[0].getMessage(), [r.getMessage() for r in lines]
    # Control: just below the saving the batch shares (the segments reach the layers), same numbers to 2e-5.
    shared = scores(model, b, share=True, share_min_saved=round(saving - 0.01, 6))
    assert runs.seen == [False, False, False, True]
    torch.testing.assert_close(shared[0], plain[0], atol=2e-5, rtol=0)


def test_the_cuda_default_splits_the_gpu_bench_shapes():
    """Measured on the H100 (2026-11-24): P=128/R<=512 lost to rmpad; P=512/R<=256 has the larger
    ideal. The CUDA default threshold shares the second and not the first (the bench's own batches)."""
    assert ModelConfig().share_prompts_min_saved_fraction is None  # unset: by device
    default = min_saved_for(None, "cuda:0")
    shares = {}
    for prompt, response in SHAPES:
        data = grpo_batch(GROUPS, N, prompt, response, vocab_size=VOCAB, seed=0, min_prompt=prompt)
        rows = slice(0, 16)  # the GPU bench's micro-batch of 16 rows (2 groups)
        mask = data["attention_mask"][rows]
        groups = prompt_groups(data["input_ids"][rows], mask, data["position_ids"][rows], response)
        shares[(prompt, response)] = saved_fraction(mask, response, groups) >= default
    assert shares == {(512, 256): True, (128, 512): False}


def test_bad_threshold_is_refused_before_compute():
    b = batch()
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="share_min_saved must be a fraction"):
            scores(model, b, share=True, share_min_saved=bad)
    with pytest.raises(ValueError, match="share_prompts_min_saved_fraction=1.5 must be a fraction"):
        load_config("recipes/grpo_tiny.yaml", ["actor_rollout_ref.model.share_prompts_min_saved_fraction=1.5"])


def test_the_default_is_per_device_and_a_set_value_wins():
    """On the CPU sharing paid at every shape measured (P=128/R<=512 saves 0.28-0.31: 1.2-1.4x), so the
    CPU default shares every micro-batch; a configured value is used as it is on any device."""
    assert min_saved_for(None, "cpu") == 0.0 and min_saved_for(None, torch.device("cuda", 1)) == 0.5
    assert min_saved_for(None, "xpu") == min_saved_for(None, "cuda")  # another accelerator: CUDA's rule
    assert min_saved_for(0.3, "cpu") == min_saved_for(0.3, "cuda") == 0.3
    config = load_config("recipes/grpo_tiny.yaml", ["actor_rollout_ref.model.share_prompts_min_saved_fraction=0.25"])
    assert config.actor_rollout_ref.model.share_prompts_min_saved_fraction == 0.25
