"""Stateful tools (verl's ``rollout.multi_turn.tool_config_path``): tool classes with per-trajectory state.

The YAML holds ``tools: [{class_name: pkg.module.Class (or pkg.module:Class), config: {...}, tool_schema:
{type: function, function: {name, description, parameters}}}]``; the tool's name is its schema's. A class
has verl's ``BaseTool`` shape, duck-typed (each method ``async def`` or plain):

- ``Class(config=dict, tool_schema=dict)``, once per rollout;
- ``create(instance_id, **create_kwargs) -> instance_id or (instance_id, response)``, once per trajectory;
- ``execute(instance_id, parameters: dict, **execute_kwargs) -> (response, step_reward, metrics)``, per call;
- ``calc_reward(instance_id, **calc_reward_kwargs) -> float``, when the trajectory ends;
- ``release(instance_id, **release_kwargs)``, always (after an error, a timeout or a failed turn too).

``create_kwargs`` etc. are ``extra_info["tools_kwargs"][tool name]``'s (verl's data layout). A response is a
str or has a ``text`` str (verl's ToolResponse). The tool loop (:class:`rlpad.rollout.agent.ToolAgentLoop`)
opens a :class:`Session` per trajectory and runs the calls naming these tools through it, the others through
the function tools. A call that raises or runs past ``multi_turn.tool_timeout`` is an error observation
(:data:`rlpad.rollout.tools.ERROR_TEXTS`), its output checked as a function tool's (length, text). The
tools run in the rollout's process (their state lives there): a plain method that hangs holds a thread.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlpad.config.schema import MultiTurnConfig
from rlpad.functions import import_class_having, read_yaml
from rlpad.rollout.function_tools import tool_specs
from rlpad.rollout.tools import KEY, ToolCall, ToolResult, ToolSet, load_tools, tool_schemas

__all__ = ["METHODS", "TOOL_REWARD_SCORES", "TOOL_STEP_REWARDS", "Session", "StatefulSpec", "StatefulTools",
           "advertised_schemas", "load_tool_config", "stateful_tool_problems"]

METHODS = ("create", "execute", "calc_reward", "release")  # verl's BaseTool methods a class must have
# the rollout batch's columns of the tools' rewards (verl's names): each row's {tool name: calc_reward} and its
# calls' step rewards (execute's), what the reward function reads (rlpad.rewards.stage._tool_reward_rule)
TOOL_REWARD_SCORES, TOOL_STEP_REWARDS = "reward_scores", "tool_rewards"
PATH_KEY = f"{KEY}.tool_config_path"
_ids = itertools.count()


@dataclass(frozen=True)
class StatefulSpec:
    """One YAML entry: the tool's ``name`` (its schema's), ``cls``, its ``config`` and OpenAI ``schema``."""

    name: str
    cls: type
    config: dict[str, Any]
    schema: dict[str, Any]


def load_tool_config(path: str) -> list[StatefulSpec]:
    """``tool_config_path``'s tools; ValueError in one line naming the key, the entry and the problem."""
    doc = read_yaml(path, PATH_KEY, {})
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{PATH_KEY}: {path} must hold tools: [{{class_name, config, tool_schema}}, ...]")
    specs: list[StatefulSpec] = []
    for i, entry in enumerate(entries):
        where = f"{PATH_KEY}: tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(f"{where} needs class_name")
        schema = entry.get("tool_schema")
        name = schema.get("function", {}).get("name") if isinstance(schema, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where} needs tool_schema: {{type: function, function: {{name, ...}}}}")
        target = str(entry["class_name"])
        cls = import_class_having(target, METHODS, "a tool class (verl's BaseTool shape)", f"{where} ({name})")
        if name in {s.name for s in specs}:
            raise ValueError(f"{where}: two tools named {name!r}")
        specs.append(StatefulSpec(name, cls, dict(entry.get("config") or {}), schema))
    return specs


def stateful_tool_problems(mt: Any) -> list[str]:
    """What is wrong with ``tool_config_path`` (one line per problem): unreadable, a class that does not import
    or lacks a method, a name a function tool has too."""
    if not mt.tool_config_path:
        return []
    if not mt.enable:
        return [f"{PATH_KEY} is set but {KEY}.enable=false: the tools would never run"]
    try:
        specs = load_tool_config(mt.tool_config_path)
    except ValueError as e:
        return [str(e)]
    try:
        functions = load_tools(tool_specs(mt))
    except ValueError as e:
        return [str(e)]
    return [f"{PATH_KEY}: tool {s.name!r} is also a function tool ({KEY}.tools or function_tool_path)"
            for s in specs if s.name in functions]


def advertised_schemas(mt: MultiTurnConfig) -> list[dict[str, Any]] | None:
    """The schemas prompts advertise (``advertise_tools``): the function tools', then the stateful ones'."""
    if not (mt.enable and mt.advertise_tools):
        return None
    stateful = [s.schema for s in load_tool_config(mt.tool_config_path)] if mt.tool_config_path else []
    return tool_schemas(tool_specs(mt)) + stateful


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` awaited when async, in a thread when plain (so a timeout can fire)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    out = await asyncio.to_thread(fn, *args, **kwargs)
    return await out if inspect.isawaitable(out) else out


def _text(response: Any) -> Any:
    return response.text if not isinstance(response, str) and isinstance(getattr(response, "text", None), str) else response


class StatefulTools:
    """The rollout's tool objects (one per YAML entry); :meth:`open` a :class:`Session` per trajectory.
    ``toolset`` checks outputs and words errors as the function tools' (:meth:`ToolSet.result`)."""

    def __init__(self, specs: Sequence[StatefulSpec], toolset: ToolSet):
        self.toolset, self.timeout = toolset, toolset.timeout
        self.tools = {s.name: s.cls(config=s.config, tool_schema=s.schema) for s in specs}
        self.schemas = {s.name: s.schema for s in specs}

    async def open(self, extra_info: Any, trajectory: int | None = None) -> Session:
        """Create one instance of every tool with ``extra_info["tools_kwargs"][name]["create_kwargs"]``; its
        instance id ``<name>-<trajectory as 16 hex digits>`` (``trajectory``: the trajectory's first-turn seed,
        the same in any process, so a resumed run's tools see the ids, and a tool seeding itself from its id
        the draws, of the uninterrupted run), ``<name>-<counter>-u`` without one (an unseeded rollout)."""
        kwargs = (extra_info or {}).get("tools_kwargs") or {} if isinstance(extra_info, dict) else {}
        session = Session(self, {name: dict(kwargs.get(name) or {}) for name in self.tools},
                          f"{trajectory:016x}" if trajectory is not None else f"{next(_ids)}-u")
        await asyncio.gather(*(session.create(name) for name in self.tools))
        return session


@dataclass
class Session:
    """One trajectory's tool instances: ``key`` (its part of the instance ids), ``ids`` (tool name -> instance
    id; a tool whose create failed has none: its calls get an error observation), ``step_rewards`` and ``metrics`` of each call, ``errors``: what failed
    in create, calc_reward or release (for the log)."""

    tools: StatefulTools
    kwargs: dict[str, dict[str, Any]]
    key: str  # the trajectory's part of its instance ids (StatefulTools.open)
    ids: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # name -> why its create failed (its calls' reason)
    step_rewards: list[float] = field(default_factory=list)
    metrics: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def names(self) -> set[str]:
        return set(self.tools.tools)

    async def create(self, name: str) -> None:
        tool, wanted = self.tools.tools[name], f"{name}-{self.key}"
        try:
            out = await asyncio.wait_for(_call(tool.create, wanted, **self.kwargs[name].get("create_kwargs", {})),
                                         self.tools.timeout)
            self.ids[name] = out[0] if isinstance(out, tuple) else (out if isinstance(out, str) else wanted)
        except Exception as e:  # a tool's own exception types
            self.failed[name] = f"{type(e).__name__}: {e} (in create)"
            self.errors.append(f"{name} raised {self.failed[name]}")

    async def run(self, call: ToolCall) -> ToolResult:
        """One call (``call.name`` one of these tools): its checked observation, or an error observation."""
        name, tool, check = call.name, self.tools.tools[call.name], self.tools.toolset.result
        if name in self.failed:
            return check(name, "raised", self.failed[name])
        params = call.arguments
        if isinstance(params, str):  # bracket format: the text is the first parameter
            props = list(self.tools.schemas[name]["function"].get("parameters", {}).get("properties", {})) or ["text"]
            params = {props[0]: params}
        try:
            out = await asyncio.wait_for(_call(tool.execute, self.ids[name], params,
                                               **self.kwargs[name].get("execute_kwargs", {})), self.tools.timeout)
        except asyncio.TimeoutError:
            return check(name, "timeout", self.tools.timeout)
        except Exception as e:
            return check(name, "raised", f"{type(e).__name__}: {e}")
        response, reward, metrics = out if isinstance(out, tuple) and len(out) == 3 else (out, 0.0, None)
        self.step_rewards.append(float(reward or 0.0))
        self.metrics.append(metrics)
        text = _text(response)
        return check(name, "ok", text) if isinstance(text, str) else check(name, "not_text", type(text).__name__)

    async def close(self) -> dict[str, float]:
        """Each created tool's ``calc_reward`` (left out where it raised), then ``release`` of every instance
        (failures: in :attr:`errors`)."""
        rewards: dict[str, float] = {}
        for name, instance in self.ids.items():
            tool, kw = self.tools.tools[name], self.kwargs[name]
            try:
                rewards[name] = float(await asyncio.wait_for(
                    _call(tool.calc_reward, instance, **kw.get("calc_reward_kwargs", {})), self.tools.timeout))
            except Exception as e:
                self.errors.append(f"{name} raised {type(e).__name__}: {e} (in calc_reward)")
            finally:
                try:
                    await asyncio.wait_for(_call(tool.release, instance, **kw.get("release_kwargs", {})),
                                           self.tools.timeout)
                except Exception as e:
                    self.errors.append(f"{name} raised {type(e).__name__}: {e} (in release)")
        return rewards
