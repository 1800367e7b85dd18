"""The generative judge's rules without an engine: template checks, the parsing rule, config errors, the
judge part and its flags in the combined reward (the engine itself: tests/test_judge_vllm.py)."""

from dataclasses import replace

import pytest
import torch

from rlpad.batch import Batch
from rlpad.config.rewards import JudgeConfig, RewardConfig
from rlpad.recipe.load import load_config
from rlpad.rewards.combine import CombinedReward, part_metrics
from rlpad.rewards.judge_rules import parse_verdict, template_problems
from paths import recipe

JUDGE = JudgeConfig(enable=True, model_path="/nowhere", score_min=0.0, score_max=10.0, default_score=-1.0)


@pytest.mark.parametrize("template, expected", [
    ("Q {prompt} A {response}", []),
    ("{response}", []),
    ("Q {prompt} truth {ground_truth}: {response} {{literal}}", []),
    ("Q {prompt} and nothing else", ["has no {response} placeholder"]),
    ("Q {prompt} {answer} {response}", ["unknown placeholder {answer}"]),
    ("{0} {response}", ["unknown placeholder {0}"]),
    ("{response.upper} {response}", ["unknown placeholder {response.upper}"]),
    ("{response!r}", ["takes no conversion or format spec"]),
    ("{response:>9}", ["takes no conversion or format spec"]),
    ("{response} {", ["malformed braces"]),
    ("{prompt} {foo}", ["unknown placeholder {foo}", "has no {response} placeholder"]),
])
def test_template_problems(template, expected):
    problems = template_problems(template)
    assert len(problems) == len(expected)
    for problem, words in zip(problems, expected):
        assert problem.startswith("reward.judge.prompt_template") and words in problem


@pytest.mark.parametrize("text, score, parsed", [
    ("Score: 7", 0.7, True),
    ("Score: 10", 1.0, True),
    ("Score: 0", 0.0, True),
    ("score= 2.5 because", 0.25, True),
    ("Score: 3 ... on reflection Score: 8", 0.8, True),  # the LAST match
    ("Score: 11", -1.0, False),  # out of [score_min, score_max]
    ("Score: -2", -1.0, False),
    ("I think it is good", -1.0, False),  # no match
    ("", -1.0, False),
    ("Score: seven", -1.0, False),
])
def test_parse_rule_on_numbers(text, score, parsed):
    verdict = parse_verdict(text, JUDGE)
    assert verdict.parsed is parsed
    assert verdict.score == pytest.approx(score, abs=1e-12)


@pytest.mark.parametrize("text, score", [
    ("Score: 8", 0.8), ("score=8", 0.8), ("SCORE: 8", 0.8), ("**Score:** 8", 0.8), ("Score: **8**", 0.8),
    ("**Score**: 8", 0.8), ("*Score*: 8", 0.8), ("Final score = 7.5.", 0.75), ("Score: 8/10", 0.8),
    ("Score: 1e1", 1.0), ("Score: 2.5E0", 0.25), ("Reasoning... Score: 3\n**Score:** 9", 0.9),
])
def test_the_default_pattern_reads_the_common_forms(text, score):
    """Issue 51 item 16: the default ``score_pattern`` reads the forms judges write (markdown bold, upper case,
    an exponent read as a number: ``1e1`` is 10, not 1); the earlier pattern read 5 of these 12 right."""
    verdict = parse_verdict(text, replace(JUDGE, score_pattern=JudgeConfig().score_pattern))
    assert verdict.parsed and verdict.score == pytest.approx(score, abs=1e-12), (text, verdict)


def test_parse_rule_on_verdict_words_and_patterns_without_a_group():
    words = replace(JUDGE, score_pattern=r"Verdict:\s*(\w+)", verdicts={"yes": 1.0, "No": 0.0, "partly": 0.5})
    assert parse_verdict("Verdict: YES", words).score == 1.0
    assert parse_verdict("Verdict: no", words).score == 0.0
    assert parse_verdict("Verdict: yes ... Verdict: partly", words).score == 0.5
    bad = parse_verdict("Verdict: maybe", words)
    assert (bad.score, bad.parsed, bad.found) == (-1.0, False, "maybe")
    whole = replace(JUDGE, score_pattern=r"\d+", score_max=100.0)  # no group: the whole match
    assert parse_verdict("x 40 y 50", whole).score == pytest.approx(0.5)
    optional = replace(JUDGE, score_pattern=r"S(\d)?")  # a group that did not take part: unparsable
    assert parse_verdict("S", optional).parsed is False


def judge_overrides(**keys):
    base = {"reward.judge.enable": "true", "reward.judge.model_path": "/some/judge"}
    return [f"{k}={v}" for k, v in (base | keys).items()]


@pytest.mark.parametrize("keys, words", [
    ({"reward.judge.model_path": "null"}, "reward.judge.enable=true needs reward.judge.model_path"),
    ({"reward.judge.prompt_template": "'rate {prompt}'"}, "reward.judge.prompt_template has no {response}"),
    ({"reward.judge.prompt_template": "'{question} {response}'"}, "unknown placeholder {question}"),
    ({"reward.judge.score_pattern": "x("}, "reward.judge.score_pattern='x(' is not a valid regular"),
    ({"reward.judge.score_pattern": "'(a)(b)'"}, "has 2 groups"),
    ({"reward.judge.score_min": "5", "reward.judge.score_max": "5"}, "reward.judge.score_min=5.0 must be <"),
    ({"reward.judge.timeout_s": "0"}, "reward.judge.timeout_s=0.0 must be > 0"),
    ({"reward.judge.rollout.num_replicas": "0"}, "reward.judge.rollout.num_replicas=0 must be an int >= 1"),
    ({"reward.judge.rollout.response_length": "0"}, "reward.judge.rollout.response_length=0 must be"),
    ({"reward.judge.rollout.dtype": "int8"}, "reward.judge.rollout.dtype='int8' is not valid"),
    ({"reward.weights": "{judge: 1.0}", "reward.judge.enable": "false"}, "(judge needs reward.judge.enable=true)"),
    ({"reward.extra_fns": "{judge: rlpad.rewards.rules:compute_score}"}, "reward.extra_fns.judge: the names"),
])
def test_config_errors_name_the_key_at_load(keys, words):
    with pytest.raises(ValueError) as e:
        load_config(recipe("grpo_tiny"), judge_overrides(**keys))
    assert words in str(e.value)


def test_a_judge_model_that_is_not_a_causal_lm_is_refused_before_any_engine(tmp_path):
    from rlpad.embedded.tiny import build_tokenizer, tiny_reward_model
    from rlpad.rewards.judge import JudgeScorer

    tiny_reward_model("qwen2", seed=0).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    tok = build_tokenizer(tmp_path / "policy")
    with pytest.raises(ValueError, match=r"reward.judge.model_path=.* is not a causal LM \(architectures "
                                         r"\['Qwen2ForSequenceClassification'\]\)"):
        JudgeScorer(replace(JUDGE, model_path=str(tmp_path)), tok)
    with pytest.raises(ValueError, match="judge model"):
        JudgeScorer(replace(JUDGE, model_path=str(tmp_path / "missing")), tok)
    with pytest.raises(ValueError, match="has no {response} placeholder"):
        JudgeScorer(replace(JUDGE, model_path=str(tmp_path), prompt_template="{prompt}"), tok)


class FixedJudge:
    """A judge part with given scores and flags (what CombinedReward does with them is under test)."""

    def __init__(self, scores, unparsable):
        self.scores, self.unparsable = torch.tensor(scores), torch.tensor(unparsable)

    def __call__(self, batch):
        return self.scores, {"unparsable": self.unparsable, "timeout": torch.zeros(len(self.scores))}


def test_the_judge_is_one_more_part_combined_and_its_flags_logged_as_fractions():
    reward = RewardConfig(judge=JudgeConfig(enable=True, model_path="/j"), weights={"rule": 1.0, "judge": 0.25},
                          source_weights={"b": {"judge": 2.0}})
    rule = lambda data_source, solution_str, ground_truth, extra_info=None: float(ground_truth)  # noqa: E731
    combined = CombinedReward(reward, rule, judge=FixedJudge([0.8, 0.0, 0.4, 1.0], [0.0, 1.0, 0.0, 0.0]))
    assert combined.parts == ["rule", "judge"]
    ones = torch.ones(4, 3, dtype=torch.long)
    batch = Batch({"responses": ones, "response_mask": ones},
                  {"data_source": ["a", "a", "b", "b"], "ground_truth": ["1", "0", "0", "1"]})
    _, total, _ = combined.score(batch, tokenizer=_Decoder())
    expected = torch.tensor([1 + 0.25 * 0.8, 0 + 0.25 * 0.0, 0 + 2.0 * 0.4, 1 + 2.0 * 1.0])
    assert torch.allclose(total, expected, rtol=0, atol=1e-6)
    metrics = part_metrics(batch)
    assert metrics["reward/judge/mean"] == pytest.approx(0.55)
    assert metrics["reward/judge/unparsable"] == pytest.approx(0.25)
    assert metrics["reward/judge/timeout"] == 0.0
    assert metrics["reward/rule/mean"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="reward.judge.enable=true needs the judge"):
        CombinedReward(reward, rule)


class _Decoder:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["x" for _ in rows]
