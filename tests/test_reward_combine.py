"""rlpad.rewards.combine: rule + reward model + extra rules, weighted per data source, normalised, clipped,
every part kept and logged; checked row by row against a plain fp64 recomputation."""

import json
import math

import pytest
import torch

from rlpad.batch import Batch
from rlpad.config.rewards import RewardConfig, RewardModelScoringConfig
from rlpad.core.layout import left_pad
from rlpad.embedded.tiny import build_tokenizer, tiny_reward_model
from rlpad.rewards.combine import CombinedReward, RunningStats, build_reward, part_metrics
from rlpad.rewards.stage import score_rewards, validation_scores
from rlpad.rewards.rules import compute_score, load_reward_fn, score_batch

TOK = build_tokenizer()
TOY = "rlpad/toy_add"


def length_rule(data_source, solution_str, ground_truth, extra_info=None):
    return -0.1 * len(solution_str)


def rollout(prompts, answers, sources, truths) -> Batch:
    """A rollout batch of the toy task: left-padded prompts, right-padded answers + EOS."""
    p_ids, p_mask = left_pad([TOK(p)["input_ids"] for p in prompts], 8, TOK.pad_token_id)
    rows = [TOK(a)["input_ids"] + [TOK.eos_token_id] for a in answers]
    width = max(len(r) for r in rows)
    r_ids = torch.full((len(rows), width), TOK.pad_token_id)
    r_mask = torch.zeros_like(r_ids)
    for i, r in enumerate(rows):
        r_ids[i, :len(r)], r_mask[i, :len(r)] = torch.tensor(r), 1
    mask = torch.cat([p_mask, r_mask], 1)
    return Batch({"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": mask,
                  "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "responses": r_ids, "response_mask": r_mask},
                 {"data_source": sources, "ground_truth": truths,
                  "raw_prompt": [[{"role": "user", "content": p}] for p in prompts]})


def batch_a():
    return rollout(["3+4=", "1+1=", "10+2=", "5+5="], ["7", "3", "12", "100"], [TOY, TOY, "other", TOY],
                   ["7", "2", "12", "10"])


def other_rule(data_source, solution_str, ground_truth, extra_info=None):
    return compute_score(TOY, solution_str, ground_truth, extra_info)


def rm_scores(batch):  # a fixed, known reward-model part (the model itself is tested in test_reward_model.py)
    return torch.tensor([0.5, -2.0, 3.0, 1.0])[: len(batch)]


def test_running_stats_equal_the_whole_history():
    stats, seen = RunningStats(), []
    for seed in range(4):
        x = torch.randn(7 + seed, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3 + seed
        stats.update(x)
        seen.append(x)
        every = torch.cat(seen)
        assert stats.count == every.numel()
        assert math.isclose(stats.mean, float(every.mean()), rel_tol=0, abs_tol=1e-12)
        assert math.isclose(stats.std, float(every.std(unbiased=False)), rel_tol=1e-12)


@pytest.mark.exactness
def test_weighted_per_source_normalised_clipped_sum_row_by_row():
    cfg = RewardConfig(reward_model=RewardModelScoringConfig(enable=True, model_path="x"),
                       extra_fns={"length": "tests.test_reward_combine:length_rule"},
                       weights={"rule": 2.0, "reward_model": 0.5}, source_weights={"other": {"rule": 0.0, "length": 3.0}},
                       normalize=["reward_model"], clip=1.5)
    reward = CombinedReward(cfg, other_rule, {"length": length_rule}, rm_scores)
    history = []
    for batch in (batch_a(), batch_a()):
        _, combined, acc = reward.score(batch, TOK)
        history.append(rm_scores(batch).double())
        seen = torch.cat(history)
        mean, std = float(seen.mean()), float(seen.std(unbiased=False))
        texts = ["7", "3", "12", "100"]
        for i, (src, text, truth) in enumerate(zip(batch["data_source"], texts, batch["ground_truth"])):
            rule = float(text == truth)
            w_rule = 0.0 if src == "other" else 2.0
            w_len = 3.0 if src == "other" else 1.0
            rm = max(-1.5, min(1.5, (float(rm_scores(batch)[i]) - mean) / std))
            expect = w_rule * rule + 0.5 * rm + w_len * max(-1.5, min(1.5, -0.1 * len(text)))
            assert abs(float(combined[i]) - expect) < 1e-5, (i, float(combined[i]), expect)
            assert float(acc[i]) == rule or (src == "other" and math.isnan(acc[i]))
        # every part kept in the batch; the rule of "other" weighs 0 there: not computed in training (NaN)
        assert batch["reward_parts/rule"][[0, 1, 3]].tolist() == [1.0, 0.0, 0.0]
        assert batch["reward_parts/rule"][2].isnan()
        metrics = part_metrics(batch)
        assert set(metrics) == {"reward/rule/mean", "reward/reward_model/mean", "reward/length/mean"}
        assert metrics["reward/rule/mean"] == pytest.approx(1 / 3)  # over the rows it scored
    # negative control: the same sum without the rule part misses by far
    no_rule = RewardConfig(reward_model=cfg.reward_model, extra_fns=cfg.extra_fns, weights={"rule": 0.0, "reward_model": 0.5},
                           source_weights=cfg.source_weights, normalize=["reward_model"], clip=1.5)
    dropped = CombinedReward(no_rule, other_rule, {"length": length_rule}, rm_scores)
    dropped.score(batch_a(), TOK)
    assert (dropped.score(batch_a(), TOK)[1] - combined).abs().max() > 1.0


def test_validation_never_moves_the_statistics():
    cfg = RewardConfig(reward_model=RewardModelScoringConfig(enable=True, model_path="x"), normalize=["reward_model"])
    reward = CombinedReward(cfg, other_rule, {}, rm_scores)
    reward.score(batch_a(), TOK)
    before = (reward.stats["reward_model"].count, reward.stats["reward_model"].mean)
    score_rewards(batch_a(), TOK, reward, update_stats=False)
    validation_scores(batch_a(), TOK, reward)
    assert (reward.stats["reward_model"].count, reward.stats["reward_model"].mean) == before


def test_plain_function_unless_combining():
    assert build_reward(RewardConfig()) is load_reward_fn(RewardConfig().fn)  # the default function itself
    batch = batch_a()
    plain = score_rewards(batch, TOK, build_reward(RewardConfig(fn="tests.test_reward_combine:other_rule")))
    ref = score_batch(batch_a(), TOK, other_rule)
    for a, b in zip(plain, ref):
        assert torch.equal(a, b)
    kw = build_reward(RewardConfig(fn="tests.test_reward_combine:scaled", reward_kwargs={"scale": 3.0}))
    assert score_rewards(batch_a(), TOK, kw)[1].tolist() == [3.0, 0.0, 3.0, 0.0]


def scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale * float(solution_str == ground_truth)


def right(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


def sums(answers, sources=None):
    """A batch of ``1+1=`` answered ``answers`` (ground truth 2)."""
    n = len(answers)
    return rollout(["1+1="] * n, answers, sources or ["s"] * n, ["2"] * n)


def test_normalised_statistics_resume_bitwise():
    """Issue 51 item 9: reward.normalize's running statistics go through a checkpoint (JSON, as the trainer
    state is written) and come back exactly: step 2's scores after a resume equal the uninterrupted run's
    bit for bit ([1, 1, -1, 1]; without the statistics, [0.58, 0.58, -1.73, 0.58])."""
    cfg = RewardConfig(normalize=["rule"])
    full = CombinedReward(cfg, right)
    full.score(sums(["3", "3", "3", "2"]), TOK)
    saved = json.loads(json.dumps(full.state_dict()))
    uninterrupted = full.score(sums(["2", "2", "3", "2"]), TOK)[1]
    resumed = CombinedReward(cfg, right)
    assert resumed.load_state_dict(saved) == []
    after = resumed.score(sums(["2", "2", "3", "2"]), TOK)[1]
    assert torch.equal(after, uninterrupted) and uninterrupted.tolist() == [1.0, 1.0, -1.0, 1.0]
    assert resumed.state_dict() == full.state_dict()
    fresh = CombinedReward(cfg, right).score(sums(["2", "2", "3", "2"]), TOK)[1]  # negative control: no statistics
    assert (fresh - uninterrupted).abs().max() > 0.4
    warned = CombinedReward(cfg, right).load_state_dict({})  # a checkpoint written before they were kept
    assert len(warned) == 1 and "'rule'" in warned[0]


def test_validation_in_the_tasks_units_and_no_degenerate_std():
    """Issue 51 item 10: validation reports each row's reward in the task's own units (the parts raw, weighted),
    the same before and after training steps move the statistics; the trained (normalised) reward beside it.
    A part constant so far (std 0) is centred, not divided by 1e-6 (which gave [1e6, 0])."""
    cfg = RewardConfig(normalize=["rule"], weights={"rule": 2.0})
    reward = CombinedReward(cfg, right)
    val = sums(["2", "3"])
    before_training = validation_scores(val, TOK, reward)
    reward.score(sums(["2", "2"]), TOK)  # a constant part: std 0
    task, trained = validation_scores(sums(["2", "3"]), TOK, reward)
    assert task.tolist() == before_training[0].tolist() == [2.0, 0.0]  # 2 x the rule's raw score
    assert trained.tolist() == [0.0, -2.0]  # (x - 1) / 1: centred, scale 1
    stats = reward.stats["rule"]
    assert (stats.count, stats.std, stats.scale) == (2, 0.0, 1.0)
    reward.score(sums(["3", "3"]), TOK)  # now spread: mean 0.5, std 0.5
    assert validation_scores(sums(["2", "3"]), TOK, reward)[1].tolist() == [2.0, -2.0]
    plain, none = validation_scores(sums(["2", "3"]), TOK, right)
    assert plain.tolist() == [1.0, 0.0] and none is None


def test_a_reward_model_alone_by_default_as_in_verl():
    """Issue 51 item 11: reward.reward_model.enable=true with no reward function named: the reward model's score
    alone (verl 0.9); the rule is not computed in training (it was summed: rule + reward model)."""
    rm_on = RewardModelScoringConfig(enable=True, model_path="x")
    reward = CombinedReward(RewardConfig(reward_model=rm_on), right, model_scorer=rm_scores)
    batch = sums(["2", "3", "2", "5"])
    _, total, acc = reward.score(batch, TOK)
    assert total.tolist() == rm_scores(batch).tolist()
    assert batch["reward_parts/rule"].isnan().all() and acc.isnan().all()
    named = CombinedReward(RewardConfig(reward_model=rm_on, fn="tests.test_reward_combine:right"), right,
                           model_scorer=rm_scores)  # a function named: both, summed
    assert named.score(sums(["2", "3", "2", "5"]), TOK)[1].tolist() == [1.5, -2.0, 4.0, 1.0]


def unknown_source(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError(f"no default reward for data_source {data_source!r}")


def infinite(data_source, solution_str, ground_truth, extra_info=None):
    return math.inf if solution_str == "3" else 0.0


def test_weight_zero_parts_are_not_computed_in_training():
    """Issue 51 items 12 and 17: a part of weight 0 for a row's source is not computed for it in training (the
    rule on an RM-only source it does not know; an extra part scoring inf), so it cannot stop the run nor NaN
    the batch (0 x inf); validation computes every part it can and checks them finite, naming the part."""
    cfg = RewardConfig(reward_model=RewardModelScoringConfig(enable=True, model_path="x"),
                       extra_fns={"odd": "tests.test_reward_combine:infinite"},
                       source_weights={"hh": {"rule": 0.0, "odd": 0.0}}, normalize=["odd"])
    reward = CombinedReward(cfg, unknown_source, {"odd": infinite}, rm_scores, rule_sources=lambda s: s != "hh")
    batch = sums(["2", "3", "2", "5"], ["hh"] * 4)
    _, total, _ = reward.score(batch, TOK)
    assert total.tolist() == rm_scores(batch).tolist()  # finite: the weight-0 parts were never called
    assert reward.stats["odd"].count == 0
    with pytest.raises(ValueError, match=r"reward part 'odd': reward for row 1 \(data_source 'hh'\) is inf"):
        validation_scores(sums(["2", "3", "2", "5"], ["hh"] * 4), TOK, reward)
    weighed = CombinedReward(RewardConfig(extra_fns={"odd": "x:y"}), right, {"odd": infinite})
    with pytest.raises(ValueError, match=r"reward part 'odd': reward for row 1 .* must be finite"):
        weighed.score(sums(["2", "3"]), TOK)
    nan_rm = CombinedReward(RewardConfig(reward_model=cfg.reward_model), right,
                            model_scorer=lambda b: torch.tensor([0.5, math.nan])[: len(b)])
    with pytest.raises(ValueError, match=r"reward part 'reward_model' scored 1 row\(s\) non-finite \(row 1"):
        nan_rm.score(sums(["2", "3"]), TOK)
