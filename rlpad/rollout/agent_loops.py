"""Agent loops by name (verl's shape): a class per loop, one coroutine per trajectory, over an engine client.

A loop is an :class:`AgentLoopBase` subclass registered with ``@register("name")``; ``async def
run(self, sampling_params, **row) -> AgentLoopOutput`` gets the row (``prompt_ids``, ``seed``: the
engine seed of its first turn's request, ``index``: its place in the step (prompt-major), ``images``,
``extra_info``, ``agent_name``, the prompt row's other non-tensor fields: ``raw_prompt``, ...) and generates
through ``self.client`` (an :class:`rlpad.rollout.engine_client.EngineClient`). A row's ``agent_name`` (verl's
data column) picks its loop, else ``rollout.agent.default_agent_loop`` (:func:`default_loop`);
``rollout.agent.agent_loop_config_path`` is a YAML list of ``name`` + ``_target_`` (``pkg.module:Class`` or
``pkg.module.Class``) + keyword arguments for the class; both are checked at config load
(:func:`agent_loop_problems`).

Built in: ``single_turn_agent`` (one request), ``env_agent`` (an environment's episode, rlpad.rollout.env_loop) and ``tool_agent`` (rlpad's multi-turn tool loop,
rlpad.rollout.agent, per trajectory; :func:`rlpad.rollout.agent.run_agent_loop` runs it over a
:class:`BatchingClient`, each turn's generations and tool calls of every trajectory batched). What a loop returns is checked
(:func:`check_output`) and refused naming the loop and the row.
"""

from __future__ import annotations

import asyncio
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlpad.functions import import_class, read_yaml
from rlpad.rollout.engine_client import BatchingClient, EngineClient

__all__ = ["AGENT_LOOPS", "AgentContext", "AgentLoopBase", "AgentLoopOutput", "agent_loop_problems", "check_output",
           "default_loop", "load_agent_loop_config", "loop_names", "loop_table", "register", "run_agent_loops"]

KEY = "actor_rollout_ref.rollout.agent"


@dataclass
class AgentLoopOutput:
    """verl's fields: ``response_ids`` (generated and tool tokens), ``response_mask`` (1 generated, 0 tool),
    ``response_logprobs`` (0 on tool tokens), ``reward_score`` (None: the reward function scores it)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    extra_fields: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentContext:
    """What every loop of a rollout shares: the response budget (``sampling_params.max_tokens``), EOS ids, the
    tokenizer's decode, the tool set / stateful tools / tool-turn renderer / limits of ``rollout.multi_turn``
    (tool_agent)."""

    eos: frozenset[int]
    decode: Callable[[list[int]], str]
    tools: Any = None
    render_tool: Callable[[list[str]], list[int]] | None = None
    max_turns: int = 1
    max_user_turns: int | None = None  # multi_turn.max_user_turns: replies (tool turns, environment replies) at most
    max_parallel_calls: int = 1
    stateful: Any = None  # rlpad.rollout.stateful_tools.StatefulTools (multi_turn.tool_config_path), tool_agent's
    env: Any = None  # rlpad.rollout.env_loop.EnvSetup (rollout.agent.environment), env_agent's


class AgentLoopBase(ABC):
    """One trajectory per :meth:`run` call; ``kwargs``: the loop's own from the agent-loop config."""

    def __init__(self, client: EngineClient, context: AgentContext, **kwargs: Any):
        self.client, self.context, self.kwargs = client, context, kwargs

    @abstractmethod
    async def run(self, sampling_params: Any, **row: Any) -> AgentLoopOutput:
        """The trajectory of one row (sampling_params: rlpad.rollout.base.Sampling with n == 1)."""

    async def run_tools(self, calls: list[Any]) -> list[Any]:
        """The tool calls through the context's tool set: batched with every other trajectory's of the
        same turn under a BatchingClient, else in a thread."""
        if isinstance(self.client, BatchingClient):
            return await self.client.call_batched(self.context.tools.run, calls)
        return await asyncio.to_thread(self.context.tools.run, calls)


AGENT_LOOPS: dict[str, type[AgentLoopBase]] = {}  # name -> class (register, load_agent_loop_config)
# the built-in loops defined elsewhere, "module:class", imported on first use (their modules import this one)
BUILTIN_LOOPS = {"tool_agent": "rlpad.rollout.agent:ToolAgentLoop",
                 "env_agent": "rlpad.rollout.env_loop:EnvAgentLoop"}


def register(name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: the loop is chosen by rows whose ``agent_name`` is ``name``."""
    def add(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise TypeError(f"@register({name!r}): {cls!r} is not an AgentLoopBase subclass")
        AGENT_LOOPS[name] = cls
        return cls
    return add


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One request from the prompt: every token generated."""

    async def run(self, sampling_params, **row):
        gen = await self.client.generate(row["prompt_ids"], sampling_params, row.get("seed"), images=row.get("images"))
        return AgentLoopOutput(list(row["prompt_ids"]), gen.token_ids, [1] * len(gen.token_ids), gen.log_probs,
                               num_turns=1, extra_fields={"versions": gen.versions})


def check_output(out: Any, name: str, row: int, vocab_size: int, budget: int) -> None:
    """A loop's output as the rollout layout needs it; else one ValueError naming the loop and the row."""
    where = f"agent loop {name!r} (row {row})"
    if not isinstance(out, AgentLoopOutput):
        raise ValueError(f"{where} returned {type(out).__name__}, not an AgentLoopOutput")
    n = len(out.response_ids)
    if len(out.response_mask) != n:
        raise ValueError(f"{where}: response_mask has {len(out.response_mask)} entries for {n} response tokens")
    if out.response_logprobs is not None and len(out.response_logprobs) != n:
        raise ValueError(f"{where}: response_logprobs has {len(out.response_logprobs)} entries for {n} response tokens")
    if n > budget:
        raise ValueError(f"{where}: {n} response tokens, more than the budget of {budget}")
    if any(m not in (0, 1) for m in out.response_mask):
        raise ValueError(f"{where}: response_mask holds values other than 0 and 1")
    bad = [t for t in list(out.prompt_ids) + list(out.response_ids)
           if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]!r} is outside the vocabulary (0..{vocab_size - 1})")


def load_agent_loop_config(path: str) -> dict[str, tuple[type[AgentLoopBase], dict[str, Any]]]:
    """``agent_loop_config_path``: a YAML list of ``{name, _target_, **kwargs}`` -> name -> (class, kwargs)."""
    key = f"{KEY}.agent_loop_config_path"
    entries = read_yaml(path, key, [])
    if not isinstance(entries, list):
        raise ValueError(f"{key}: {path} must hold a YAML list of {{name, _target_, ...}}")
    loops = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "name" not in entry or "_target_" not in entry:
            raise ValueError(f"{key}: entry {i} of {path} needs name and _target_")
        if entry["name"] in ("single_turn_agent", *BUILTIN_LOOPS):
            raise ValueError(f"{key}: entry {entry['name']!r} is a built-in loop's name; name yours otherwise")
        kwargs = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
        target = str(entry["_target_"])
        try:
            cls = import_class(target)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"{key}: entry {entry['name']!r}: cannot import {target!r} ({e})") from e
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise ValueError(f"{key}: entry {entry['name']!r}: {target} is not an AgentLoopBase subclass")
        loops[str(entry["name"])] = (cls, kwargs)
    return loops


def loop_table(configs: dict[str, tuple[type[AgentLoopBase], dict[str, Any]]] | None = None,
               ) -> dict[str, tuple[type[AgentLoopBase], dict[str, Any]]]:
    """Every loop by name -> (class, kwargs): the registered ones (built-ins imported), then ``configs``'."""
    for target in BUILTIN_LOOPS.values():  # registers them
        importlib.import_module(target.partition(":")[0])
    return {name: (cls, {}) for name, cls in AGENT_LOOPS.items()} | dict(configs or {})


def default_loop(agent: Any, multi_turn: bool) -> str:
    """The loop of rows without ``agent_name``: ``agent.default_agent_loop``, else ``tool_agent`` when
    ``rollout.multi_turn.enable`` (rlpad's tool loop, as before the key existed), else ``single_turn_agent``."""
    return agent.default_agent_loop or ("tool_agent" if multi_turn else "single_turn_agent")


def loop_names(names: Sequence[str | None], agent: Any, multi_turn: bool) -> list[str]:
    """Each row's loop: its ``agent_name`` (verl's data column; None: the row has none), else :func:`default_loop`."""
    default = default_loop(agent, multi_turn)
    return [name or default for name in names]


def agent_loop_problems(agent: Any, multi_turn: bool) -> list[str]:
    """What is wrong with ``rollout.agent`` (:class:`rlpad.config.schema.AgentConfig`), one line per problem:
    an unreadable config YAML, a ``_target_`` that does not import or is no AgentLoopBase, an unknown default."""
    configs = {}
    if agent.agent_loop_config_path:
        try:
            configs = load_agent_loop_config(agent.agent_loop_config_path)
        except ValueError as e:
            return [str(e)]
    name, names = default_loop(agent, multi_turn), loop_table(configs)
    if name not in names:
        return [f"{KEY}.default_agent_loop={name!r} is not an agent loop; choose one of {', '.join(sorted(names))} "
                f"(or add it to {KEY}.agent_loop_config_path)"]
    if name == "tool_agent" and not multi_turn:
        return [f"{KEY}.default_agent_loop=tool_agent needs actor_rollout_ref.rollout.multi_turn.enable=true (its tools)"]
    return []


async def run_agent_loops(client: EngineClient, context: AgentContext, sampling: Any, rows: Sequence[dict[str, Any]],
                          *, default: str = "single_turn_agent", vocab_size: int,
                          configs: dict[str, tuple[type[AgentLoopBase], dict[str, Any]]] | None = None,
                          ) -> list[AgentLoopOutput]:
    """One trajectory per row, all in flight at once (batched per round under a BatchingClient), each by the
    loop its ``agent_name`` names (else ``default``); every output checked (:func:`check_output`)."""
    table = loop_table(configs)
    names = [row.get("agent_name") or default for row in rows]
    for i, name in enumerate(names):
        if name not in table:
            raise ValueError(f"row {i}: agent_name {name!r} is not a registered agent loop ({', '.join(sorted(table))})")
    step = replace(sampling, n=1)
    coros = [table[name][0](client, context, **table[name][1]).run(step, **row) for name, row in zip(names, rows)]
    if isinstance(client, BatchingClient):
        outs = await client.gather(coros)
    else:
        outs = await asyncio.gather(*coros)
    for i, (name, out) in enumerate(zip(names, outs)):
        check_output(out, name, i, vocab_size, sampling.max_tokens)
    return outs
