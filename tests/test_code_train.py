"""Hostile programs as the responses of a real training step (the local stack: the reward stage running
them in the sandbox pool, the actor's forward and PPO update on them): each scored 0 with its reason in
the step's metrics (reward/code/<outcome>), an honest response among them still passing, the step's
numbers finite; afterwards no sandbox process left, the driver's memory where it was before the reward
stage, the run's temporary HOME (a canary in it) intact, the test's server never reached. (1000 through
the pool: tests/test_code_sandbox.py.)"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from hostile_code import DOUBLE, HONEST, Hostile, Listener, hostile_programs, sandbox_processes
from paths import CACHE, recipe
from rlpad.config.code import CodeConfig
from rlpad.embedded.tiny import CODE_CHARSET, build_tokenizer
from rlpad.recipe.load import load_config
from rlpad.code import hooks as code
from rlpad.code.sources import OUTCOMES
from rlpad.rollout.layout import build_rollout_batch, prompt_token_lists
from rlpad.train import fit

RESPONSE_LENGTH = 512
PROMPTS, N = 3, 5  # the 14 hostile programs and an honest one


def rss_mb() -> float:
    return int(re.search(r"^VmRSS:\s+(\d+)", open("/proc/self/status").read(), re.M).group(1)) / 1024


class HostileRollout:
    """The workers, but every generation's responses are the given programs (row i: program i), and the
    driver's memory noted around the reward stage (from the generation to the first log-prob call)."""

    def __init__(self, workers, tokenizer, programs: list[Hostile], n: int):
        self.workers, self.tokenizer, self.programs, self.n = workers, tokenizer, programs, n
        self.rss: list[float] = []

    def generate(self, batch, seed):
        prompts = prompt_token_lists(batch["input_ids"], batch["attention_mask"], max_prompt_length=64)
        eos = self.tokenizer.eos_token_id
        tokens = [self.tokenizer(h.response, add_special_tokens=False)["input_ids"] + [eos] for h in self.programs]
        assert all(len(t) <= RESPONSE_LENGTH for t in tokens)
        assert 2 not in sum(tokens, []), "a program has a character the code tokenizer does not know"
        out = build_rollout_batch(batch, prompts, tokens, [[0.0] * len(t) for t in tokens], n=self.n,
                                  prompt_width=batch["input_ids"].shape[1], response_length=RESPONSE_LENGTH,
                                  pad_token_id=self.tokenizer.pad_token_id, eos_token_ids=[eos])
        out.non_tensors["ground_truth"] = np.array([h.ground_truth for h in self.programs], dtype=object)
        self.rss.append(rss_mb())
        return out

    def compute_log_prob(self, batch, **kwargs):
        self.rss.append(rss_mb())
        return self.workers.compute_log_prob(batch, **kwargs)

    def __getattr__(self, name):
        return getattr(self.workers, name)


def test_hostile_responses_in_a_training_step(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "canary").write_text("alive")
    monkeypatch.setenv("HOME", str(home))  # the run's temporary HOME
    tokenizer_dir = tmp_path / "code_tokenizer"
    tokenizer = build_tokenizer(tokenizer_dir, charset=CODE_CHARSET)
    listener = Listener()
    try:
        hostile = hostile_programs(listener.port, str(home), os.path.abspath(recipe("grpo_tiny_code")),
                                   str(tmp_path / "escaped.txt"))
        programs = [*hostile, Hostile("honest", HONEST, DOUBLE, "pass")]
        assert len(programs) == PROMPTS * N
        out = tmp_path / "run"
        config = load_config(recipe("grpo_tiny_code"), [
            f"trainer.default_local_dir={out}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
            "trainer.backend=local", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "data.val_files=[]",
            "actor_rollout_ref.model.path=tiny:qwen2", f"actor_rollout_ref.model.tokenizer_path={tokenizer_dir}",
            "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.rollout.n={N}", f"data.train_batch_size={PROMPTS}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}", f"data.max_response_length={RESPONSE_LENGTH}",
            "data.max_prompt_length=64", "reward.code.timeout_s=2.0", "reward.code.memory_limit_mb=512",
            "reward.code.max_output_bytes=1048576", "reward.code.max_processes=16", "reward.code.max_concurrent=4",
        ])
        rollout = None

        def wrap(workers):
            nonlocal rollout
            rollout = HostileRollout(workers, tokenizer, programs, N)
            return rollout

        history = fit(config, wrap_workers=wrap)
        left = sandbox_processes(code.scorer().pool)  # its uids and tag, before the scorer is reset below
    finally:
        listener.close()
        code.configure(CodeConfig())  # the process's scorer as a fresh process has it (no code sources)
    step = history[-1]
    # the logged share of each outcome, times the batch: the count of responses with it
    want = {o: sum(p.outcome == o for p in programs) for o in OUTCOMES}
    got = {o: round(step[f"reward/code/{o}"] * len(programs)) for o in OUTCOMES}
    assert got == want
    assert math.isclose(step["reward/mean"], 1 / len(programs), abs_tol=1e-6)  # the honest one alone scores
    assert all(math.isfinite(v) for v in step.values() if isinstance(v, float)), step
    for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean"):
        assert key in step and math.isfinite(step[key])
    assert (home / "canary").read_text() == "alive"
    assert listener.accepted == 0 and not (tmp_path / "escaped.txt").exists()
    assert left == []
    before, after = rollout.rss
    print(f"hostile responses: driver RSS {before:.0f} -> {after:.0f} MB across the reward stage; "
          f"{ {k: round(v, 1) for k, v in step.items() if k.startswith('timing_s/')} }")
    assert after - before < 64, "the reward stage kept memory"
    with open(out / "metrics.jsonl") as f:
        logged = json.loads(f.readline())
    assert round(logged["reward/code/timeout"] * len(programs)) == want["timeout"] == 1
