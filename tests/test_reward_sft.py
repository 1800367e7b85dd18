"""rlpad.embedded.reward_sft: the embedded reward model's data (never a right answer as the wrong one) and its
cached build (a one-output classification model rlpad's loader accepts, found again without training)."""

import json
import os
import random
from dataclasses import replace

from rlpad.config.schema import SFTConfig
from rlpad.core.reward_model import load_reward_model
from rlpad.embedded.reward_sft import INFO_FILE, listwise_candidates, toy_pairs, toy_reward_model, wrong_answer
from rlpad.embedded.sft import embedded_teacher
from paths import CACHE


def test_wrong_answers_are_wrong_and_varied():
    rng = random.Random(0)
    seen = set()
    for _ in range(2000):
        a, b = rng.randrange(21), rng.randrange(21)
        w = wrong_answer(a, b, rng, 40)
        assert w != str(a + b)
        seen.add(w)
    assert len(seen) > 100


def test_pairs_take_the_policy_mistakes():
    examples = [("3+4=", "7"), ("1+1=", "2")]
    pairs = toy_pairs(examples, random.Random(0), 40, sampled=[["7", "8"], ["2", "2"]], share=1.0)
    assert pairs[0] == ("3+4=", "7", "8")  # the one mistake sampled for problem 0
    assert pairs[1][2] != "2"  # no mistake sampled: a constructed wrong answer


def test_listwise_candidates_hold_the_right_answer_once():
    numbers = [str(n) for n in range(41)]
    cands = listwise_candidates("7", numbers, ["7", "8", "71", "71"])
    assert cands[0] == "7" and cands.count("7") == 1  # twice, its softmax share could never pass 1/2
    assert sorted(cands) == sorted(set(numbers) | {"71"}) and len(cands) == len(set(cands))


def test_toy_reward_model_is_built_once():
    cfg = replace(SFTConfig(), cache_dir=CACHE)  # the tests' shared cache (warm start included)
    path = toy_reward_model(cfg, steps=2, batch_size=4, listwise=2)  # a 2-step model: cheap, its own cache key
    with open(os.path.join(path, INFO_FILE)) as f:
        info = json.load(f)
    assert 0.0 <= info["val_pairwise_accuracy"] <= 1.0 and info["val_pairs"] > 0 and 0.0 <= info["val_top1"] <= 1.0
    assert info["backbone"] == embedded_teacher(cfg)  # the stronger backbone, not the policy's warm start
    model = load_reward_model(path)  # a one-output Qwen2ForSequenceClassification
    assert model.config.num_labels == 1 and type(model).__name__ == "Qwen2ForSequenceClassification"
    stamp = os.path.getmtime(os.path.join(path, INFO_FILE))
    assert toy_reward_model(cfg, steps=2, batch_size=4, listwise=2) == path
    assert os.path.getmtime(os.path.join(path, INFO_FILE)) == stamp


def test_only_the_toy_task_has_an_embedded_reward_model():
    import pytest

    from rlpad.recipe.load import load_config
    from rlpad.embedded.resolve import resolve_embedded

    config = load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.model_path=embedded:toy_long"])
    with pytest.raises(ValueError, match="embedded reward model is embedded:toy"):
        resolve_embedded(config)
