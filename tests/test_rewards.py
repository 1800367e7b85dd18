"""Rule-based rewards: answer extraction and normalisation, dispatch, custom functions, placement."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from rlpad.batch import Batch
from rlpad.rewards.rules import (
    answers_match, boxed_score, compute_score, decode_responses, extract_boxed_answer, extract_gsm8k_answer,
    gsm8k_score, load_reward_fn, normalize_answer, place_scores, score_batch, score_responses,
)
from rlpad.rewards.verl_default import compute_score as verl_compute_score
from rlpad.embedded.tiny import build_tokenizer
from rlpad.embedded.toy import toy_partial_score, toy_score


@pytest.mark.parametrize("text, answer", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("#### 1,234\nthe end", "1,234"),
    ("first #### 1\nthen #### -5", "-5"),
    ("####42", "42"),
    ("no marker here 42", None),
    ("#### \n", None),
])
def test_extract_gsm8k(text, answer):
    assert extract_gsm8k_answer(text) == answer


@pytest.mark.parametrize("text, answer", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{ {a}+{b} }", "{a}+{b}"),
    ("\\fbox{-3}", "-3"),
    ("\\boxed{12", None),
    ("42", None),
])
def test_extract_boxed(text, answer):
    assert extract_boxed_answer(text) == answer


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)), ("+42", Fraction(42)), (" 42 ", Fraction(42)), ("42.0", Fraction(42)),
    ("42.", Fraction(42)), ("-7", Fraction(-7)), ("\u22127", Fraction(-7)), ("1,234,567", Fraction(1234567)),
    ("$1,000.50", Fraction(2001, 2)), ("-0.25", Fraction(-1, 4)), ("3/4", Fraction(3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)), ("-\\dfrac{1}{2}", Fraction(-1, 2)), ("50%", Fraction(50)),
    ("18 dollars", Fraction(18)), ("1e3", Fraction(1000)), (".5", Fraction(1, 2)),
    ("x + 1", "x+1"), ("2x", "2x"), ("", None), (None, None), ("1/0", "1/0"),
])
def test_normalize_answer(text, value):
    assert normalize_answer(text) == value


@pytest.mark.parametrize("pred, truth, same", [
    ("1,000", "1000", True), ("1000.00", "1000", True), ("+5", "5", True), ("-5", "5", False),
    ("0.5", "1/2", True), ("3.14", "3.140", True), ("3.14", "3.15", False), ("x+1", "x + 1", True),
    ("", "", False), ("72", 72, True),
])
def test_answers_match(pred, truth, same):
    assert answers_match(pred, truth) is same


def test_gsm8k_and_boxed_scores():
    assert gsm8k_score("3 * 24 = 72\n#### 72", "72") == 1.0
    assert gsm8k_score("#### 1,200", "1200") == 1.0
    assert gsm8k_score("#### -3", "-3") == 1.0
    assert gsm8k_score("#### 3", "-3") == 0.0
    assert gsm8k_score("the answer is 72", "72") == 0.0  # no final-answer marker
    assert gsm8k_score("\\boxed{72}", "72") == 1.0  # boxed accepted as a fallback
    assert gsm8k_score("#### 72", "Natalia sold 48/2 = 24 clips...\n#### 72") == 1.0  # raw GSM8K answer field
    assert boxed_score("thus \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert boxed_score("\\boxed{2.50}", "\\boxed{2.5}") == 1.0
    assert boxed_score("\\boxed{x^2}", "x^2") == 1.0
    assert boxed_score("\\boxed{3}", "4") == 0.0


def test_compute_score_dispatch():
    assert compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert compute_score("lighteval/MATH", "\\boxed{5}", "5") == 1.0
    assert compute_score("my_gsm8k_copy", "#### 5", "5") == 1.0
    assert compute_score("rlpad/toy_add", "19", "19") == 1.0
    assert compute_score("rlpad/toy_add", "19 ", "19") == 0.0
    with pytest.raises(ValueError, match=r"no rule-based reward for data_source 'weather'.*reward.fn"):
        compute_score("weather", "x", "y")


def test_toy_rewards():
    assert toy_score("19", "19") == 1.0
    assert toy_score("19", 19) == 1.0
    for wrong in ("", "1", "199", "19+1", " 19", "18"):
        assert toy_score(wrong, "19") == 0.0
    assert toy_partial_score("19", "19") == 1.0
    assert toy_partial_score("19+2", "19") == 0.5
    assert toy_partial_score("199", "19") == 0.1
    assert toy_partial_score("18", "19") == 0.1
    assert toy_partial_score("ab", "19") == 0.0
    assert toy_partial_score("", "19") == 0.0


def test_load_reward_fn(tmp_path, monkeypatch):
    assert load_reward_fn(None) is verl_compute_score  # the default: verl's (tests/test_verl_parity.py)
    assert load_reward_fn("rlpad.rewards.verl_default:compute_score") is verl_compute_score
    assert load_reward_fn("rlpad.rewards.rules:compute_score") is compute_score
    assert load_reward_fn("rlpad.embedded.toy:toy_score") is toy_score
    assert load_reward_fn("rlpad.embedded.toy.toy_score") is toy_score
    (tmp_path / "my_reward_mod.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return len(solution_str)\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("my_reward_mod:score")("s", "abc", "x") == 3
    assert load_reward_fn(f"{tmp_path}/my_reward_mod.py:score")("s", "ab", "x") == 2
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg.mod'"):
        load_reward_fn("no_such_pkg.mod:score")
    with pytest.raises(ValueError, match=r"has no function 'scor' \(did you mean 'score'\?\)"):
        load_reward_fn("my_reward_mod:scor")
    with pytest.raises(ValueError, match="not a function"):
        load_reward_fn("my_reward_mod:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/nope.py:score")
    with pytest.raises(ValueError, match="package.module:function"):
        load_reward_fn("score")


def test_place_scores_on_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    out = place_scores([0.5, 1.0, -2.0, 3.0], mask)
    assert out.dtype == torch.float32 and out.shape == (4, 5)
    assert out.tolist() == [[0, 0, 0.5, 0, 0], [0, 0, 0, 0, 1.0], [-2.0, 0, 0, 0, 0], [3.0, 0, 0, 0, 0]]
    assert torch.equal(out.sum(-1), torch.tensor([0.5, 1.0, -2.0, 3.0]))


def _responses(tok, texts, R=6):
    ids = torch.zeros(len(texts), R, dtype=torch.long)
    mask = torch.zeros(len(texts), R, dtype=torch.long)
    for i, t in enumerate(texts):
        row = tok(t, add_special_tokens=False)["input_ids"][: R - 1] + [tok.eos_token_id]
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def test_score_responses_decodes_and_places():
    tok = build_tokenizer()
    ids, mask = _responses(tok, ["19", "18", "7"])
    assert decode_responses(tok, ids, mask) == ["19", "18", "7"]  # EOS and padding dropped
    tls, seq, acc = score_responses(tok, ids, mask, ["rlpad/toy_add"] * 3, ["19", "19", "7"])
    assert seq.tolist() == [1.0, 0.0, 1.0] and acc.tolist() == seq.tolist()  # a plain score is its own acc
    assert tls[0].tolist() == [0, 0, 1.0, 0, 0, 0]  # on the EOS, the last valid token
    assert tls[2].tolist() == [0, 1.0, 0, 0, 0, 0]


def test_score_batch_with_custom_fn_and_extra_info():
    tok = build_tokenizer()
    ids, mask = _responses(tok, ["ab", "abc"])
    batch = Batch({"responses": ids, "response_mask": mask},
                  {"data_source": ["s", "s"], "ground_truth": ["x", "y"], "extra_info": [{"w": 2.0}, {"w": 3.0}]})
    seen = []

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth))
        return {"score": extra_info["w"] * len(solution_str), "acc": len(solution_str) - 2}

    tls, seq, acc = score_batch(batch, tok, fn)
    assert seen == [("s", "ab", "x"), ("s", "abc", "y")]
    assert seq.tolist() == [4.0, 9.0] and tls[1, 3].item() == 9.0 and acc.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="reward: batch is missing required key"):
        score_batch(batch.select("responses", "response_mask"), tok, fn)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, np.float32("nan")])
def test_non_finite_reward_names_the_row(bad):
    tok = build_tokenizer()
    ids, mask = _responses(tok, ["1", "2", "3"])

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return bad if solution_str == "3" else 1.0

    with pytest.raises(ValueError, match=r"reward for row 2 \(data_source 'src'\) is .*must be finite"):
        score_responses(tok, ids, mask, ["src"] * 3, ["a"] * 3, reward_fn=fn)


def test_non_numeric_reward_names_the_row():
    tok = build_tokenizer()
    ids, mask = _responses(tok, ["1"])
    with pytest.raises(ValueError, match=r"returned 'good' for row 0"):
        score_responses(tok, ids, mask, ["s"], ["a"], reward_fn=lambda **kw: "good")
