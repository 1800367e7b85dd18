"""rlpad.rewards.combine: rule + reward model + extra rules, weighted per data source, normalised, clipped,
every part kept and logged; checked row by row against a plain fp64 recomputation."""

import math

import pytest
import torch

from rlpad.batch import Batch
from rlpad.config.rewards import RewardConfig, RewardModelScoringConfig
from rlpad.core.layout import left_pad
from rlpad.embedded.tiny import build_tokenizer, tiny_reward_model
from rlpad.rewards.combine import CombinedReward, RunningStats, build_reward, part_metrics, score_rewards
from rlpad.core.reward_model import compute_scores, load_reward_model
from rlpad.rewards.model_scorer import RewardModelInputs
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
            assert float(acc[i]) == rule
        # every part kept in the batch, the weight-0 rule of "other" included
        assert batch["reward_parts/rule"].tolist() == [1.0, 0.0, 1.0, 0.0]
        metrics = part_metrics(batch)
        assert set(metrics) == {"reward/rule/mean", "reward/reward_model/mean", "reward/length/mean"}
        assert metrics["reward/rule/mean"] == 0.5
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


def reward_model_folders(tmp_path):
    """``(same, other, rm)``: one tiny reward model saved twice, with the policy's tokenizer (``same``) and
    with it under another chat template (``other``: the reward model re-renders)."""
    same, other = tmp_path / "same", tmp_path / "other"
    rm = tiny_reward_model("qwen2", seed=3)
    for folder in (same, other):
        rm.save_pretrained(folder)
        tok = build_tokenizer(folder)
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tok.save_pretrained(other)
    return same, other, rm


def test_reward_model_inputs_and_retokenisation(tmp_path):
    """What the reward model reads: the rollout's own rows when the tokenizers agree; with another chat
    template the conversation re-rendered, and the model's score on it is its score on that text alone."""
    same, other, rm = reward_model_folders(tmp_path)
    batch = batch_a()
    direct, rerendered = RewardModelInputs(str(same), TOK), RewardModelInputs(str(other), TOK)
    assert not direct.retokenize and rerendered.retokenize
    assert torch.equal(direct(batch)["input_ids"], batch["input_ids"])
    loaded = load_reward_model(str(other))
    with torch.no_grad():
        for inputs, render in ((direct, "{p}{a}"), (rerendered, "[{p}][{a}]")):
            fed = inputs(batch)
            got = compute_scores(loaded, fed["input_ids"], fed["attention_mask"], fed.tensors.get("position_ids"))
            for i, (p, a) in enumerate(zip(["3+4=", "1+1=", "10+2=", "5+5="], ["7", "3", "12", "100"])):
                ids = torch.tensor([inputs.tokenizer(render.format(p=p, a=a), add_special_tokens=False)["input_ids"]])
                if inputs is direct:  # the rollout row itself: prompt + answer + EOS
                    ids = torch.cat([ids, torch.tensor([[TOK.eos_token_id]])], 1)
                alone = rm.score(rm.model(input_ids=ids).last_hidden_state[0, -1]).item()
                assert abs(float(got[i]) - alone) < 2e-5
    no_template = tmp_path / "bare"
    rm.save_pretrained(no_template)
    bare = build_tokenizer()
    bare.chat_template = None
    bare.add_tokens(["<x>"])
    bare.save_pretrained(no_template)
    with pytest.raises(ValueError, match="no chat template"):
        RewardModelInputs(str(no_template), TOK)
    tiny_model_dir = tmp_path / "lm"
    from rlpad.embedded.tiny import tiny_model
    tiny_model("qwen2").save_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        RewardModelInputs(str(tiny_model_dir), TOK)


def test_shared_prompts_need_the_policys_own_rows(tmp_path):
    """The policy's own rows go out with ``responses`` (where each prompt ends, what sharing reads); a
    re-rendered batch has none, and an explicit reward.reward_model.share_prompts=true with a reward model
    that re-renders is refused in one line before anything is scored; null (the actor's) just does not share."""
    same, other, rm = reward_model_folders(tmp_path)
    batch = batch_a()
    assert torch.equal(RewardModelInputs(str(same), TOK, share_prompts=True)(batch)["responses"], batch["responses"])
    assert "responses" not in RewardModelInputs(str(other), TOK, share_prompts=None)(batch)
    with pytest.raises(ValueError) as e:
        RewardModelInputs(str(other), TOK, share_prompts=True)
    assert "\n" not in str(e.value) and str(e.value).startswith("reward.reward_model.share_prompts=true needs the "
                                                                "policy's own tokens")
