"""Stateful tools (rlpad.rollout.stateful_tools, verl's multi_turn.tool_config_path) in the tool loop: one
instance per trajectory whose state changes per call, tools_kwargs from extra_info, a raising or hanging call
an error observation, calc_reward at the end and release always; function tools beside them; the tool
YAML checked at config load in one line."""

import asyncio
from types import SimpleNamespace

import pytest

from mt_tools import Counter
from rlpad.config.schema import MultiTurnConfig
from rlpad.embedded.tiny import build_tokenizer
from rlpad.rollout.agent_loops import AgentContext, run_agent_loops
from rlpad.rollout.base import Sampling
from rlpad.rollout.engine_client import BatchingClient
from rlpad.rollout.stateful_tools import StatefulTools, advertised_schemas, load_tool_config, stateful_tool_problems
from rlpad.rollout.tools import ERROR_TEXTS, ToolSet, multi_turn_problems

TOK = build_tokenizer()
EOS = TOK.eos_token_id

COUNTER_YAML = """tools:
  - class_name: mt_tools.Counter
    config: {scale: 2}
    tool_schema:
      type: function
      function:
        name: count
        description: add to the running total
        parameters: {type: object, properties: {step: {type: string}}, required: [step]}
"""

# each prompt's calls, one per turn, then "ok" + EOS
SCRIPTS = {"a": ["[count(1)]", "[count(3)]", "[calc(2+3)]"], "b": ["[count(boom)]", "[count(2)]"],
           "h": ["[count(hang)]", "[count(1)]"]}


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


class Scripted:
    """An engine stand-in: the next call of the prompt's script (by the calls already in the context)."""

    eos_token_ids = frozenset({EOS})

    def _sample_each(self, contexts, sampling, seeds):
        outs = []
        for c in contexts:
            text = TOK.decode(c)
            script, done = SCRIPTS[text[0]], text.count(")]")
            outs.append(enc(script[done]) if done < len(script) else enc("ok") + [EOS])
        return outs, [[-0.5] * len(o) for o in outs]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(COUNTER_YAML)
    return str(path)


def test_one_counter_per_trajectory_errors_contained_and_released(config):
    toolset = ToolSet(["mt_tools:calc"], "bracket", 0.3, 32, lambda s: len(enc(s)), max_token_chars=1)
    try:
        stateful = StatefulTools(load_tool_config(config), toolset)
        context = AgentContext(eos=frozenset({EOS}), decode=TOK.decode, tools=toolset, stateful=stateful,
                               render_tool=lambda observations: enc("".join(observations)), max_turns=4)
        kwargs = lambda start: {"tools_kwargs": {"count": {"create_kwargs": {"start": start}}}}  # noqa: E731
        rows = [{"prompt_ids": enc(p), "extra_info": info, "agent_name": "tool_agent"}
                for p, info in (("a", kwargs(10)), ("a", kwargs(100)), ("b", None), ("h", kwargs(5)))]
        Counter.live.clear()
        Counter.created.clear()
        outs = asyncio.run(run_agent_loops(BatchingClient(Scripted()), context, Sampling(1, 1.0, 1.0, -1, 64), rows,
                                           vocab_size=len(TOK)))
    finally:
        toolset.close()
    texts = [TOK.decode(o.response_ids) for o in outs]
    # state per trajectory: 10 + 2*1, then + 2*3 (scale 2 from the config); another instance from 100
    assert texts[0] == "[count(1)]12[count(3)]18[calc(2+3)]5ok" + TOK.decode([EOS])
    assert texts[1] == "[count(1)]102[count(3)]108[calc(2+3)]5ok" + TOK.decode([EOS])
    # a raise and a hang: error observations, the instance goes on (state 0, no tools_kwargs: start 0)
    assert texts[2] == f"[count(boom)]{ERROR_TEXTS['raised']}[count(2)]4ok" + TOK.decode([EOS])
    assert texts[3] == f"[count(hang)]{ERROR_TEXTS['timeout']}[count(1)]7ok" + TOK.decode([EOS])
    assert outs[2].extra_fields["errors"] == ["count raised RuntimeError: boom"]
    assert outs[3].extra_fields["errors"] == ["count timed out after 0.3 s"]
    assert [o.extra_fields["tool_errors"] for o in outs] == [0, 0, 1, 1]
    assert [o.extra_fields["tool_rewards"] for o in outs] == [{"count": 18.0}, {"count": 108.0}, {"count": 4.0},
                                                              {"count": 7.0}]
    assert [o.extra_fields["tool_step_rewards"] for o in outs] == [[0.5, 0.5], [0.5, 0.5], [0.5], [0.5]]
    assert outs[0].metrics["tools"] == [{"total": 12}, {"total": 18}]
    for o in outs:  # observations are context: mask 0, log-prob 0
        gen = [m == 1 for m in o.response_mask]
        assert all(lp == 0.0 for lp, g in zip(o.response_logprobs, gen) if not g)
        assert TOK.decode([t for t, g in zip(o.response_ids, gen) if not g]).strip("0123456789") in (
            "", ERROR_TEXTS["raised"], ERROR_TEXTS["timeout"])
    assert len(Counter.created) == 4 and len(set(Counter.created)) == 4 and Counter.live == {}  # all released


def test_tool_config_checked_in_one_line(config, tmp_path):
    mt = MultiTurnConfig(enable=True, format="bracket", tool_config_path=config)
    assert stateful_tool_problems(mt) == [] and multi_turn_problems(mt) == []  # the classes alone are tools
    assert [s["function"]["name"] for s in advertised_schemas(mt)] == ["count"]
    bad = tmp_path / "bad.yaml"
    key = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    for text, says in ((COUNTER_YAML.replace("mt_tools.Counter", "mt_tools.Nope"), "tools[0] (count): cannot import"),
                       (COUNTER_YAML.replace("mt_tools.Counter", "mt_tools.calc"), "is not a tool class"),
                       (COUNTER_YAML.replace("name: count", "name: calc"), "tool 'calc' is also a function tool"),
                       ("tools: [\n", "cannot be read as YAML"), ("- a\n", "must hold tools:")):
        bad.write_text(text)
        (problem,) = stateful_tool_problems(SimpleNamespace(**{**vars(mt), "tool_config_path": str(bad),
                                                                 "tools": ["mt_tools:calc"]}))
        assert problem.startswith(key) and says in problem and "\n" not in problem
    off = MultiTurnConfig(tool_config_path=config)
    assert stateful_tool_problems(off) == [f"{key} is set but actor_rollout_ref.rollout.multi_turn.enable=false: "
                                           "the tools would never run"]


def test_release_is_called_when_the_rollout_fails(config):
    """The engine fails in the second turn: every trajectory's instance is still released."""

    class Failing(Scripted):
        def _sample_each(self, contexts, sampling, seeds):
            if any(")]" in TOK.decode(c) for c in contexts):
                raise RuntimeError("engine died")
            return super()._sample_each(contexts, sampling, seeds)

    toolset = ToolSet([], "bracket", 0.3, 32, lambda s: len(enc(s)), max_token_chars=1)
    context = AgentContext(eos=frozenset({EOS}), decode=TOK.decode, tools=toolset, max_turns=4,
                           stateful=StatefulTools(load_tool_config(config), toolset),
                           render_tool=lambda observations: enc("".join(observations)))
    Counter.live.clear()
    Counter.created.clear()
    rows = [{"prompt_ids": enc("a"), "agent_name": "tool_agent"} for _ in range(3)]
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(run_agent_loops(BatchingClient(Failing()), context, Sampling(1, 1.0, 1.0, -1, 64), rows,
                                    vocab_size=len(TOK)))
    assert len(Counter.created) == 3 and Counter.live == {}


def test_hf_backend_runs_stateful_tools_with_tools_kwargs_from_extra_info(config, tmp_path):
    """The real HF backend's generate with multi_turn.tool_config_path: each row's first turn is steered to
    call the counter (a real generate after it); its instance starts at the row's tools_kwargs; the tool
    message (mask 0, log-prob 0) holds that row's total; every instance released."""
    from dataclasses import replace

    import torch

    from rlpad.config.schema import DataConfig, RolloutConfig
    from rlpad.rewards.stage import score_rewards, validation_scores
    from rlpad.rewards.rules import score_batch
    from rlpad.rollout.hf import HFRollout
    from test_rollout_layout import P, make_model, prompt_batch

    model = make_model()
    build_tokenizer(tmp_path)
    rollout = RolloutConfig(name="hf", n=2, temperature=1.0, seed=0, multi_turn=MultiTurnConfig(
        enable=True, format="bracket", max_assistant_turns=2, tool_config_path=config))
    backend = HFRollout(model, rollout, DataConfig(max_prompt_length=P, max_response_length=40),
                        tokenizer_path=str(tmp_path))
    script, real = enc("[count(3)]"), backend._sample_each

    def steer(contexts, sampling, seeds):  # turn 0: the call, as a forced prefix
        if all(len(c) <= P for c in contexts):
            toks, lps = real([c + script for c in contexts], replace(sampling, max_tokens=sampling.max_tokens - len(script)), seeds)
            return [script + t for t in toks], [[0.0] * len(script) + lp for lp in lps]
        return real(contexts, sampling, seeds)

    backend._sample_each = steer
    batch = prompt_batch()
    batch["extra_info"] = [{"tools_kwargs": {"count": {"create_kwargs": {"start": 1000 * (i + 1)}}}} for i in range(6)]
    Counter.live.clear()
    Counter.created.clear()
    try:
        out = backend.generate(batch, seed=3)
    finally:
        backend.shutdown()
    tool = out["attention_mask"][:, P:].bool() & ~out["response_mask"].bool()
    for k in range(12):
        message = TOK.decode(out["responses"][k][tool[k]].tolist())
        assert str(1000 * (k // 2 + 1) + 6) in message  # start + 2 * 3, this row's own instance
    assert (out["rollout_log_probs"][tool] == 0).all() and out["tool_errors"].sum() == 0
    assert out["tool_calls"].tolist() == [1] * 12 and len(Counter.created) == 12 and Counter.live == {}
    # the tools' rewards in the reward stage (verl's rule): the reward function reads each row's calc_reward in
    # extra_info.rollout_reward_scores (the counter's total: start + 2 * 3) and its calls' step rewards in
    # extra_info.tool_rewards; a verl-style function adding them scores reward fn + tool reward
    totals = torch.tensor([1000.0 * (k // 2 + 1) + 6 for k in range(12)])
    assert list(out["reward_scores"]) == [{"count": float(t)} for t in totals]
    assert list(out["tool_rewards"]) == [[0.5]] * 12

    def reward_fn(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25 + sum((extra_info or {}).get("rollout_reward_scores", {}).values())

    out["data_source"] = ["t"] * 12
    bare = out.index(torch.arange(12))  # negative control: the same rows without the rule
    _, without, _ = score_batch(bare, TOK, reward_fn)
    token, seq, _ = score_rewards(out, TOK, reward_fn)
    assert torch.equal(seq, 0.25 + totals) and torch.equal(without, torch.full((12,), 0.25))
    assert torch.equal(token.sum(-1), seq) and list(out["extra_info"])[0]["tool_rewards"] == [0.5]
    assert list(out["extra_info"])[0]["tools_kwargs"] == {"count": {"create_kwargs": {"start": 1000}}}
    task, _ = validation_scores(out, TOK, reward_fn)
    assert torch.equal(task, seq)
