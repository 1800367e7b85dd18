"""Agent loops by name (rlpad.rollout.agent_loops): the tool loop as a registered per-trajectory loop over the
batching engine client equals rlpad's batched tool loop bit for bit on the real HF backend; the single-turn loop;
loops from a YAML config chosen by a row's agent_name; bad loop outputs refused naming the loop and the row."""

import asyncio
from dataclasses import replace

import pytest

from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.embedded.tiny import build_tokenizer
from rlpad.rollout.agent import AGENT_COUNTS, Trajectory, cut_turn, run_agent_loop, turn_stops
from rlpad.rollout.agent_loops import (AgentContext, AgentLoopBase, AgentLoopOutput, load_agent_loop_config, register,
                                       run_agent_loops)
from rlpad.rollout.base import Sampling
from rlpad.rollout.engine_client import BatchingClient
from rlpad.rollout.seeds import sample_seed
from rlpad.rollout.hf import HFRollout
from rlpad.rollout.tools import ToolSet
from test_rollout_layout import P, make_model

TOK = build_tokenizer()
EOS = TOK.eos_token_id
VOCAB = make_model().config.vocab_size  # the model's (the tokenizer holds fewer)
PROMPTS = [[3 + (5 * i + j) % 60 for j in range(1 + i % P)] for i in range(6)]


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


class Steered:
    """The HF backend whose first turn is forced to start with a tool call (a real generate after it, real
    log-probs), as tests/test_multi_turn_rollout.py steers it."""

    def __init__(self, backend):
        self.backend, self.eos_token_ids, self.calls = backend, backend.eos_token_ids, 0
        self.script = enc("[calc(2+3)]")

    def _sample_each(self, contexts, sampling, seeds):
        self.calls += 1
        if all(len(c) <= P for c in contexts):
            toks, lps = self.backend._sample_each([c + self.script for c in contexts],
                                                  replace(sampling, max_tokens=sampling.max_tokens - len(self.script)), seeds)
            return [self.script + t for t in toks], [[0.0] * len(self.script) + lp for lp in lps]
        return self.backend._sample_each(contexts, sampling, seeds)


# rlpad's batched tool loop as it was before the loop became the registered tool_agent (main 9df3175,
# rlpad/rollout/agent.py's run_agent_loop): every active trajectory's turn in one engine call, the turn's
# tool calls in one run. The reference the per-trajectory loop must equal bit for bit.
def batched_reference(
    sample_each,
    prompts,
    sampling,
    *,
    tools,
    max_turns: int,
    eos,
    decode,
    render_tool,
    max_parallel_calls: int = 1,
    seed=None,
    prompt_offset: int = 0,
    images=None,
):
    if max_turns < 1:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns must be >= 1, got {max_turns}")
    n, budget = sampling.n, sampling.max_tokens
    trajs = [Trajectory() for _ in range(len(prompts) * n)]
    for turn in range(max_turns):
        active = [k for k, t in enumerate(trajs) if not t.done]
        if not active:
            break
        contexts = [list(prompts[k // n]) + trajs[k].tokens for k in active]
        room = max(budget - len(trajs[k].tokens) for k in active)
        seeds = None if seed is None else [sample_seed(seed, prompt_offset + k // n, k % n, turn) for k in active]
        step = replace(sampling, n=1, max_tokens=room, stop=turn_stops(tools.format, max_parallel_calls))
        outs, lps = (sample_each(contexts, step, seeds) if images is None else
                     sample_each(contexts, step, seeds, [images[k // n] for k in active]))
        calling = []
        for k, toks, lp in zip(active, outs, lps):
            t = trajs[k]
            toks, lp = list(toks)[: budget - len(t.tokens)], list(lp)
            cut = cut_turn(toks, eos, tools.format, decode, max_parallel_calls)
            t.extend(toks[: cut.kept], 1, lp[: cut.kept])
            t.num_turns += 1
            t.calls_dropped += cut.dropped
            if cut.by_eos or not cut.calls or turn == max_turns - 1 or len(t.tokens) >= budget:
                t.done = True
            else:
                calling.append((k, cut.calls))
        results = iter(tools.run([c for _, calls in calling for c in calls]))  # every sample's calls at once
        for k, calls in calling:
            t, done = trajs[k], [next(results) for _ in calls]
            t.tool_calls += len(calls)
            t.tool_turns += 1
            t.max_turn_calls = max(t.max_turn_calls, len(calls))
            failed = [r.reason for r in done if r.reason is not None]
            t.tool_errors += len(failed)
            t.errors += failed
            t.extend(render_tool([r.observation for r in done])[: budget - len(t.tokens)], 0)
            t.done = len(t.tokens) >= budget
    return trajs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent_loops")
    model = make_model()
    model.save_pretrained(path)
    build_tokenizer(path)
    backend = HFRollout(model, RolloutConfig(name="hf", n=2, temperature=1.0, seed=0),
                        DataConfig(max_prompt_length=P, max_response_length=24), tokenizer_path=str(path))
    tools = ToolSet(["mt_tools:calc"], "bracket", 5.0, 32, lambda s: len(enc(s)), max_token_chars=1)
    context = AgentContext(eos=frozenset({EOS}), decode=TOK.decode, tools=tools,
                           render_tool=lambda observations: enc("".join(observations)), max_turns=3, max_parallel_calls=1)
    yield backend, tools, context
    tools.close()


def test_tool_agent_over_the_batching_client_is_the_batched_tool_loop(setup):
    backend, tools, context = setup
    sampling, n, seed = Sampling(2, 1.0, 1.0, -1, 24), 2, 3
    ref_engine = Steered(backend)
    ref = batched_reference(ref_engine._sample_each, PROMPTS, sampling, tools=tools, max_turns=3, eos=context.eos,
                         decode=TOK.decode, render_tool=context.render_tool, seed=seed)
    engine = Steered(backend)
    client = BatchingClient(engine)
    rows = [{"prompt_ids": PROMPTS[k // n], "step_seed": seed, "prompt": k // n, "sample": k % n,
             "agent_name": "tool_agent"} for k in range(len(PROMPTS) * n)]
    outs = asyncio.run(run_agent_loops(client, context, sampling, rows, vocab_size=VOCAB))
    assert sum(t.tool_calls for t in ref) == len(ref) and max(t.num_turns for t in ref) >= 2
    for t, out in zip(ref, outs):
        assert out.response_ids == t.tokens and out.response_mask == t.generated and out.response_logprobs == t.log_probs
        assert out.num_turns == t.num_turns and all(out.extra_fields[k] == getattr(t, k) for k in AGENT_COUNTS)
        assert out.extra_fields["versions"] == [0 if g else -1 for g in t.generated]
    assert engine.calls == ref_engine.calls == client.calls  # one engine call per turn, as the batched loop
    again = Steered(backend)  # and run_agent_loop, the trainer's entry, runs the registered loop: the same
    trajs = run_agent_loop(again._sample_each, PROMPTS, sampling, tools=tools, max_turns=3, eos=context.eos,
                           decode=TOK.decode, render_tool=context.render_tool, seed=seed)
    assert [(t.tokens, t.generated, t.log_probs) for t in trajs] == [(t.tokens, t.generated, t.log_probs) for t in ref]


def test_single_turn_agent_is_one_request_per_row_batched(setup):
    backend, _, context = setup
    sampling = Sampling(1, 1.0, 1.0, -1, 16)
    client = BatchingClient(backend)
    seeds = [11, 12, 13, 14, 15, 16]
    rows = [{"prompt_ids": p, "seed": s} for p, s in zip(PROMPTS, seeds)]  # no agent_name: the default loop
    outs = asyncio.run(run_agent_loops(client, context, sampling, rows, vocab_size=VOCAB))
    toks, lps = backend._sample_each(PROMPTS, sampling, seeds)
    for out, t, lp in zip(outs, toks, lps):
        cut = next((k + 1 for k, x in enumerate(t) if x == EOS), len(t))
        assert out.response_ids == t[:cut] and out.response_logprobs == lp[:cut] and out.response_mask == [1] * cut
    assert client.calls == 1


def test_batching_client_says_why_a_response_ended(setup):
    """vLLM's finish reasons through the BatchingClient: "stop" for EOS and for a stop string (the HF backend's
    StopAtText ends the row early), "length" for the budget."""
    backend, _, _ = setup
    client = BatchingClient(backend)
    sampling, seeds = Sampling(1, 1.0, 1.0, -1, 8), [31, 32, 33, 34, 35, 36]

    async def each(samp):
        return await client.gather([client.generate(p, samp, s) for p, s in zip(PROMPTS, seeds)])

    free = asyncio.run(each(sampling))
    assert [g.finish_reason for g in free] == ["stop" if EOS in g.token_ids else "length" for g in free]
    assert all(len(g.token_ids) == 8 for g in free if g.finish_reason == "length")
    # a stop string: the text of a budget-ended response's k-th token (k < 7) not written before it; the same batch
    # and seeds sample the same tokens up to it
    i, k = next((i, k) for i, g in enumerate(free) if g.finish_reason == "length" for k in range(1, 7)
                if TOK.decode(g.token_ids[k:k + 1]) and TOK.decode(g.token_ids[k:k + 1]) not in TOK.decode(g.token_ids[:k]))
    cut = asyncio.run(each(replace(sampling, stop=(TOK.decode(free[i].token_ids[k:k + 1]),))))[i]
    assert cut.token_ids == free[i].token_ids[: k + 1] and cut.finish_reason == "stop"


class EchoLoop(AgentLoopBase):
    """A user's loop from a YAML config: answers with its ``reply`` kwarg, tool-free."""

    async def run(self, sampling_params, **row):
        ids = enc(self.kwargs["reply"])
        return AgentLoopOutput(row["prompt_ids"], ids, [1] * len(ids), [0.0] * len(ids), reward_score=1.0, num_turns=1)


@register("broken_for_test")
class Broken(AgentLoopBase):
    async def run(self, sampling_params, **row):
        how = row["how"]
        ids = {"vocab": [1, 10**6, 3], "negative": [1, -1, 3], "float": [1, 2.0, 3]}.get(how, [1, 2, 3])
        mask = {"mask": [1, 1], "values": [1, 2, 1]}.get(how, [1, 1, 1])
        logprobs = [0.0, 0.0] if how == "logprobs" else None
        prompt = [7, VOCAB] if how == "prompt" else row["prompt_ids"]
        return AgentLoopOutput(prompt, ids * (10 if how == "long" else 1), mask * (10 if how == "long" else 1),
                               logprobs)


def test_loops_by_name_from_yaml_and_bad_outputs_refused(setup, tmp_path):
    _, _, context = setup
    sampling = Sampling(1, 1.0, 1.0, -1, 16)
    config = tmp_path / "loops.yaml"
    config.write_text("- name: echo\n  _target_: test_agent_loops:EchoLoop\n  reply: ok\n")
    loops = load_agent_loop_config(str(config))
    rows = [{"prompt_ids": [5, 6], "agent_name": "echo"}, {"prompt_ids": [7], "agent_name": "broken_for_test", "how": "ok"}]
    outs = asyncio.run(run_agent_loops(_NoEngine(), context, sampling, rows,
                                       vocab_size=VOCAB, configs=loops))
    assert outs[0].response_ids == enc("ok") and outs[0].reward_score == 1.0 and outs[1].response_ids == [1, 2, 3]
    for how, match in (("mask", "response_mask has 2 entries for 3"), ("vocab", "token id 1000000 is outside"),
                       ("long", "30 response tokens, more than the budget of 16"),
                       ("logprobs", "response_logprobs has 2 entries for 3"), ("negative", "token id -1 is outside"),
                       ("float", "token id 2.0 is outside"), ("values", "response_mask holds values other than 0 and 1"),
                       ("prompt", f"token id {VOCAB} is outside")):
        bad = [rows[1], {"prompt_ids": [7], "agent_name": "broken_for_test", "how": how}]
        with pytest.raises(ValueError, match=rf"agent loop 'broken_for_test' \(row 1\): {match}"):
            asyncio.run(run_agent_loops(_NoEngine(), context, sampling, bad, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="row 0: agent_name 'nope' is not a registered agent loop"):
        asyncio.run(run_agent_loops(_NoEngine(), context, sampling, [{"prompt_ids": [1], "agent_name": "nope"}],
                                    vocab_size=VOCAB))
    config.write_text("- name: x\n  _target_: test_agent_loops:Nothing\n")
    with pytest.raises(ValueError, match="agent_loop_config_path: entry 'x': cannot import"):
        load_agent_loop_config(str(config))


class _NoEngine(BatchingClient):
    """A batching client with no backend (the loops above never generate)."""

    def __init__(self):
        super().__init__(type("B", (), {"eos_token_ids": frozenset({EOS})})())


class EnvLoop(AgentLoopBase):
    """A user's loop (from agent_loop_config_path): a generated turn, an environment reply (mask 0), a second
    generated turn; it records which rows it ran."""

    ran: list[tuple[int, int, str]] = []

    async def run(self, sampling_params, **row):
        EnvLoop.ran.append((row["prompt"], row["sample"], row["extra_info"]["tag"]))
        first = await self.client.generate(row["prompt_ids"], replace(sampling_params, max_tokens=6), row["seed"])
        turn = [t for t in first.token_ids if t != EOS] + enc(self.kwargs["reply"])  # EOS dropped: the env answers
        lps = first.log_probs[: len(turn) - len(enc(self.kwargs["reply"]))]
        mask = [1] * len(lps) + [0] * (len(turn) - len(lps))
        lps = lps + [0.0] * (len(turn) - len(lps))
        second = await self.client.generate(row["prompt_ids"] + turn, replace(sampling_params, max_tokens=6),
                                            row["seed"] + 1)
        return AgentLoopOutput(row["prompt_ids"], turn + second.token_ids, mask + [1] * len(second.token_ids),
                               lps + second.log_probs, num_turns=2)


def test_rollout_picks_each_rows_loop_by_agent_name(setup, tmp_path):
    """The HF backend's generate with rollout.agent keys: rows naming the YAML's loop run it, the others the
    default (single_turn_agent); the environment's tokens are context (attention 1), never scored
    (response_mask 0, rollout log-prob 0, log-prob 0 and no loss gradient); generated tokens' rollout
    log-probs are the forward's."""
    import torch

    from rlpad.algorithms.losses import compute_policy_loss
    from rlpad.config.schema import AgentConfig
    from rlpad.core.forward import compute_log_probs
    from rlpad.embedded.exactness import ENGINE_LOGPROB_TOL
    from rlpad.recipe.checks import agent_loop_problems
    from test_rollout_layout import prompt_batch

    backend = setup[0]
    config = tmp_path / "loops.yaml"
    config.write_text("- name: env\n  _target_: test_agent_loops:EnvLoop\n  reply: ' env says hi'\n")
    agent = AgentConfig(agent_loop_config_path=str(config))
    assert agent_loop_problems(agent, False) == []
    rollout = replace(backend.rollout, agent=agent)
    hf = HFRollout(backend.model, rollout, backend.data, tokenizer_path=backend.tokenizer.name_or_path)
    batch = prompt_batch()
    names = ["env", None, "env", None, None, "env"]
    batch["agent_name"] = names
    batch["extra_info"] = [{"tag": f"t{i}"} for i in range(len(names))]
    EnvLoop.ran.clear()
    out = hf.generate(batch, seed=5)
    assert sorted(EnvLoop.ran) == [(i, j, f"t{i}") for i in (0, 2, 5) for j in range(2)]
    reply = enc(" env says hi")
    attn = out["attention_mask"][:, P:]
    env = attn.bool() & ~out["response_mask"].bool()
    for k in range(12):
        if names[k // 2] == "env":
            assert env[k].sum() == len(reply) and out["responses"][k][env[k]].tolist() == reply
        else:
            assert not env[k].any() and out["response_mask"][k].sum() >= 1  # the default loop: all generated
    assert (out["rollout_log_probs"][env] == 0).all()
    model = backend.model
    lp, _ = compute_log_probs(model, out["input_ids"], out["attention_mask"], out["position_ids"], 24,
                              use_remove_padding=True, response_mask=out["response_mask"])
    assert (lp[env] == 0).all()
    gen = out["response_mask"].bool()
    assert (lp - out["rollout_log_probs"])[gen].abs().max() < ENGINE_LOGPROB_TOL
    new = lp.detach().clone().requires_grad_(True)  # the policy loss: no gradient reaches an env token
    loss, _ = compute_policy_loss(out["rollout_log_probs"], new, torch.ones_like(new), out["response_mask"])
    loss.backward()
    assert (new.grad[env] == 0).all() and (new.grad[gen] != 0).all()
    # bad keys, one line each
    assert agent_loop_problems(AgentConfig(default_agent_loop="nope"), False) == [
        "actor_rollout_ref.rollout.agent.default_agent_loop='nope' is not an agent loop; choose one of "
        "broken_for_test, env_agent, single_turn_agent, tool_agent (or add it to actor_rollout_ref.rollout.agent.agent_loop_config_path)"]
    assert agent_loop_problems(AgentConfig(default_agent_loop="tool_agent"), False) == [
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent needs actor_rollout_ref.rollout.multi_turn.enable=true (its tools)"]
    for text, says in (("- name: x\n  _target_: test_agent_loops:Nothing\n", "entry 'x': cannot import"),
                       ("- name: x\n  _target_: test_agent_loops:Steered\n", "entry 'x': test_agent_loops:Steered is not an AgentLoopBase"),
                       ("- name: [x\n", "cannot be read as YAML"), ("- name: tool_agent\n  _target_: a.B\n", "built-in")):
        config.write_text(text)
        (problem,) = agent_loop_problems(agent, False)
        assert problem.startswith("actor_rollout_ref.rollout.agent.agent_loop_config_path") and says in problem
        assert "\n" not in problem
    (problem,) = agent_loop_problems(AgentConfig(agent_loop_config_path=str(tmp_path / "none.yaml")), False)
    assert "cannot be read as YAML" in problem
    from rlpad.config.schema import Config
    from rlpad.config.streaming import streaming_problems

    streaming = Config()
    streaming.async_training.enable, streaming.actor_rollout_ref.rollout.agent.default_agent_loop = True, "env"
    assert any(p.startswith("actor_rollout_ref.rollout.agent.default_agent_loop=env is not supported with "
                            "async_training.enable=true") for p in streaming_problems(streaming, False))
