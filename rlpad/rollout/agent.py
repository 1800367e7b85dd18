"""The multi-turn agent loop on a rollout engine: generate, call a tool, append its output, go on.

Per sample (the ``n`` samples of every prompt, prompt-major), up to ``max_assistant_turns`` turns:

1. generate from ``prompt + response so far`` until EOS, the close of a call when a call ends the turn
   (:func:`turn_stops`), or the response-length budget, and keep the
   turn up to its first EOS or the end of its calls (:func:`cut_turn`: the first run of calls in
   the decoded text, parallel calls included, at most ``max_parallel_calls``); these tokens are the
   policy's (``generated`` 1, their rollout log-probs kept);
2. EOS, the budget, the last turn, or no tool call: the sample is done;
3. else run the calls, every sample's at once (:class:`rlpad.rollout.tools.ToolSet`: errors become
   short observations) and append ``render_tool(observations)``: the template's close of the
   assistant turn, one tool message per call in order and the next assistant prompt
   (:func:`rlpad.rollout.base.tool_turn_renderer`; ``generated`` 0, log-prob 0), cut at the budget;
   go on, unless that was the ``max_user_turns``-th tool turn (verl's cap: the sample ends after it).

The random draws of sample j of prompt i in turn k depend only on (seed, i + prompt_offset, j, k)
(:func:`rlpad.rollout.seeds.sample_seed`, the rollout's one seed rule), so a split of the prompts over
replicas never changes the samples.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from rlpad.rollout.agent_loops import AgentContext, AgentLoopBase, AgentLoopOutput, register, run_agent_loops
from rlpad.rollout.engine_client import BatchingClient
from rlpad.rollout.seeds import sample_seed
from rlpad.rollout.tools import ToolCall, ToolFormat, ToolSet

__all__ = ["AGENT_COUNTS", "ToolAgentLoop", "Trajectory", "TurnCut", "cut_turn", "multi_turn_metrics", "run_agent_loop",
           "run_named_loops", "turn_scores", "turn_stops"]

# the per-sample counts a rollout batch carries (one tensor each), read by the multi_turn/* metrics
AGENT_COUNTS = ("num_turns", "tool_calls", "tool_errors", "tool_turns", "max_turn_calls", "calls_dropped")

# (contexts, sampling with n=1, one seed per context or None[, each context's prompt images]) -> (tokens,
# log-probs) per context
SampleEach = Callable[..., tuple[list[list[int]], list[list[float]]]]


@dataclass
class Trajectory:
    """One sample's response: ``tokens``, ``generated`` (1 = the policy's), ``log_probs`` (0 on tool
    tokens), and its counts."""

    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_turns: int = 0  # turns that made calls
    max_turn_calls: int = 0  # the most calls one turn made (parallel calls)
    calls_dropped: int = 0  # calls past max_parallel_calls, not run (the turn is cut before them)
    errors: list[str] = field(default_factory=list)  # each failed call's reason (for the log)
    done: bool = False
    turn_rewards: list[tuple[int, float]] | None = None  # an environment's (response index, reward); None: none ran
    tool_rewards: dict[str, float] | None = None  # each stateful tool's calc_reward; None: no stateful tools ran
    tool_step_rewards: list[float] | None = None  # each stateful tool call's step reward (execute's), in order

    def extend(self, tokens: Sequence[int], generated: int, log_probs: Sequence[float] | None = None) -> None:
        self.tokens += list(tokens)
        self.generated += [generated] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)


def turn_stops(fmt: ToolFormat, max_calls: int) -> tuple[str, ...]:
    """The strings that end a turn besides EOS (the engine stops at the token completing one and keeps
    it): a call's close when the format's calls end the turn (``fmt.call_ends_turn``: the model does not
    write an end-of-turn token after them) or when a turn may make one call; else none, and the turn
    runs to the model's end-of-turn token (EOS) so that its parallel calls are all seen. Where the turn
    was cut at that token before, the same tokens are sampled: the engine's draws are causal."""
    return (fmt.end,) if fmt.call_ends_turn or max_calls == 1 else ()


@dataclass(frozen=True)
class TurnCut:
    """Where a generated turn ends: ``kept`` tokens (through its first EOS, or through the token holding
    the end of its last call), ``by_eos``, its ``calls`` and the ``dropped`` calls past the cap."""

    kept: int
    by_eos: bool
    calls: list[ToolCall]
    dropped: int = 0


def cut_turn(tokens: list[int], eos: frozenset[int], fmt: ToolFormat, decode: Callable[[list[int]], str],
             max_calls: int) -> TurnCut:
    """Find a turn's calls in its decoded text, whatever the tokenisation: the text before the first EOS
    is decoded once and searched (:meth:`ToolFormat.find`: the first run of calls, parallel calls
    included, at most ``max_calls``); the cut is after the first token whose prefix holds the run's
    ``m`` closing strings, found by bisection (``log2(len)`` decodes, not one per token). A token that
    merges a call's close with what follows (``)]`` + newline, ``>`` + newline) is kept whole."""
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    body = tokens if stop is None else tokens[:stop]
    text = decode(body) if body else ""
    calls, end, dropped = fmt.find(text, max_calls)
    if not calls:
        return TurnCut(len(tokens) if stop is None else stop + 1, stop is not None, [])
    need = text[:end].count(fmt.end)
    lo, hi = 1, len(body)  # the smallest k with decode(body[:k]) holding `need` closing strings
    while lo < hi:
        mid = (lo + hi) // 2
        if decode(body[:mid]).count(fmt.end) >= need:
            hi = mid
        else:
            lo = mid + 1
    return TurnCut(lo, False, calls, dropped)


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """rlpad's multi-turn tool loop (the module docstring) for one trajectory; the turn
    seeds :func:`rlpad.rollout.seeds.sample_seed` of (step seed, prompt, sample, turn): ``row["step_seed"]``, ``row["prompt"]``,
    ``row["sample"]``."""

    async def run(self, sampling_params, **row):
        step_seed, session = row.get("step_seed"), None
        if self.context.stateful is not None:  # instance ids from the trajectory's seed: the same after a resume
            first = None if step_seed is None else sample_seed(step_seed, row["prompt"], row["sample"], 0)
            session = await self.context.stateful.open(row.get("extra_info"), first)
        try:
            out = await self._turns(sampling_params, session, row)
        finally:
            rewards = None if session is None else await session.close()  # every instance released
        if session is not None:
            out.extra_fields.update(tool_rewards=rewards, tool_step_rewards=session.step_rewards)
            out.extra_fields["errors"] += session.errors
            out.metrics["tools"] = session.metrics
        return out

    async def _calls(self, calls: list[ToolCall], session: Any) -> list[Any]:
        """The turn's results in order: the stateful tools' calls through the trajectory's session, the others
        through the tool set (batched with the other trajectories')."""
        mine = [] if session is None else [i for i, c in enumerate(calls) if c.problem is None and c.name in session.names]
        if not mine:
            return await self.run_tools(calls)
        rest = [c for i, c in enumerate(calls) if i not in mine]
        own = await asyncio.gather(*(session.run(calls[i]) for i in mine))
        others = iter(await self.run_tools(rest) if rest else [])
        by_index = dict(zip(mine, own))
        return [by_index[i] if i in by_index else next(others) for i in range(len(calls))]

    async def _turns(self, sampling_params: Any, session: Any, row: dict[str, Any]) -> AgentLoopOutput:
        ctx, budget = self.context, sampling_params.max_tokens
        prompt, t = list(row["prompt_ids"]), Trajectory()
        versions: list[int] = []
        step_seed = row.get("step_seed")
        stops = turn_stops(ctx.tools.format, ctx.max_parallel_calls)  # the turn ends where the model ends it
        for turn in range(ctx.max_turns):
            seed = None if step_seed is None else sample_seed(step_seed, row["prompt"], row["sample"], turn)
            turn_sampling = replace(sampling_params, max_tokens=budget - len(t.tokens), stop=stops)
            gen = await self.client.generate(prompt + t.tokens, turn_sampling,
                                             seed, images=row.get("images"))
            cut = cut_turn(gen.token_ids, ctx.eos, ctx.tools.format, ctx.decode, ctx.max_parallel_calls)
            t.extend(gen.token_ids[: cut.kept], 1, gen.log_probs[: cut.kept])
            versions += gen.versions[: cut.kept]
            t.num_turns += 1
            t.calls_dropped += cut.dropped
            if cut.by_eos or not cut.calls or turn == ctx.max_turns - 1 or len(t.tokens) >= budget:
                break
            done = await self._calls(cut.calls, session)
            t.tool_calls += len(cut.calls)
            t.tool_turns += 1
            t.max_turn_calls = max(t.max_turn_calls, len(cut.calls))
            failed = [r.reason for r in done if r.reason is not None]
            t.tool_errors += len(failed)
            t.errors += failed
            tool_tokens = ctx.render_tool([r.observation for r in done])[: budget - len(t.tokens)]
            t.extend(tool_tokens, 0)
            versions += [-1] * len(tool_tokens)  # no policy sampled them
            if len(t.tokens) >= budget or (ctx.max_user_turns is not None and t.tool_turns >= ctx.max_user_turns):
                break
        extra = {k: getattr(t, k) for k in AGENT_COUNTS}
        extra.update(errors=t.errors, versions=versions)
        return AgentLoopOutput(prompt, t.tokens, t.generated, t.log_probs, num_turns=t.num_turns, extra_fields=extra)


def run_agent_loop(
    sample_each: SampleEach,
    prompts: Sequence[Sequence[int]],
    sampling: Any,
    *,
    tools: ToolSet,
    max_turns: int,
    max_user_turns: int | None = None,
    eos: frozenset[int],
    decode: Callable[[list[int]], str],
    render_tool: Callable[[list[str]], list[int]],
    max_parallel_calls: int = 1,
    seed: int | None = None,
    prompt_offset: int = 0,
    images: Sequence[Any] | None = None,
    stateful: Any = None,
    extra_info: Sequence[Any] | None = None,
) -> list[Trajectory]:
    """``len(prompts) * sampling.n`` trajectories, prompt-major (see the module docstring).
    ``sampling.max_tokens`` is the response budget (generated and tool tokens together);
    ``render_tool(observations)``: the tokens after a turn that made ``len(observations)`` calls;
    ``images``: each prompt's ``multi_modal_inputs`` (a VL model), passed with each context (tools
    return text only); ``stateful``: the stateful tools (rlpad.rollout.stateful_tools) with each prompt's
    ``extra_info`` (their tools_kwargs)."""
    if max_turns < 1:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns must be >= 1, got {max_turns}")
    # the registered tool_agent loop, one coroutine per trajectory, its generations and tool calls batched per
    # turn by the batching engine client
    class Engine:  # the batching client's backend: the given sample_each
        eos_token_ids = eos
        _sample_each = staticmethod(sample_each)

    client, n = BatchingClient(Engine()), sampling.n
    context = AgentContext(eos=eos, decode=decode, tools=tools, render_tool=render_tool, max_turns=max_turns,
                           max_user_turns=max_user_turns,
                           max_parallel_calls=max_parallel_calls, stateful=stateful)
    step = replace(sampling, n=1)
    rows = [dict(prompt_ids=list(prompts[k // n]), step_seed=seed, prompt=prompt_offset + k // n, sample=k % n,
                 images=None if images is None else images[k // n],
                 extra_info=None if extra_info is None else extra_info[k // n]) for k in range(len(prompts) * n)]

    async def run() -> list[Any]:
        return await client.gather([ToolAgentLoop(client, context).run(step, **row) for row in rows])

    trajs = []
    for out in asyncio.run(run()):
        extra = out.extra_fields
        trajs.append(Trajectory(out.response_ids, out.response_mask, out.response_logprobs,
                                **{k: extra[k] for k in AGENT_COUNTS}, errors=extra["errors"], done=True,
                                tool_rewards=extra.get("tool_rewards"), tool_step_rewards=extra.get("tool_step_rewards")))
    return trajs


def run_named_loops(
    backend: Any,
    prompts: Sequence[Sequence[int]],
    names: Sequence[str],
    fields: dict[str, Sequence[Any]],
    sampling: Any,
    *,
    context: AgentContext,
    configs: dict[str, Any],
    vocab_size: int,
    seed: int | None = None,
    prompt_offset: int = 0,
    images: Sequence[Any] | None = None,
) -> list[Trajectory]:
    """``len(prompts) * sampling.n`` trajectories, prompt-major, each by the loop ``names[prompt]`` names
    (:func:`rlpad.rollout.agent_loops.run_agent_loops`) over a :class:`BatchingClient` on ``backend`` (a
    synchronous RolloutBackend: every loop's requests of a round in one ``_sample_each`` call). A row gets its
    prompt's non-tensor ``fields`` (raw_prompt, extra_info, ...), ``prompt_ids``, ``index`` (its place in the
    call), ``step_seed`` / ``prompt`` / ``sample`` (the tool loop's seed rule) and ``seed`` (its first request's:
    ``sample_seed(seed, prompt, sample, 0)``). A loop's counts it does not report are 0; missing log-probs 0."""
    n = sampling.n
    if context.tools is None and "tool_agent" in names:
        raise ValueError("agent_name tool_agent needs actor_rollout_ref.rollout.multi_turn.enable=true (its tools)")
    rows = []
    for k in range(len(prompts) * n):
        i, j = divmod(k, n)
        row = {key: values[i] for key, values in fields.items()}
        row.update(prompt_ids=list(prompts[i]), index=k, agent_name=names[i], step_seed=seed,
                   prompt=prompt_offset + i, sample=j, seed=None if seed is None else sample_seed(seed, prompt_offset + i, j, 0),
                   images=None if images is None else images[i])
        rows.append(row)
    outs = asyncio.run(run_agent_loops(BatchingClient(backend), context, sampling, rows, vocab_size=vocab_size,
                                       configs=configs))
    trajs = []
    for out in outs:
        extra = out.extra_fields
        log_probs = out.response_logprobs if out.response_logprobs is not None else [0.0] * len(out.response_ids)
        trajs.append(Trajectory(list(out.response_ids), list(out.response_mask), list(log_probs),
                                **{k: int(extra.get(k, out.num_turns if k == "num_turns" else 0)) for k in AGENT_COUNTS},
                                errors=list(extra.get("errors", [])), done=True,
                                turn_rewards=extra.get("turn_rewards"), tool_rewards=extra.get("tool_rewards"),
                                tool_step_rewards=extra.get("tool_step_rewards")))
    return trajs


def turn_scores(trajs: Sequence[Trajectory], width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(env_scores (B, width) float32: each turn's reward on its response index, env_rows (B,) bool)`` of
    trajectories some of which ran an environment (``turn_rewards``); None when none did."""
    if all(t.turn_rewards is None for t in trajs):
        return None
    import torch  # the config checks import this module for its loop: torch on first use

    scores = torch.zeros(len(trajs), width, dtype=torch.float32)
    for i, t in enumerate(trajs):
        for index, reward in t.turn_rewards or []:
            scores[i, index] += reward
    return scores, torch.tensor([t.turn_rewards is not None for t in trajs])


def multi_turn_metrics(batch: Any, prefix: str) -> tuple[dict[str, float], str | None]:
    """``{prefix}*`` metrics of a rollout batch's :data:`AGENT_COUNTS` (none for single-turn), and, when
    more than half of its tool calls failed, the console's line about it (the first failure's reason)."""
    if "tool_calls" not in batch:
        return {}, None
    mask, attention = batch["response_mask"], batch["attention_mask"]
    calls, errors, turns = (int(batch[k].sum()) for k in ("tool_calls", "tool_errors", "tool_turns"))
    failed = None
    if errors * 2 > calls:
        first = next((r for r in batch["tool_error"] if r), "?")
        failed = f"{errors} of {calls} tool calls failed; the first: {first} (every failure is in run.log)"
    return {f"{prefix}tool_calls": float(calls), f"{prefix}tool_errors": float(errors),
            f"{prefix}num_turns/mean": float(batch["num_turns"].float().mean()),
            f"{prefix}tool_tokens/mean": float((attention[:, -mask.shape[1]:] - mask).sum(1).float().mean()),
            f"{prefix}calls_per_turn/mean": calls / turns if turns else 0.0,
            f"{prefix}calls_per_turn/max": float(batch["max_turn_calls"].max()),
            f"{prefix}calls_dropped": float(batch["calls_dropped"].sum())}, failed
