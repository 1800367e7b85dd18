"""Tools of a multi-turn rollout: the tool-call formats, loading ``pkg.module:function`` tools, and
calling one so that nothing it does (raise, hang, return too much or not a string) stops the run.

A tool is a plain function ``fn(**arguments) -> str`` (hermes format) or ``fn(text) -> str``
(bracket format); its name is the function's ``__name__``. :meth:`ToolSet.call` returns
``(observation, error)``: the tool's string, or an error observation the model sees (``error`` True).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlpad.rewards import load_function

__all__ = ["FORMATS", "ToolCall", "ToolFormat", "ToolSet", "load_tools"]


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's ``name`` and its ``arguments`` (a dict for hermes, a string for bracket),
    or ``problem`` when the call could not be parsed."""

    name: str
    arguments: Any = None
    problem: str | None = None


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call syntax: ``end`` closes a call (generation of a turn stops after it); ``parse``
    reads the last call of a turn's text."""

    end: str
    parse: Callable[[str], ToolCall | None]


def _parse_hermes(text: str) -> ToolCall | None:
    found = re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.S)
    if not found:
        return None
    try:
        call = json.loads(found[-1])
        name, arguments = call["name"], call.get("arguments", {})
        if not isinstance(arguments, dict):
            raise TypeError("arguments is not an object")
    except (ValueError, KeyError, TypeError) as e:
        return ToolCall("", problem=f"bad tool call ({type(e).__name__})")
    return ToolCall(str(name), arguments)


def _parse_bracket(text: str) -> ToolCall | None:
    found = re.findall(r"\[(\w+)\((.*?)\)\]", text, flags=re.S)
    return ToolCall(found[-1][0], found[-1][1]) if found else None


# rollout.multi_turn.format -> its syntax. hermes: Qwen / NousResearch's <tool_call>{"name", "arguments"}
# </tool_call> (verl's default); bracket: [name(text)], which a character-level toy model can write.
FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("</tool_call>", _parse_hermes),
    "bracket": ToolFormat(")]", _parse_bracket),
}


def load_tools(specs: Sequence[str]) -> dict[str, Callable[..., Any]]:
    """``pkg.module:function`` names -> ``{function name: function}``; ValueError on a bad or repeated name."""
    tools: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        fn = load_function(spec, "actor_rollout_ref.rollout.multi_turn.tools")
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if name in tools:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.tools: two tools named {name!r}")
        tools[name] = fn
    return tools


class ToolSet:
    """The tools of a rollout, called under a time limit, their output checked (see the module docstring).

    ``count_tokens(text)``: the length of a tool message in tokens, checked against ``max_tokens``.
    """

    def __init__(self, tools: dict[str, Callable[..., Any]], fmt: str, timeout: float, max_tokens: int,
                 count_tokens: Callable[[str], int]):
        if fmt not in FORMATS:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={fmt!r}; choose one of {sorted(FORMATS)}")
        if not timeout > 0:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.tool_timeout must be > 0, got {timeout}")
        self.tools, self.format, self.timeout, self.max_tokens = tools, FORMATS[fmt], timeout, max_tokens
        self.count_tokens = count_tokens

    def call(self, call: ToolCall) -> tuple[str, bool]:
        """Run ``call``: ``(its string, False)``, or ``(an error observation, True)``."""
        if call.problem is not None:
            return f"error: {call.problem}", True
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name}, tools: {' '.join(sorted(self.tools))}", True
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = fn(**call.arguments) if isinstance(call.arguments, dict) else fn(call.arguments)
            except BaseException as e:  # noqa: BLE001 - a tool's failure is the model's observation
                box["err"] = e

        # A daemon thread: a hung tool is left behind (Python cannot stop a thread), the rollout goes on.
        worker = threading.Thread(target=run, daemon=True, name=f"rlpad-tool-{call.name}")
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            return f"error: {call.name} timed out after {self.timeout:g} s", True
        if "err" in box:
            e = box["err"]
            return f"error: {call.name} raised {type(e).__name__}: {str(e)[:80]}", True
        out = box["out"]
        if not isinstance(out, str):
            return f"error: {call.name} returned {type(out).__name__}, not a string", True
        n = self.count_tokens(out)
        if n > self.max_tokens:
            return f"error: {call.name} returned {n} tokens, over the limit of {self.max_tokens}", True
        return out, False
