"""Multi-turn with real tokenizers and templates: calls found whatever the tokenisation, parallel calls
rendered as the template renders them, tools advertised in the prompt, the renderer probe.

The tokenizer is a byte-level BPE trained here (tests/bpe_chatml.py) whose merges cross a call's close
(``)]`` + newline, ``).``, ``>`` + newline; ``</tool_call>`` not an added token); the template is the
project's own ChatML one shaped like Qwen2.5 / Qwen3's (a ``<tools>`` section in the system block, one
``<tool_response>`` per call, thinking blocks). The tools run in real tool-worker processes."""

import contextlib
import json
import random

import pytest

from bpe_chatml import build_bpe
from rlpad.data import PromptDataset, write_rows
from rlpad.embedded.tiny import build_tokenizer
from rlpad.rollout.agent import cut_turn, run_agent_loop
from rlpad.rollout.base import Sampling, tool_turn_renderer
from rlpad.rollout.tools import FORMATS, ToolSet, tool_schema, tool_schemas

import mt_tools

SPECS = ["mt_tools:add", "mt_tools:mul", "mt_tools:calc"]


@pytest.fixture(scope="module")
def bpe():
    return build_bpe()


@pytest.fixture(scope="module")
def qwen_like():
    return build_bpe(added=True)


def old_rule_finds(ids, end, decode):
    """The cut before this fix: a call is seen only when the decoded window ends with its close."""
    window = 2 * len(end)
    return any(decode(ids[max(0, i + 1 - window): i + 1]).endswith(end) for i in range(len(ids)))


def test_calls_found_whatever_the_tokenisation(bpe):
    """200 turns, bracket and hermes, each a call followed by what a model may write after it: every
    call is found and the turn is cut after the first token that holds its close. Control: the old
    rule misses the calls whose close this BPE merges with the next character."""
    eos = frozenset({bpe.eos_token_id})
    rng = random.Random(0)
    missed = old_missed = merged = 0
    for i in range(200):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        after = rng.choice(["\n", ".", "\nok", ". done", "\n\n", ""])
        fmt = FORMATS["bracket" if i % 2 else "hermes"]
        call = (f"I add. [calc({a}+{b})]" if i % 2 else
                f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>')
        ids = bpe.encode(call + after, add_special_tokens=False) + [bpe.eos_token_id]
        cut = cut_turn(ids, eos, fmt, bpe.decode, max_calls=4)
        missed += len(cut.calls) != 1
        kept = bpe.decode(ids[: cut.kept])
        assert kept.startswith(call) and not cut.by_eos, (call, after, kept)
        assert fmt.end not in bpe.decode(ids[: cut.kept - 1])  # the first token holding the close
        merged += kept != call
        old_missed += not old_rule_finds(ids, fmt.end, bpe.decode)
    print(f"calls missed: {missed} of 200 (the old rule: {old_missed}); cuts inside a merged token: {merged}")
    assert missed == 0
    assert old_missed > 50 and merged == old_missed  # the control: what the BPE merges, the old rule missed


def test_the_cut_decodes_a_few_times_not_once_per_token(bpe):
    """A 4096-token turn whose call ends near its end: the old rule decoded once per token (4096 times);
    the cut decodes the turn once and bisects (at most 2 + log2(4096) = 14 decodes)."""
    filler = bpe.encode("a > b\n" * 2000, add_special_tokens=False)[:4090]
    ids = filler + bpe.encode("[calc(1+2)]\nok", add_special_tokens=False)
    seen = []

    def decode(tokens):
        seen.append(len(tokens))
        return bpe.decode(tokens)

    cut = cut_turn(ids, frozenset({bpe.eos_token_id}), FORMATS["bracket"], decode, 4)
    assert [c.arguments for c in cut.calls] == ["1+2"] and bpe.decode(ids[: cut.kept]).endswith("[calc(1+2)]\n")
    print(f"a {len(ids)}-token turn: {len(seen)} decodes")
    assert len(seen) <= 14


def test_a_turn_without_a_call_or_with_eos_first(bpe):
    eos = frozenset({bpe.eos_token_id})
    ids = bpe.encode("no call here.", add_special_tokens=False)
    assert cut_turn(ids + [bpe.eos_token_id] + ids, eos, FORMATS["bracket"], bpe.decode, 4).kept == len(ids) + 1
    tail = bpe.encode("[calc(1+2)]", add_special_tokens=False)
    cut = cut_turn(ids + [bpe.eos_token_id] + tail, eos, FORMATS["bracket"], bpe.decode, 4)
    assert cut.by_eos and cut.calls == []  # a call after EOS is not the model's turn


def call_text(calls, think=None):
    """What the template writes for an assistant turn that makes ``calls`` (the model's generation)."""
    body = "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>' for n, a in calls)
    return (f"<think>\n{think}\n</think>\n\n" if think else "") + body


def run_script(tok, schemas, turns, prompt_ids, max_turns, max_parallel_calls):
    """One trajectory of :func:`run_agent_loop` over the engine stand-in :class:`Script` writing ``turns``,
    with real tool processes (SPECS, hermes)."""
    tools = ToolSet(SPECS, "hermes", 5.0, 32, lambda s: len(tok.encode(s, add_special_tokens=False)))
    with contextlib.closing(tools):
        return run_agent_loop(Script(tok, turns), [prompt_ids], Sampling(1, 1.0, 1.0, -1, 400), tools=tools,
                              max_turns=max_turns, eos=frozenset({tok.eos_token_id}), decode=tok.decode,
                              render_tool=tool_turn_renderer(tok, schemas), max_parallel_calls=max_parallel_calls)[0]


class Script:
    """An engine stand-in writing ``turns[k]`` (text) in turn k, then EOS."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.k = tok, turns, 0

    def __call__(self, contexts, sampling, seeds):
        text, self.k = self.turns[self.k], self.k + 1
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return [ids] * len(contexts), [[-1.0] * len(ids)] * len(contexts)


@pytest.mark.parametrize("think", [None, "I need both."])
def test_parallel_calls_render_as_the_template_renders_them(qwen_like, think):
    """Two calls in one turn: both run (real tool processes), one tool message each, in order; the
    context, text and ids, is the template's rendering of [user, assistant(tool_calls=[a, b]), tool a,
    tool b, assistant]. Control: the old loop ran the first call only."""
    tok, schemas = qwen_like, tool_schemas(SPECS)
    calls = [("add", {"a": 2, "b": 3}), ("mul", {"a": 4, "b": 5})]
    user = [{"role": "user", "content": "2+3 and 4*5?"}]
    prompt = tok.apply_chat_template(user, tools=schemas, tokenize=False, add_generation_prompt=True)
    traj = run_script(tok, schemas, [call_text(calls, think) + "\n", "5 and 20."],
                      tok.encode(prompt, add_special_tokens=False), max_turns=3, max_parallel_calls=4)
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    if think:
        assistant["reasoning_content"] = think
    whole = tok.apply_chat_template(user + [assistant, {"role": "tool", "content": "5"}, {"role": "tool", "content": "20"},
                                            {"role": "assistant", "content": "5 and 20."}], tools=schemas, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False) + traj.tokens
    assert (traj.tool_calls, traj.max_turn_calls, traj.tool_errors, traj.num_turns) == (2, 2, 0, 2)
    assert tok.decode(ids) + "\n" == whole
    assert ids + tok.encode("\n", add_special_tokens=False) == tok.encode(whole, add_special_tokens=False)
    assert whole.count("<tool_response>") == 2 and whole.count("<|im_start|>user") == 2


def test_parallel_calls_past_the_cap_are_cut_and_counted(qwen_like):
    tok, schemas = qwen_like, tool_schemas(SPECS)
    calls = [("add", {"a": 2, "b": 3}), ("mul", {"a": 4, "b": 5}), ("add", {"a": 1, "b": 1})]
    traj = run_script(tok, schemas, [call_text(calls), "ok"], tok.encode("?", add_special_tokens=False),
                      max_turns=2, max_parallel_calls=2)
    assert (traj.tool_calls, traj.max_turn_calls, traj.calls_dropped) == (2, 2, 1)
    text = tok.decode(traj.tokens)
    assert text.startswith(call_text(calls[:2]) + "<|im_end|>") and text.count("<tool_response>") == 2


def test_tools_are_advertised_in_the_prompt(tmp_path, qwen_like):
    """A prompt rendered for a tools recipe holds the template's tools section with each tool's schema
    (from the signature and docstring, or an explicit ``json_schema``). Control: the old prompt has none."""
    schemas = tool_schemas([*SPECS, "mt_tools:explicit"])
    assert schemas[0]["function"]["parameters"]["properties"] == {"a": {"type": "integer", "description": "the first"},
                                                                   "b": {"type": "integer", "description": "the second"}}
    assert tool_schema(mt_tools.explicit) == {"type": "function", "function": mt_tools.explicit.json_schema}
    path = str(tmp_path / "p.jsonl")
    write_rows([{"data_source": "x", "prompt": [{"role": "user", "content": "2+3?"}],
                 "reward_model": {"ground_truth": "5"}}], path)
    with_tools = PromptDataset(path, qwen_like, max_prompt_length=2000, tools=schemas)
    text = qwen_like.decode(with_tools.token_ids[0])
    assert "# Tools" in text and "<tools>" in text
    for schema in schemas:
        assert json.dumps(schema) in text
    plain = qwen_like.decode(PromptDataset(path, qwen_like, max_prompt_length=2000).token_ids[0])
    assert "<tools>" not in plain
    with pytest.raises(ValueError, match="advertise_tools=true but the tokenizer's chat template does not render tools"):
        PromptDataset(path, build_tokenizer(), max_prompt_length=2000, tools=schemas)


def test_a_template_that_drops_tool_messages_is_refused():
    """Control for the old probe (a prefix check only): a template that renders user / assistant / system
    and skips tool messages extends its rendering, yet the model would never see a tool's output."""
    tok = build_tokenizer()
    tok.chat_template = ("{%- for m in messages %}{%- if m['role'] != 'tool' %}#{{ m['role'] }}:{{ m['content'] }}"
                         "{%- endif %}{% endfor %}{%- if add_generation_prompt %}#assistant:{% endif %}")
    with pytest.raises(ValueError, match="drops tool messages"):
        tool_turn_renderer(tok)
