"""Environments: gym-like episodes the ``env_agent`` loop runs, each call in a worker process.

An environment is a class with ``reset(row) -> messages`` (the messages after the row's prompt before the
first turn, usually ``[]``) and ``step(text) -> (messages, reward, done, info)`` (``text``: the assistant
turn decoded, without its end-of-turn token; ``messages``: what the environment answers, chat messages
``{"role", "content"}``; ``reward``: this turn's, a float). It is chosen by name: a registered one
(:data:`ENVIRONMENTS`, :func:`register_env`) or ``pkg.module:Class``; a row's ``extra_info["env_name"]``,
else ``actor_rollout_ref.rollout.agent.environment``. ``reset`` gets the row's ``extra_info`` and
``raw_prompt``, and ``step`` its text; instances must pickle (the state travels with each call).

Every call runs in a worker process of a :class:`rlpad.rollout.tool_pool.ToolPool` (the function tools'
pool: a real time limit, a killed or crashing process replaced, nothing left after :meth:`EnvRunner.close`):
the environment's pickled state goes with the call and comes back with its answer, so any worker can take
an episode's next step and a worker killed at ``env_timeout`` loses no other episode. A call that raises,
hangs past ``env_timeout``, kills its process or returns a malformed answer ends its trajectory
(:class:`EnvResult` ``error``: the reason, logged).
"""

from __future__ import annotations

import base64
import importlib
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENVIRONMENTS", "EnvResult", "EnvRunner", "Environment", "env_call", "environment_problems",
           "observation_renderer", "register_env", "resolve_env"]

KEY = "actor_rollout_ref.rollout.agent"
# name -> "pkg.module:Class": the built-in environments (imported in the worker that runs them)
ENVIRONMENTS: dict[str, str] = {"guess_number": "rlpad.embedded.toy_guess:GuessNumberEnv"}
WORKER_FN = "rlpad.rollout.environments:env_call"  # what the tool pool's workers run


class Environment:
    """The interface (duck-typed: any class with these two methods serves)."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The messages after the prompt before the first turn (``row``: ``extra_info``, ``raw_prompt``)."""
        return []

    def step(self, text: str) -> tuple[list[dict[str, str]], float, bool, dict[str, Any]]:
        """The assistant turn's ``text`` -> (the environment's messages, this turn's reward, done, info)."""
        raise NotImplementedError


def register_env(name: str, target: str) -> None:
    """Make ``name`` choose the environment class ``target`` (``pkg.module:Class``)."""
    ENVIRONMENTS[name] = target


def resolve_env(name: str) -> str:
    """``pkg.module:Class`` of a registered name or of a target given as such; ValueError naming the key."""
    target = ENVIRONMENTS.get(name, name)
    if ":" not in target:
        raise ValueError(f"{KEY}.environment={name!r} is neither a registered environment "
                         f"({', '.join(sorted(ENVIRONMENTS))}) nor pkg.module:Class")
    return target


def env_class(target: str) -> type:
    """The class ``pkg.module:Class`` names (ValueError naming the key when it does not import)."""
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{KEY}.environment: cannot import {target!r} ({e})") from e
    if not (isinstance(cls, type) and callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ValueError(f"{KEY}.environment: {target} is not a class with reset(row) and step(text)")
    return cls


def environment_problems(agent: Any, interaction_config_path: str | None = None) -> list[str]:
    """What is wrong with ``rollout.agent``'s environment keys and ``multi_turn.interaction_config_path``
    (rlpad.rollout.interactions), one line per problem naming the key (the classes imported, as the workers
    will)."""
    problems = []
    if interaction_config_path:
        from rlpad.rollout.interactions import load_interaction_config

        try:
            load_interaction_config(interaction_config_path)
        except ValueError as e:
            problems.append(str(e))
    if not agent.env_timeout > 0:
        problems.append(f"{KEY}.env_timeout={agent.env_timeout} must be > 0")
    if agent.env_workers < 1:
        problems.append(f"{KEY}.env_workers={agent.env_workers} must be >= 1")
    if agent.environment is not None:
        try:
            env_class(resolve_env(agent.environment))
        except ValueError as e:
            problems.append(str(e))
    if agent.default_agent_loop == "env_agent" and agent.environment is None and not interaction_config_path:
        problems.append(f"{KEY}.default_agent_loop=env_agent needs {KEY}.environment (rows may name theirs in "
                        "extra_info.env_name; set the key to the default) or "
                        "actor_rollout_ref.rollout.multi_turn.interaction_config_path")
    return problems


def _pack(value: Any) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def _unpack(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))


def env_call(op: str, target: str, state: str | None, payload: str) -> str:
    """One environment call in a tool worker: ``op`` "reset" (a new ``target`` instance, ``payload`` the row)
    or "step" (``state`` the pickled instance, ``payload`` the turn's text); -> the pickled (instance, answer)."""
    if op == "reset":
        env = env_class(target)()
        return _pack((env, env.reset(_unpack(payload))))
    env = _unpack(state)
    return _pack((env, env.step(payload)))


@dataclass
class EnvResult:
    """One call's outcome: the new ``state`` (pickled instance) and the answer, or ``error`` (the reason)."""

    state: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _answer(op: str, status: str, payload: Any, timeout: float) -> EnvResult:
    """The pool's ``(status, payload)`` of one call as an :class:`EnvResult` (a malformed answer an error)."""
    if status == "timeout":
        return EnvResult(error=f"environment {op} timed out after {timeout:g} s")
    if status == "crashed":
        return EnvResult(error=f"environment {op} killed its process (exit code {payload})")
    if status != "ok":
        return EnvResult(error=f"environment {op} failed: {payload}")
    state, answer = _unpack(payload)
    state = _pack(state)
    if op == "reset":
        return _checked(op, state, (answer, 0.0, False, {}))
    return _checked(op, state, answer)


def _checked(op: str, state: str, answer: Any) -> EnvResult:
    try:
        messages, reward, done, info = answer
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward {reward}")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                     and isinstance(m.get("role"), str) for m in messages):
            raise ValueError(f"messages {messages!r:.80} are not a list of {{role, content}} dicts")
    except (TypeError, ValueError) as e:
        return EnvResult(error=f"environment {op} returned a malformed answer ({e})")
    return EnvResult(state, messages, reward, bool(done), dict(info or {}))


class EnvRunner:
    """The environments' worker processes (``workers``, ``timeout`` seconds a call); :meth:`run` takes a batch
    of calls ``(op, target, state, payload)`` (every trajectory's of a round) -> an :class:`EnvResult` each."""

    def __init__(self, *, timeout: float, workers: int, concurrency: int = 256):
        from rlpad.rollout.tool_pool import ToolPool

        self.timeout = float(timeout)
        self.pool = ToolPool([WORKER_FN], timeout=timeout, workers=workers, concurrency=concurrency,
                             max_chars=1 << 26)

    def run(self, calls: Sequence[tuple[str, str, str | None, Any]]) -> list[EnvResult]:
        jobs = [("env_call", {"op": op, "target": target, "state": state,
                              "payload": _pack(payload) if op == "reset" else payload})
                for op, target, state, payload in calls]
        return [_answer(op, status, out, self.timeout)
                for (op, *_), (status, out) in zip(calls, self.pool.run(jobs))]

    def close(self) -> None:
        self.pool.close()


def observation_renderer(tokenizer: Any) -> Callable[[list[dict[str, str]], bool], list[int]]:
    """``(messages, after_eos) -> tokens`` appended after an assistant turn: the text by which the chat
    template's rendering of ``[user, assistant, *messages]`` (with the generation prompt) extends that of
    ``[user]`` and the assistant's content, less the end-of-turn token's text at its start when the turn
    ended with that token (``after_eos``: the policy generated it). Before the first turn (``reset``'s
    messages) the assistant's content is empty."""
    user, content = {"role": "user", "content": "?"}, "?"
    head = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True) + content
    eos_text = tokenizer.eos_token or ""

    def render(messages: list[dict[str, str]], after_eos: bool) -> list[int]:
        full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": content}, *messages],
                                             tokenize=False, add_generation_prompt=True)
        if not full.startswith(head):
            raise ValueError("the tokenizer's chat template does not extend a conversation's rendering when a "
                             f"message is added (expected a prefix {head!r}, got {full[:len(head) + 40]!r})")
        text = full[len(head):]
        if after_eos and eos_text and text.startswith(eos_text):
            text = text[len(eos_text):]
        return list(tokenizer.encode(text, add_special_tokens=False))

    return render
