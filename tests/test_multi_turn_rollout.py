"""The multi-turn agent loop (rlpad.rollout.agent) and its tools (rlpad.rollout.tools): masks, budget,
turn limit, seeds, bad tools; and the loop on the real HF backend."""

import time
from dataclasses import replace

import pytest
import torch

from rlpad.embedded.exactness import ENGINE_LOGPROB_TOL
from rlpad.config.schema import DataConfig, MultiTurnConfig, RolloutConfig
from rlpad.core.forward import compute_log_probs
from rlpad.embedded.tiny import build_tokenizer
from rlpad.rollout.agent import run_agent_loop
from rlpad.rollout.seeds import request_seeds
from rlpad.rollout.base import Sampling, tool_turn_renderer
from rlpad.rollout.hf import HFRollout
from rlpad.rollout.tools import ToolSet, load_tools
from test_rollout_layout import P, make_model, prompt_batch

TOK = build_tokenizer()
EOS = TOK.eos_token_id


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


def toolset(timeout=0.3, max_tokens=32):
    """The test tools (tests/mt_tools.py), run in tool-worker processes; one character per token."""
    specs = [f"mt_tools:{name}" for name in ("calc", "boom", "hang", "huge", "number")]
    return ToolSet(specs, "bracket", timeout, max_tokens, lambda s: len(enc(s)), max_token_chars=1)


@pytest.fixture(scope="module")
def tools():
    ts = toolset()
    yield ts
    ts.close()


class Scripted:
    """An engine stand-in that writes a call to ``tool`` in turn 0 and the answer after a tool message;
    it records what it was asked (contexts, seeds)."""

    def __init__(self, tool="calc"):
        self.tool, self.calls = tool, []

    def __call__(self, contexts, sampling, seeds):
        self.calls.append((contexts, seeds, sampling.max_tokens))
        outs = []
        for c in contexts:
            text = TOK.decode(c)
            turn = enc(f"[{self.tool}(12+7)] tail") if "=" == text[-1] else enc("ok") + [EOS]
            outs.append(turn[: sampling.max_tokens])
        return outs, [[-0.5] * len(o) for o in outs]


def loop(engine, prompts, tools, n=2, budget=40, turns=3, seed=None, offset=0, max_user_turns=None):
    return run_agent_loop(engine, [enc(p) for p in prompts], Sampling(n, 1.0, 1.0, -1, budget),
                          tools=tools, max_turns=turns, max_user_turns=max_user_turns, eos=frozenset({EOS}),
                          decode=TOK.decode,
                          render_tool=lambda observations: enc("".join(observations)), seed=seed, prompt_offset=offset)


def test_tool_output_is_context_never_generated(tools):
    trajs = loop(Scripted(), ["12+7="], tools)
    assert len(trajs) == 2
    for t in trajs:
        text = TOK.decode(t.tokens)
        assert text == "[calc(12+7)]19ok" + TOK.eos_token  # the turn stopped at the end of the call
        gen = "".join(ch if g else "_" for ch, g in zip(TOK.convert_ids_to_tokens(t.tokens), t.generated))
        assert gen.startswith("[calc(12+7)]__ok")  # the tool's "19" is not the policy's
        assert t.log_probs == [-0.5 if g else 0.0 for g in t.generated]
        assert (t.num_turns, t.tool_calls, t.tool_errors) == (2, 1, 0)


def test_turn_limit_and_budget(tools):
    t = loop(Scripted(), ["1+1="], tools, n=1, turns=1)[0]
    assert TOK.decode(t.tokens) == "[calc(12+7)]" and all(t.generated) and t.tool_calls == 0
    t = loop(Scripted(), ["1+1="], tools, n=1, budget=13)[0]  # the call (12 tokens) then 1 token of "19"
    assert TOK.decode(t.tokens) == "[calc(12+7)]1" and t.generated[-1] == 0 and len(t.tokens) == 13


class AlwaysCalls(Scripted):
    """Writes a call to ``calc`` in every turn."""

    def __call__(self, contexts, sampling, seeds):
        outs = [enc("[calc(12+7)] tail")[: sampling.max_tokens] for _ in contexts]
        return outs, [[-0.5] * len(o) for o in outs]


def test_max_user_turns_ends_the_sample_after_that_many_tool_turns(tools):
    """verl's multi_turn.max_user_turns: the sample ends after its k-th tool turn, the tool's reply kept as
    context (mask 0); without it max_assistant_turns (3) ends the sample at its third turn, whose call never runs."""
    got = {k: loop(AlwaysCalls(), ["1+1="], tools, n=1, budget=60, turns=3, max_user_turns=k)[0] for k in (1, 2, None)}
    assert {k: TOK.decode(t.tokens) for k, t in got.items()} == {
        1: "[calc(12+7)]19", 2: "[calc(12+7)]19[calc(12+7)]19", None: "[calc(12+7)]19[calc(12+7)]19[calc(12+7)]"}
    assert [(t.num_turns, t.tool_turns) for t in got.values()] == [(1, 1), (2, 2), (3, 2)]
    assert got[1].generated == [1] * 12 + [0, 0]  # the reply that reached the cap: context, never the policy's


def test_seeds_depend_on_prompt_sample_turn_only(tools):
    """A split of the prompts (replicas: prompt_offset) asks the engine with the same seeds; turn 0 asks
    with the single-turn rollout's seeds (rlpad.rollout.seeds, the one rule), each turn with others."""
    whole, first, second = Scripted(), Scripted(), Scripted()
    loop(whole, ["1+1=", "2+2="], tools, seed=5)
    loop(first, ["1+1="], tools, seed=5)
    loop(second, ["2+2="], tools, seed=5, offset=1)
    for turn in range(2):
        assert whole.calls[turn][1] == first.calls[turn][1] + second.calls[turn][1]
    assert whole.calls[0][1] == request_seeds(5, 0, 2, 2) and whole.calls[1][1] == request_seeds(5, 0, 2, 2, turn=1)
    assert len(set(whole.calls[0][1] + whole.calls[1][1])) == 8


@pytest.mark.parametrize("tool, says, reason", [
    ("boom", "error: tool failed", "boom raised ZeroDivisionError: no"),
    ("hang", "error: timed out", "hang timed out after 0.3 s"),
    ("huge", "error: output too long", "huge returned 500 characters, over max_tool_response_length=32 tokens"),
    ("number", "error: not text", "number returned int, not a str"),
    ("nope", "error: unknown tool", "unknown tool 'nope' (tools: boom, calc, hang, huge, number)"),
])
def test_bad_tools_end_the_turn_with_an_error_observation(tools, tool, says, reason):
    """The model sees a short fixed text, within max_tool_response_length; the full reason is the log's."""
    start = time.perf_counter()
    t = loop(Scripted(tool), ["1+1="], tools, n=1, budget=120)[0]
    assert time.perf_counter() - start < 2.5  # a hung tool is waited for tool_timeout, not until it returns
    text = TOK.decode(t.tokens)
    assert text == f"[{tool}(12+7)]" + says + "ok" + TOK.eos_token
    assert (t.tool_calls, t.tool_errors, t.num_turns) == (1, 1, 2)  # the run went on to the next turn
    assert t.errors == [reason]


def test_error_observations_fit_max_tool_response_length():
    """Control for the old long error texts (36-64 tokens, then cut at the budget with no next turn):
    with a limit of 8 tokens the observation is 8 tokens and the model gets its next turn."""
    short = toolset(max_tokens=8)
    try:
        t = loop(Scripted("boom"), ["1+1="], short, n=1, budget=40)[0]
    finally:
        short.close()
    assert TOK.decode(t.tokens) == "[boom(12+7)]" + "error: t" + "ok" + TOK.eos_token
    assert t.num_turns == 2 and t.errors == ["boom raised ZeroDivisionError: no"]


def test_tools_load_by_name_and_bad_names_are_named():
    tools = load_tools(["mt_tools:calc", "rlpad.embedded.toy:toy_score"])
    assert sorted(tools) == ["calc", "toy_score"]
    with pytest.raises(ValueError, match="multi_turn.tools='nomodule:calc': cannot import"):
        load_tools(["nomodule:calc"])
    with pytest.raises(ValueError, match="two tools named 'calc'"):
        load_tools(["mt_tools:calc", "mt_tools:calc"])
    with pytest.raises(ValueError, match="multi_turn.format='xml'"):
        ToolSet([], "xml", 1.0, 8, len)


def test_hermes_format_parses_json_calls():
    from rlpad.rollout.tools import FORMATS

    calls, end, dropped = FORMATS["hermes"].find('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> y', 4)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1})] and dropped == 0
    assert end == len('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert FORMATS["hermes"].find("<tool_call>{bad</tool_call>", 4)[0][0].problem.startswith("bad tool call")


# ChatML's shape in the toy tokenizer's characters: a default system block when the conversation has
# none (as Qwen's templates write), each message closed by "#end ", the next assistant prompt.
CHATML_LIKE = ("{%- if messages[0]['role'] != 'system' %}#system:You are a bot.#end {% endif %}"
               "{%- for m in messages %}#{{ m['role'] }}:{{ m['content'] }}#end {% endfor %}"
               "{%- if add_generation_prompt %}#assistant:{% endif %}")


def test_tool_turn_closes_the_assistant_message_and_writes_no_system_block():
    """A turn cut at the end of its call is followed by the template's close of the assistant
    message, the tool message and the next assistant prompt: the context reads as the template
    renders the whole conversation. Control: the tool message rendered alone (the old way) carries a
    second system block and no close."""
    tok = build_tokenizer()
    tok.chat_template = CHATML_LIKE
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+7="}], tokenize=False, add_generation_prompt=True)
    call = "[calc(12+7)]"
    context = prompt + call + tok.decode(tool_turn_renderer(tok)(["19"]))
    whole = tok.apply_chat_template([{"role": "user", "content": "12+7="}, {"role": "assistant", "content": call},
                                     {"role": "tool", "content": "19"}], tokenize=False, add_generation_prompt=True)
    assert context == whole
    assert context.count("#system:") == 1 and "[calc(12+7)]#end #tool:19#end #assistant:" in context
    alone = tok.apply_chat_template([{"role": "tool", "content": "19"}], tokenize=False, add_generation_prompt=True)
    assert prompt + call + alone != whole
    assert tool_turn_renderer(build_tokenizer())(["19"]) == enc("19")  # the toy template: content only


def test_a_template_without_a_tool_role_is_refused_before_sampling():
    tok = build_tokenizer()
    tok.chat_template = ("{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}"
                         "{%- endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="cannot render a tool message"):
        tool_turn_renderer(tok)


@pytest.fixture(scope="module")
def hf_backend(tmp_path_factory):
    path = tmp_path_factory.mktemp("mt_hf")
    model = make_model()
    model.save_pretrained(path)
    build_tokenizer(path)
    rollout = RolloutConfig(name="hf", n=2, temperature=1.0, seed=0,
                            multi_turn=MultiTurnConfig(enable=True, format="bracket", max_assistant_turns=3,
                                                       tools=["mt_tools:calc"]))
    backend = HFRollout(str(path), rollout, DataConfig(max_prompt_length=P, max_response_length=24))
    yield model, backend
    backend.shutdown()


def test_hf_backend_runs_the_loop_with_real_tool_calls(hf_backend, monkeypatch):
    """The real HF engine; its first turn is made to call the tool by a logits bias on the call's
    tokens (a real generate, real log-probs of what was sampled). Tool tokens: response_mask 0,
    rollout log-prob 0; the generated tokens' rollout log-probs equal the forward's."""
    model, backend = hf_backend
    script = enc("[calc(2+3)]")
    real = backend._sample_each

    def steer(contexts, sampling, seeds):  # turn 0 of every sample: the call, as a forced prefix
        if all(len(c) <= P for c in contexts):
            contexts = [c + script for c in contexts]
            toks, lps = real(contexts, replace(sampling, max_tokens=sampling.max_tokens - len(script)), seeds)
            return [script + t for t in toks], [[0.0] * len(script) + lp for lp in lps]
        return real(contexts, sampling, seeds)

    monkeypatch.setattr(backend, "_sample_each", steer)
    out = backend.generate(prompt_batch(), seed=3)
    assert out["tool_calls"].tolist() == [1] * 12 and out["tool_errors"].sum() == 0
    attn_resp = out["attention_mask"][:, P:]
    tool = attn_resp.bool() & ~out["response_mask"].bool()
    assert (tool.sum(1) == 1).all()  # "5", the tool's answer, one character
    assert (out["responses"][tool] == enc("5")[0]).all()
    assert (out["rollout_log_probs"][tool] == 0).all()
    lp, _ = compute_log_probs(model, out["input_ids"], out["attention_mask"], out["position_ids"], 24,
                              use_remove_padding=True, response_mask=out["response_mask"])
    after = out["response_mask"].bool().clone()
    after[:, : len(script)] = False  # the forced call has no sampled log-prob
    assert after.any()
    assert (lp - out["rollout_log_probs"])[after].abs().max() < ENGINE_LOGPROB_TOL


def test_hf_generate_unpadded_batch_attends_to_the_whole_cache():
    """Regression (found by the multi-turn task): rlpad_varlen under ``generate`` with an unpadded
    batch (no mask) decodes one query against the KV cache: causal from the bottom right, so the
    greedy tokens equal those of sdpa (before the fix the query saw key 0 only)."""
    from transformers import GenerationConfig

    ids = torch.randint(3, 80, (2, 6), generator=torch.Generator().manual_seed(0))
    outs = []
    for attn in ("rlpad_varlen", "sdpa"):
        model = make_model()
        model.set_attn_implementation(attn)
        config = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        outs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config))
    assert torch.equal(outs[0], outs[1])
