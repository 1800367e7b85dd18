"""The ``env_agent`` loop: one episode of an environment (rlpad.rollout.environments) per trajectory.

Per trajectory: ``reset(row)`` (its messages, if any, rendered after the prompt: mask 0), then up to
``multi_turn.max_assistant_turns`` turns: generate until EOS or the budget (the policy's tokens: mask 1, their
log-probs), ``step(text)`` -> (messages, reward, done, info); the turn's reward lands on its last generated
token (``turn_rewards``: (response index, reward) pairs, :func:`rlpad.rollout.agent.turn_scores`); unless
done, the last turn, or the budget is spent, the environment's messages are rendered
(:func:`rlpad.rollout.environments.observation_renderer`: mask 0, log-prob 0, cut at the budget) and the
next turn goes on, or, once ``multi_turn.max_user_turns`` replies are in (verl's cap), the trajectory ends. A failed environment call ends the trajectory (its reason in ``errors``). Turn seeds:
:func:`rlpad.rollout.seeds.sample_seed` of (step seed, prompt, sample, turn), the tool loop's rule.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from rlpad.rollout.agent_loops import AgentLoopBase, AgentLoopOutput, register
from rlpad.rollout.engine_client import BatchingClient
from rlpad.rollout.environments import EnvResult, EnvRunner, resolve_env
from rlpad.rollout.interactions import TARGET, InteractionSpec, row_interaction
from rlpad.rollout.seeds import sample_seed

__all__ = ["EnvAgentLoop", "EnvSetup"]


@dataclass
class EnvSetup:
    """What the env loop needs from the rollout (``AgentContext.env``): the worker processes, the renderer of
    the environment's messages, the default environment (``rollout.agent.environment``; a row's
    ``extra_info["env_name"]`` wins, then the interaction its ``extra_info["interaction_kwargs"]`` names)."""

    runner: EnvRunner
    render: Any  # observation_renderer(tokenizer)
    default: str | None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one pool call at a time outside a BatchingClient
    # rollout.multi_turn.interaction_config_path's interactions by name (rlpad.rollout.interactions)
    interactions: dict[str, InteractionSpec] = field(default_factory=dict)


def _row_env(row: dict[str, Any], setup: EnvSetup) -> tuple[str, dict[str, Any]]:
    """The row's environment (``pkg.module:Class``) and what its ``reset`` gets beside ``extra_info`` and
    ``raw_prompt``: ``extra_info.env_name``, else the interaction ``extra_info.interaction_kwargs.name`` names
    (with ``interaction_config_path``: its spec and the trajectory's ``seed``), else the default."""
    extra = row.get("extra_info")
    name = extra.get("env_name") if isinstance(extra, dict) else None
    spec = None if name or not setup.interactions else row_interaction(extra, setup.interactions, row.get("index", 0))
    if spec is not None:
        return TARGET, {"interaction": vars(spec), "seed": row.get("seed")}
    if not (name or setup.default):
        raise ValueError("agent loop env_agent: the row names no environment (extra_info.env_name) and "
                         "actor_rollout_ref.rollout.agent.environment is not set")
    return resolve_env(name or setup.default), {}


@register("env_agent")
class EnvAgentLoop(AgentLoopBase):
    """The module docstring's loop for one row."""

    async def _call(self, call: tuple[str, str, str | None, Any]) -> EnvResult:
        setup: EnvSetup = self.context.env
        if isinstance(self.client, BatchingClient):  # every trajectory's calls of the round in one pool run
            return (await self.client.call_batched(setup.runner.run, [call]))[0]

        def alone() -> list[EnvResult]:
            with setup.lock:
                return setup.runner.run([call])
        return (await asyncio.to_thread(alone))[0]

    async def run(self, sampling_params, **row):
        setup: EnvSetup = self.context.env
        if setup is None:
            raise ValueError("agent loop env_agent needs actor_rollout_ref.rollout.agent.environment "
                             "(or a row's extra_info.env_name)")
        (target, more), budget, eos = _row_env(row, setup), sampling_params.max_tokens, self.context.eos
        prompt = list(row["prompt_ids"])
        tokens: list[int] = []
        mask: list[int] = []
        log_probs: list[float] = []
        versions: list[int] = []
        turn_rewards: list[tuple[int, float]] = []
        errors: list[str] = []

        def observe(messages: list[dict[str, str]], after_eos: bool) -> None:
            obs = setup.render(messages, after_eos)[: budget - len(tokens)] if messages else []
            tokens.extend(obs)
            mask.extend([0] * len(obs))
            log_probs.extend([0.0] * len(obs))
            versions.extend([-1] * len(obs))  # no policy sampled them

        state = await self._call(("reset", target, None, {**{k: row.get(k) for k in ("extra_info", "raw_prompt")},
                                                           **more}))
        turns = replies = 0
        if state.error is not None:
            errors.append(state.error)
        else:
            observe(state.messages, False)
        step_seed = row.get("step_seed")
        while state.error is None and turns < self.context.max_turns and len(tokens) < budget:
            seed = None if step_seed is None else sample_seed(step_seed, row["prompt"], row["sample"], turns)
            gen = await self.client.generate(prompt + tokens, replace(sampling_params, max_tokens=budget - len(tokens),
                                                                      stop=()), seed, images=row.get("images"))
            stop = next((i for i, t in enumerate(gen.token_ids) if t in eos), None)
            kept = len(gen.token_ids) if stop is None else stop + 1
            tokens.extend(gen.token_ids[:kept])
            mask.extend([1] * kept)
            log_probs.extend(gen.log_probs[:kept])
            versions.extend(gen.versions[:kept])
            turns += 1
            body = gen.token_ids[:kept] if stop is None else gen.token_ids[:stop]
            step = await self._call(("step", target, state.state, self.context.decode(body)))
            if step.error is not None:
                errors.append(step.error)
                break
            if kept:
                turn_rewards.append((len(tokens) - 1, step.reward))
            if step.done or turns == self.context.max_turns or len(tokens) >= budget:
                break
            observe(step.messages, stop is not None)
            replies += bool(step.messages)
            if self.context.max_user_turns is not None and replies >= self.context.max_user_turns:
                break
            state = step
        return AgentLoopOutput(prompt, tokens, mask, log_probs, reward_score=sum(r for _, r in turn_rewards),
                               num_turns=turns, extra_fields={"turn_rewards": turn_rewards, "errors": errors,
                                                              "versions": versions})
