"""verl's interactions (``rollout.multi_turn.interaction_config_path``) run as environments of the ``env_agent`` loop.

The YAML is verl's: ``interaction: [{name, class_name: pkg.module.Class (or pkg.module:Class), config: {...}}]``
(``name`` omitted: the class's name lower-cased, less an ``Interaction`` suffix, verl's rule). A row chooses
one by ``extra_info.interaction_kwargs.name`` (verl's data layout). A class has verl's ``BaseInteraction``
shape, duck-typed (each method ``async def`` or plain; a subclass of verl's own ``BaseInteraction`` serves
where verl is importable, rlpad never imports it):

- ``Class(config=dict)`` (the entry's ``config`` with ``name`` added), once per trajectory, in a worker;
- ``start_interaction(instance_id, **interaction_kwargs) -> instance_id``;
- ``generate_response(instance_id, messages, **interaction_kwargs) -> (should_terminate, response, score,
  extra)``: ``messages`` the conversation so far (the row's ``raw_prompt``, each assistant turn, each reply);
- ``finalize_interaction(instance_id)`` (optional) when it ends the episode (``should_terminate``).

:class:`InteractionEnv` adapts it to rlpad's environment interface (rlpad.rollout.environments): each
``generate_response`` is one environment step, its ``response`` the user message the model reads next, its
``score`` that turn's reward (on the turn's last token), ``should_terminate`` the end of the episode. Its
calls run in the environments' worker processes (the same time limit and containment); an episode cut by
``max_assistant_turns`` or the budget is dropped with its instance (not finalized).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any

from rlpad.functions import import_class, import_class_having, read_yaml

__all__ = ["InteractionEnv", "InteractionSpec", "interaction_notice", "load_interaction_config", "row_interaction"]

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
TARGET = "rlpad.rollout.interactions:InteractionEnv"  # the environment the env_agent loop runs for an interaction
METHODS = ("start_interaction", "generate_response")  # what a class must have (finalize_interaction: optional)


@dataclass(frozen=True)
class InteractionSpec:
    """One YAML entry: its ``name``, ``class_name`` and ``config`` (``name`` added, as verl passes it)."""

    name: str
    class_name: str
    config: dict[str, Any]


def load_interaction_config(path: str) -> dict[str, InteractionSpec]:
    """``interaction_config_path``'s interactions by name, each class imported and checked; ValueError in one
    line naming the key, the entry and the problem."""
    doc = read_yaml(path, KEY, {})
    entries = doc.get("interaction") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{KEY}: {path} must hold interaction: [{{name, class_name, config}}, ...]")
    specs: dict[str, InteractionSpec] = {}
    for i, entry in enumerate(entries):
        where = f"{KEY}: interaction[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{where} needs class_name: pkg.module.Class")
        target, config = entry["class_name"], entry.get("config") or {}
        simple = target.replace(":", ".").rpartition(".")[2]
        name = entry.get("name") or (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        where = f"{where} ({name})"
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config must be a mapping, got {type(config).__name__}")
        if name in specs:
            raise ValueError(f"{where}: two interactions named {name!r}")
        import_class_having(target, METHODS, "an interaction class (verl's BaseInteraction shape)", where)
        specs[name] = InteractionSpec(str(name), target, {**config, "name": str(name)})
    return specs


def row_interaction(extra_info: Any, specs: dict[str, InteractionSpec], row: int) -> InteractionSpec | None:
    """The interaction a row names (``extra_info.interaction_kwargs.name``), None when it has no
    ``interaction_kwargs``; ValueError naming the row when the name is missing or unknown."""
    kwargs = extra_info.get("interaction_kwargs") if isinstance(extra_info, dict) else None
    if kwargs is None:
        return None
    name = kwargs.get("name") if isinstance(kwargs, dict) else None
    if name not in specs:
        raise ValueError(f"row {row}: extra_info.interaction_kwargs.name={name!r} is none of {KEY}'s "
                         f"interactions ({', '.join(sorted(specs))})")
    return specs[name]


def _done(value: Any) -> Any:
    """``value``, awaited when it is awaitable (the worker's call of an async method)."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value
    return asyncio.run(wait())


class InteractionEnv:
    """An interaction as an environment (the module docstring); ``reset``'s row carries ``interaction`` (its
    :class:`InteractionSpec` fields) and ``seed`` (the trajectory's: its instance id ``<name>-<seed hex>``)."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        spec = row["interaction"]
        self.interaction = import_class(spec["class_name"])(config=dict(spec["config"]))
        self.kwargs = dict(row["extra_info"]["interaction_kwargs"])
        prompt = row.get("raw_prompt")
        self.messages = [dict(m) for m in prompt] if prompt is not None else []
        seed = row.get("seed")
        wanted = f"{spec['name']}-{seed:016x}" if seed is not None else None
        got = _done(self.interaction.start_interaction(wanted, **self.kwargs))
        self.instance_id = got if isinstance(got, str) else wanted
        return []

    def step(self, text: str) -> tuple[list[dict[str, str]], float, bool, dict[str, Any]]:
        self.messages.append({"role": "assistant", "content": text})
        terminate, response, score, extra = _done(
            self.interaction.generate_response(self.instance_id, [dict(m) for m in self.messages], **self.kwargs))
        reply = {"role": "user", "content": str(response)}
        self.messages.append(reply)
        if terminate and callable(getattr(self.interaction, "finalize_interaction", None)):
            _done(self.interaction.finalize_interaction(self.instance_id))
        return [reply], score, bool(terminate), dict(extra or {})


def interaction_notice(path: str | None, loops: set[str]) -> str | None:
    """The start-up warning when interactions are configured (``path``) but no data row runs the env_agent loop
    (``loops``: the rows' loops, :func:`rlpad.rollout.agent_loops.loop_names`): they would never run."""
    if not path or "env_agent" in loops:
        return None
    return (f"warning: {KEY}={path} is set but no data row runs the env_agent loop (the rows run "
            f"{', '.join(sorted(loops))}): its interactions never run; set "
            "actor_rollout_ref.rollout.agent.default_agent_loop=env_agent or the rows' agent_name")
