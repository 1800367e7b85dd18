"""Tools of a multi-turn rollout: the tool-call formats, loading ``pkg.module:function`` tools and their
schemas, and running a turn's calls so that nothing a tool does (raise, hang, return too much or not a
string) stops the run.

A tool is a plain function ``fn(**arguments) -> str`` (hermes format) or ``fn(text) -> str`` (bracket
format), or an ``async def`` one; its name is the function's ``__name__``; its schema (what the chat
template advertises, :func:`tool_schema`) is ``fn.json_schema`` if set, else read from its signature
and docstring. :meth:`ToolSet.run` runs calls in tool-worker processes (:class:`rlpad.rollout.tool_pool.
ToolPool`) and returns a :class:`ToolResult` per call: the tool's text, or a short fixed error text
(:data:`ERROR_TEXTS`) the model sees, with the full reason for the log.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlpad.functions import article, load_function
from rlpad.rollout.function_tools import tool_specs
from rlpad.rollout.tool_pool import ToolPool

__all__ = ["ERROR_TEXTS", "FORMATS", "ToolCall", "ToolFormat", "ToolResult", "ToolSet", "load_tools", "multi_turn_problems", "tool_schema",
           "tool_schemas"]

KEY = "actor_rollout_ref.rollout.multi_turn"


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's ``name`` and its ``arguments`` (a dict for hermes, a string for bracket),
    or ``problem`` when the call could not be parsed."""

    name: str
    arguments: Any = None
    problem: str | None = None


def _parse_hermes(body: str) -> ToolCall:
    try:
        call = json.loads(body)
        name, arguments = call["name"], call.get("arguments", {})
        if not isinstance(arguments, dict):
            raise TypeError("arguments is not an object")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return ToolCall("", problem=f"bad tool call ({type(e).__name__}: {str(e)[:80]})")
    return ToolCall(str(name), arguments)


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call syntax: ``pattern`` matches one whole call (ending with ``end``), ``parse`` reads a match;
    ``call_ends_turn``: the model writes no end-of-turn token after its call, so the close of a call ends
    the turn (one call per turn; :func:`rlpad.rollout.agent.turn_stops`)."""

    end: str
    pattern: re.Pattern[str]
    parse: Callable[[re.Match[str]], ToolCall]
    call_ends_turn: bool = False

    def find(self, text: str, limit: int) -> tuple[list[ToolCall], int, int]:
        """``(calls, end, dropped)``: the turn's first run of calls (the first call and those after it
        separated by whitespace only: parallel calls), at most ``limit`` of them; ``end`` is the
        character after the last one kept, ``dropped`` the calls of the run beyond ``limit``."""
        calls: list[ToolCall] = []
        end = last = dropped = 0  # last: the end of the run's last call, kept or not
        for m in self.pattern.finditer(text):
            if calls and text[last: m.start()].strip():
                break
            if len(calls) < limit:
                calls.append(self.parse(m))
                end = m.end()
            else:
                dropped += 1
            last = m.end()
        return calls, end, dropped


# rollout.multi_turn.format -> its syntax. hermes: <tool_call>{"name", "arguments"}</tool_call> (Qwen2.5,
# Qwen3, NousResearch; verl's default; the model ends its turn with EOS after its calls); bracket:
# [name(text)], which a character-level toy model can write (and then goes on writing: the close ends the turn).
FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("</tool_call>", re.compile(r"<tool_call>(.*?)</tool_call>", re.S),
                         lambda m: _parse_hermes(m.group(1))),
    "bracket": ToolFormat(")]", re.compile(r"\[(\w+)\((.*?)\)\]", re.S), lambda m: ToolCall(m.group(1), m.group(2)),
                          call_ends_turn=True),
}

# The observation of a failed call: short and fixed (cut to max_tool_response_length tokens); the full
# reason goes to the log (ToolResult.reason).
ERROR_TEXTS = {
    "bad_call": "error: bad call",
    "unknown": "error: unknown tool",
    "raised": "error: tool failed",
    "timeout": "error: timed out",
    "too_long": "error: output too long",
    "not_text": "error: not text",
    "crashed": "error: tool crashed",
}


@dataclass(frozen=True)
class ToolResult:
    """One call's ``observation`` (what the model sees) and, for a failed call, ``reason`` (the log's)."""

    observation: str
    reason: str | None = None


def tool_schema(fn: Callable[..., Any], spec: str = "") -> dict[str, Any]:
    """The OpenAI-style schema ``{"type": "function", "function": {name, description, parameters}}``
    that chat templates render: ``fn.json_schema`` (that dict, or its ``function`` part) if given, else
    transformers' ``get_json_schema`` (type hints and a Google-style docstring with ``Args:``)."""
    explicit = getattr(fn, "json_schema", None)
    if explicit is not None:
        if not isinstance(explicit, dict):
            raise ValueError(f"{KEY}.tools={spec!r}: json_schema is {article(type(explicit).__name__)}, not a dict")
        schema = explicit if "function" in explicit else {"type": "function", "function": explicit}
        if schema["function"].get("name") != fn.__name__:
            raise ValueError(f"{KEY}.tools={spec!r}: json_schema names {schema['function'].get('name')!r}, "
                             f"the function is {fn.__name__!r}")
        return schema
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its own TypeError subclasses
        raise ValueError(f"{KEY}.tools={spec!r}: no schema ({e}); give the function type hints and a docstring "
                         "with an Args: section, or set fn.json_schema") from None


def load_tools(specs: Sequence[str]) -> dict[str, Callable[..., Any]]:
    """``pkg.module:function`` names -> ``{function name: function}``; ValueError on a bad or repeated name."""
    tools: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        fn = load_function(spec, f"{KEY}.tools")
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if name in tools:
            raise ValueError(f"{KEY}.tools: two tools named {name!r}")
        tools[name] = fn
    return tools


def tool_schemas(specs: Sequence[str]) -> list[dict[str, Any]]:
    """The schema of each tool named in ``specs`` (:func:`tool_schema`), in order."""
    return [tool_schema(fn, spec) for spec, fn in zip(specs, load_tools(specs).values())]


def multi_turn_problems(mt: Any) -> list[str]:
    """What is wrong with a ``rollout.multi_turn`` section (:class:`rlpad.config.schema.MultiTurnConfig`), one
    line per problem naming its key; the tools are imported (and their schemas read) when enabled."""
    problems: list[str] = []
    if mt.max_user_turns is not None and (isinstance(mt.max_user_turns, bool) or mt.max_user_turns < 1):
        problems.append(f"{KEY}.max_user_turns={mt.max_user_turns} must be >= 1 or null (no cap)")
    if not mt.enable:
        if mt.function_tool_path:
            problems.append(f"{KEY}.function_tool_path is set but {KEY}.enable=false: the tools would never run")
        if mt.tools:
            problems.append(f"{KEY}.tools={list(mt.tools)} is set but {KEY}.enable=false: the tools would never run; "
                            f"set {KEY}.enable=true or remove them")
        return problems
    if mt.format not in FORMATS:
        problems.append(f"{KEY}.format={mt.format!r} is not valid; choose one of {', '.join(FORMATS)}")
    for key, value in (("max_assistant_turns", mt.max_assistant_turns), ("max_tool_response_length",
                       mt.max_tool_response_length), ("max_parallel_calls", mt.max_parallel_calls),
                       ("tool_workers", mt.tool_workers), ("max_concurrent_tool_calls", mt.max_concurrent_tool_calls)):
        if value < 1:
            problems.append(f"{KEY}.{key}={value} must be >= 1")
    if not mt.tool_timeout > 0:
        problems.append(f"{KEY}.tool_timeout={mt.tool_timeout} must be > 0 (seconds)")
    if not mt.tools and not mt.tool_config_path and not mt.function_tool_path:
        problems.append(f"{KEY}.enable=true with no {KEY}.tools: every call would fail; list the tool functions "
                        f"('pkg.module:function'), a file of them ({KEY}.function_tool_path) or the tool classes "
                        f"({KEY}.tool_config_path)")
        return problems
    try:
        specs = tool_specs(mt)
        tools = load_tools(specs)
        if mt.advertise_tools:
            tool_schemas(specs)
    except ValueError as e:
        return problems + [str(e)]
    if mt.format == "bracket":  # a bracket call passes one string
        for name, fn in tools.items():
            try:
                inspect.signature(fn).bind("text")
            except TypeError as e:
                problems.append(f"{KEY}.tools: {name} cannot be called with one argument, as the bracket format "
                                f"calls it ({e})")
            except ValueError:  # no signature to read (a builtin): it is called as is
                pass
    return problems


class ToolSet:
    """The tools of a rollout (see the module docstring): ``specs`` their names, ``fmt`` the call syntax.

    ``count_tokens(text)`` is the length of a tool message in tokens, checked against ``max_tokens``;
    outputs longer than ``max_tokens * max_token_chars`` characters are rejected without tokenising
    (``max_token_chars``: the longest token's length in characters). ``workers`` processes run up to
    ``concurrency`` calls at once, each for at most ``timeout`` seconds.
    """

    def __init__(self, specs: Sequence[str], fmt: str, timeout: float, max_tokens: int,
                 count_tokens: Callable[[str], int], *, max_token_chars: int = 64, workers: int = 2,
                 concurrency: int = 256):
        if fmt not in FORMATS:
            raise ValueError(f"{KEY}.format={fmt!r}; choose one of {sorted(FORMATS)}")
        if not timeout > 0:
            raise ValueError(f"{KEY}.tool_timeout must be > 0, got {timeout}")
        self.names = sorted(load_tools(specs))
        self.format, self.timeout, self.max_tokens, self.count_tokens = FORMATS[fmt], timeout, max_tokens, count_tokens
        self.pool = ToolPool(specs, timeout=timeout, workers=workers, concurrency=concurrency,
                             max_chars=max_tokens * max(1, max_token_chars))

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently: a :class:`ToolResult` per call, in order."""
        results: list[ToolResult | None] = [None] * len(calls)
        jobs, where = [], []
        for i, call in enumerate(calls):
            if call.problem is not None:
                results[i] = ToolResult(ERROR_TEXTS["bad_call"], call.problem)
            elif call.name not in self.names:
                results[i] = ToolResult(ERROR_TEXTS["unknown"], f"unknown tool {call.name!r} (tools: "
                                                                f"{', '.join(self.names)})")
            else:
                jobs.append((call.name, call.arguments))
                where.append(i)
        for i, (status, payload) in zip(where, self.pool.run(jobs) if jobs else []):
            results[i] = self._result(calls[i].name, status, payload)
        return [r if r.reason is None else ToolResult(self._fit(r.observation), r.reason) for r in results]

    def result(self, name: str, status: str, payload: Any) -> ToolResult:
        """What a call of tool ``name`` that ended with ``status`` (ok: ``payload`` its text; raised, timeout,
        not_text, too_long: the detail) becomes: its text when it fits, else the error observation (the
        stateful tools' calls, rlpad.rollout.stateful_tools, end here as the function tools' do)."""
        r = self._result(name, status, payload)
        return r if r.reason is None else ToolResult(self._fit(r.observation), r.reason)

    def _fit(self, text: str) -> str:
        """An error text cut to ``max_tokens`` tokens (a tool message must fit like any other)."""
        while text and self.count_tokens(text) > self.max_tokens:
            text = text[:-1]
        return text

    def _result(self, name: str, status: str, payload: Any) -> ToolResult:
        if status == "ok":
            n = self.count_tokens(payload)
            if n <= self.max_tokens:
                return ToolResult(payload)
            status, payload = "too_long", f"{n} tokens"
        if status == "too_long" and isinstance(payload, int):
            payload = f"{payload} characters"
        elif status == "timeout":
            payload = f"{payload:g}"
        reason = {"raised": "raised {}", "timeout": "timed out after {} s",
                  "too_long": f"returned {{}}, over max_tool_response_length={self.max_tokens} tokens",
                  "not_text": "returned {}, not a str", "crashed": "killed its process (exit code {})"}[status]
        return ToolResult(ERROR_TEXTS[status], f"{name} {reason.format(payload)}")

    def close(self) -> None:
        """Stop the tool processes."""
        self.pool.close()
