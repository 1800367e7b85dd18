"""The multi-turn agent loop on a rollout engine: generate, call a tool, append its output, go on.

Per sample (the ``n`` samples of every prompt, prompt-major), up to ``max_assistant_turns`` turns:

1. generate from ``prompt + response so far`` until EOS, the end of a tool call
   (:data:`rlpad.rollout.tools.FORMATS`) or the response-length budget; these tokens are the
   policy's (``generated`` 1, their rollout log-probs kept);
2. EOS, the budget, the last turn, or no tool call: the sample is done;
3. else run the tool (:class:`rlpad.rollout.tools.ToolSet`: errors become observations) and append
   ``render_tool(output)``: the template's close of the assistant turn, the tool message and the
   next assistant prompt (:func:`rlpad.rollout.base.tool_turn_renderer`; ``generated`` 0, log-prob 0),
   cut at the budget; go on.

The random draws of sample j of prompt i in turn k depend only on (seed, i + prompt_offset, j, k)
(:func:`turn_seed`), so a split of the prompts over replicas never changes the samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlpad.rollout.tools import ToolSet

__all__ = ["Trajectory", "run_agent_loop", "turn_seed"]

# (contexts, sampling with n=1, one seed per context or None) -> (tokens, log-probs) per context
SampleEach = Callable[[list[list[int]], Any, "list[int] | None"], tuple[list[list[int]], list[list[float]]]]


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
    done: bool = False

    def extend(self, tokens: Sequence[int], generated: int, log_probs: Sequence[float] | None = None) -> None:
        self.tokens += list(tokens)
        self.generated += [generated] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)


def turn_seed(seed: int, prompt: int, sample: int, turn: int) -> int:
    """The engine seed of one turn of one sample: distinct per (prompt, sample, turn), global in ``prompt``."""
    return (((seed * 1_000_003 + prompt) * 1_009 + sample) * 101 + turn) % (2**63 - 1)


def _cut_turn(tokens: list[int], eos: frozenset[int], end: str,
              decode: Callable[[list[int]], str]) -> tuple[int, bool, bool]:
    """``(kept, ended_by_eos, ended_by_call)``: the tokens of a turn up to its first EOS or the end of
    its first tool call (decoded text), whichever comes first. Each check decodes a window of the
    last ``2 * len(end)`` tokens (a token is at least one character), not the whole prefix."""
    window = 2 * len(end)
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1, True, False
        if end and decode(tokens[max(0, i + 1 - window): i + 1]).endswith(end):
            return i + 1, False, True
    return len(tokens), False, False


def run_agent_loop(
    sample_each: SampleEach,
    prompts: Sequence[Sequence[int]],
    sampling: Any,
    *,
    tools: ToolSet,
    max_turns: int,
    eos: frozenset[int],
    decode: Callable[[list[int]], str],
    render_tool: Callable[[str], list[int]],
    seed: int | None = None,
    prompt_offset: int = 0,
) -> list[Trajectory]:
    """``len(prompts) * sampling.n`` trajectories, prompt-major (see the module docstring).
    ``sampling.max_tokens`` is the response budget (generated and tool tokens together)."""
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
        seeds = None if seed is None else [turn_seed(seed, prompt_offset + k // n, k % n, turn) for k in active]
        outs, lps = sample_each(contexts, replace(sampling, n=1, max_tokens=room), seeds)
        for k, toks, lp in zip(active, outs, lps):
            t = trajs[k]
            toks, lp = list(toks)[: budget - len(t.tokens)], list(lp)
            kept, by_eos, by_call = _cut_turn(toks, eos, tools.format.end, decode)
            t.extend(toks[:kept], 1, lp[:kept])
            t.num_turns += 1
            if by_eos or not by_call or turn == max_turns - 1 or len(t.tokens) >= budget:
                t.done = True
                continue
            call = tools.format.parse(decode(toks[:kept]))
            if call is None:
                t.done = True
                continue
            observation, error = tools.call(call)
            t.tool_calls += 1
            t.tool_errors += int(error)
            t.extend(render_tool(observation)[: budget - len(t.tokens)], 0)
            t.done = len(t.tokens) >= budget
    return trajs
