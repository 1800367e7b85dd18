"""Validation metrics (rlpad/training/validation_metrics.py) against verl 0.9.1's own
``process_validation_metrics`` and the names its trainer logs, and the reward functions' ``pred`` on
its way there.

verl's numbers come from scripts/verl_val_parity.py (run in verl's own environment): recorded in
tests/fixtures/verl_val_metrics.json (always compared) and re-run live when ``$RLPAD_VERL_PYTHON``
names a Python with verl (or verl is importable here). The cases: three data sources, N = 1, 4, 16,
votes that tie, rows without an answer, another seed. Independently of verl, a plain loop written
here from the definition checks the majority vote, and negative controls show the comparison sees a
changed seed and a changed tie rule.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from rlpad.batch import Batch
from rlpad.rewards.rules import REWARD_EXTRA_INFO, score_batch
from rlpad.training.validation_metrics import (ALL_SOURCES, ValidationRows, _draws, majority_values, metric_keys,
                                               per_source_metrics, prompt_metrics, subset_sizes, validation_report,
                                               vote_picks)
from verl_peer import RecordedPeer

PEER = RecordedPeer("verl_val_metrics.json", "verl_val_parity.py")
recorded, live, sources = PEER.recorded, PEER.live, PEER.sources
BOUND = 1e-12


def assert_same(ours: dict, theirs: dict, where: str) -> int:
    """Same keys (nested), every value within BOUND; returns how many values were compared."""
    assert set(ours) == set(theirs), f"{where}: keys differ: only rlpad {sorted(set(ours) - set(theirs))}, " \
                                     f"only verl {sorted(set(theirs) - set(ours))}"
    count = 0
    for key, value in theirs.items():
        if isinstance(value, dict):
            count += assert_same(ours[key], value, f"{where}/{key}")
        else:
            assert abs(ours[key] - value) <= BOUND, f"{where}/{key}: rlpad {ours[key]!r}, verl {value!r}"
            count += 1
    return count


@pytest.mark.parametrize("source", sources())
def test_metrics_equal_verls_process_validation_metrics(source):
    rec = record = recorded() if source == "recorded" else live()
    assert record["verl"] == "0.9.1"
    if source == "live":  # the live run reproduces the record (same verl, same cases)
        assert [c["per_source"] for c in rec["cases"]] == [c["per_source"] for c in recorded()["cases"]]
    compared, names = 0, 0
    for case in record["cases"]:
        ours = per_source_metrics(case["data_sources"], case["uids"], case["variables"], seed=case["seed"])
        compared += assert_same(ours, case["per_source"], case["name"])
        if "keys" in case:  # the names verl's trainer logs them under
            names += assert_same(metric_keys(ours), case["keys"], case["name"])
            assert validation_report(case["data_sources"], case["uids"], case["variables"], overall=False) == \
                metric_keys(ours)
    assert compared == 367 and names == 277  # every value of every case (measured: all bit-identical)
    n16 = next(c for c in record["cases"] if c["name"] == "n16")["keys"]
    assert {"val-core/math_dapo/acc/maj@16/mean", "val-core/math_dapo/acc/best@16/mean", "val-aux/math_dapo/acc/worst@16/mean",
            "val-core/openai/gsm8k/acc/mean@16", "val-aux/openai/gsm8k/reward/mean@16",
            "val-core/qa/custom/reward/maj@16/mean", "val-aux/qa/custom/reward/best@8/std"} <= set(n16)
    assert not any("gsm8k" in k and "maj@" in k for k in n16)  # no extracted answer: no vote


def test_the_record_has_the_cases_the_issue_names():
    cases = {c["name"]: c for c in recorded()["cases"]}
    assert {c["n"] for c in cases.values()} == {1, 4, 16}
    assert all(len(set(c["data_sources"])) == 3 for c in cases.values() if c["name"] != "ties")
    ties = cases["ties"]["variables"]
    assert Counter(ties["pred"][:4]) == Counter({"A": 2, "B": 2})


def reference_majority(values: list[float], answers: list, draws: np.ndarray) -> np.ndarray:
    """The vote written from its definition, one draw at a time: count the answers in drawing order, the
    first to reach the highest count wins, its first drawn value is the draw's."""
    out = []
    for draw in draws:
        counts: dict = {}
        for i in draw:
            counts[answers[i]] = counts.get(answers[i], 0) + 1
        top = max(counts.values())
        winner = next(a for a in counts if counts[a] == top)
        out.append(next(values[i] for i in draw if answers[i] == winner))
    return np.array(out)


def test_majority_vote_equals_the_definition_with_ties():
    rng = np.random.RandomState(3)
    for n, kinds in ((4, 2), (5, 3), (16, 4), (16, 16)):
        values = rng.rand(n)
        answers = rng.randint(0, kinds, n)
        draws = rng.randint(0, n, size=(300, max(2, n // 2)))
        ours = majority_values(values, answers, draws)
        np.testing.assert_array_equal(ours, reference_majority(list(values), list(answers), draws))
    # the tie rule matters: the answer drawn first, not the smaller one
    values, answers = np.array([0.0, 1.0]), np.array([0, 1])
    np.testing.assert_array_equal(majority_values(values, answers, np.array([[1, 0], [0, 1]])), [1.0, 0.0])


def test_negative_controls_a_changed_seed_or_tie_rule_fails_the_comparison():
    case = next(c for c in recorded()["cases"] if c["name"] == "n4")
    other_seed = per_source_metrics(case["data_sources"], case["uids"], case["variables"], seed=43)
    with pytest.raises(AssertionError, match="best@2/mean"):
        assert_same(other_seed, case["per_source"], "n4")
    ties = next(c for c in recorded()["cases"] if c["name"] == "ties")
    values, answers = ties["variables"]["reward"][:4], ties["variables"]["pred"][:4]  # A A B B, A right
    draws = _draws(4, 2, 42, 1000)
    ours = prompt_metrics(values, vote_picks(answers))["maj@2/mean"]
    assert ours == float(np.mean(reference_majority(values, answers, draws)))
    # a vote over np.unique's sorted answers gives a tie to the smaller one ("A", the right one): far off
    smaller_wins = [values[draw[0]] if answers[draw[0]] == answers[draw[1]] else values[answers.index("A")]
                    for draw in draws]
    assert float(np.mean(smaller_wins)) - ours > 0.2


def test_subset_sizes_are_verls():
    assert [subset_sizes(n) for n in (0, 1, 2, 3, 4, 6, 16, 17)] == \
        [[], [], [2], [2, 3], [2, 4], [2, 4, 6], [2, 4, 8, 16], [2, 4, 8, 16, 17]]


def test_rows_report_per_source_overall_and_no_vote_without_answers():
    rows = ValidationRows()
    rng = random.Random(0)
    for batch in range(2):  # two validation batches
        uids = [f"p{batch}-{i // 4}" for i in range(8)]
        sources = ["a"] * 4 + ["b"] * 4
        scores = [float(rng.random() < 0.5) for _ in range(8)]
        rows.add(sources, uids, scores, [{"acc": s} for s in scores])
    out = rows.metrics()
    assert out["val-core/a/acc/mean@4"] == pytest.approx(np.mean([s for s, d in zip(rows.scores, rows.data_sources) if d == "a"]))
    assert out[f"val-core/{ALL_SOURCES}/acc/mean@4"] == pytest.approx(np.mean(rows.scores))
    assert "val-aux/a/reward/best@4/std" in out and not any("maj@" in k for k in out)
    assert rows.metrics(overall=False).keys() == {k for k in out if f"/{ALL_SOURCES}/" not in k}
    one = ValidationRows()
    one.add(["a"] * 2, ["u", "u"], [1.0, 0.0], [{"pred": "x"}, {"pred": "y"}])
    assert "val-core/a/reward/maj@2/mean" in one.metrics() and not any(ALL_SOURCES in k for k in one.metrics())
    clash = ValidationRows()
    clash.add([ALL_SOURCES, "b"], ["u", "v"], [1.0, 0.0])
    with pytest.raises(ValueError, match="named 'all'"):
        clash.metrics()
    with pytest.raises(ValueError, match="one per row"):
        ValidationRows().add(["a", "b"], ["u"], [1.0, 0.0])


class CharTokenizer:
    """ids are character codes (enough to decode a response)."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(map(chr, r)) for r in rows]


def test_the_reward_functions_extra_info_rides_in_the_batch():
    texts = ["Answer: 13", "Answer: 12"]
    width = max(map(len, texts))
    ids = torch.tensor([[ord(c) for c in t.ljust(width)] for t in texts])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])
    batch = Batch({"responses": ids, "response_mask": mask}, {"data_source": ["s", "s"], "ground_truth": ["13", "13"]})

    def with_pred(data_source, solution_str, ground_truth, extra_info=None):
        pred = solution_str.split(":")[1].strip()
        return {"score": float(pred == ground_truth), "pred": pred}

    _, scores, _ = score_batch(batch, CharTokenizer(), with_pred)
    assert scores.tolist() == [1.0, 0.0]
    assert list(batch[REWARD_EXTRA_INFO]) == [{"score": 1.0, "pred": "13"}, {"score": 0.0, "pred": "12"}]
    score_batch(batch, CharTokenizer(), lambda **kw: 0.5)  # a number: verl's reward loop records acc = score
    assert list(batch[REWARD_EXTRA_INFO]) == [{"acc": 0.5}, {"acc": 0.5}]
