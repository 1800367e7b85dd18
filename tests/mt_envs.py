"""Environments for tests/test_environments.py, in a module with no heavy imports (an environment worker
process imports it)."""

from __future__ import annotations

import os
import time


class TurnEnv:
    """Turn k's reward is ``k + len(text) / 100`` (text-dependent: the test recomputes it from the decoded
    turn); replies ``ok<k>``; done after 3 turns. A row tagged ``greet`` opens with a ``go`` message."""

    def reset(self, row):
        self.k = 0
        return [{"role": "user", "content": "go"}] if row["extra_info"]["tag"] == "greet" else []

    def step(self, text):
        self.k += 1
        return [{"role": "user", "content": f"ok{self.k}"}], self.k + len(text) / 100, self.k == 3, {}


class RaisingEnv(TurnEnv):
    """Raises at its second step."""

    def step(self, text):
        if self.k == 1:
            raise RuntimeError("env broke")
        return super().step(text)


class HangingEnv(TurnEnv):
    """Hangs at its first step, after writing its process id to ``$RLPAD_TEST_ENV_PIDS``."""

    def step(self, text):
        with open(os.environ["RLPAD_TEST_ENV_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(300)
        return super().step(text)


class GuessInteraction:
    """verl's BaseInteraction shape, duck-typed (async, imports nothing of verl): the guess is the turn's length
    in characters; replies higher / lower / right; turn t's score ``config["scale"] * (len(messages) + len(text)
    / 100)`` (the conversation so far: the test recomputes it); ends the episode after ``config["stop_after"]``
    turns or a right guess; finalize_interaction writes the instance id to ``config["log"]``."""

    def __init__(self, config):
        self.config, self.name, self._instances = config, config["name"], {}

    async def start_interaction(self, instance_id=None, **kwargs):
        self._instances[instance_id] = {"secret": kwargs["secret"], "turns": 0}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self._instances[instance_id]
        state["turns"] += 1
        text = messages[-1]["content"]
        guess, secret = len(text), state["secret"]
        reply = "higher" if guess < secret else "lower" if guess > secret else "right"
        done = reply == "right" or state["turns"] == self.config["stop_after"]
        return done, reply, self.config["scale"] * (len(messages) + len(text) / 100), {"guess": guess}

    async def calculate_score(self, instance_id, **kwargs):
        return 0.0

    async def finalize_interaction(self, instance_id, **kwargs):
        with open(self.config["log"], "a") as f:
            f.write(f"{instance_id}\n")
        del self._instances[instance_id]


class Gsm8kInteraction(GuessInteraction):
    """A stand-in for verl's example class of the same name (what its YAML names once class_name is changed)."""
