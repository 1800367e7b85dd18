"""The deterministic stream's logic (rlpad/training/stream_rounds.py), no engine: the round budget rule, and the
state a checkpoint holds (taken at a weight load, through JSON) continued by a fresh StreamRounds gives what the
uninterrupted one gave. The engine here is a script (each token a hash of the request's seed, its position and the
loaded version): it checks the bookkeeping, not an engine (tests/test_streaming_train.py runs vLLM)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json

import pytest

from rlpad.rollout.base import Sampling
from rlpad.rollout.engine_client import EngineClient, Generation
from rlpad.training.group_buffer import GroupBuffer
from rlpad.training.stream_rollout import StreamPrompt
from rlpad.training.stream_rounds import StreamRounds, round_budget
from rlpad.training.stream_staleness import StalenessRule

R, EOS, K, N, STEPS = 20, 0, 2, 2, 5


def test_the_round_budget_is_seeded_and_within_its_range():
    for tokens in (1, 2, 7, 16):
        got = [round_budget(3, r, tokens) for r in range(200)]
        assert min(got) >= (tokens + 1) // 2 and max(got) <= tokens
        assert got == [round_budget(3, r, tokens) for r in range(200)]
        if tokens > 2:
            assert len(set(got)) == tokens - (tokens + 1) // 2 + 1  # every value of the range drawn
    assert [round_budget(3, r, 16) for r in range(50)] != [round_budget(4, r, 16) for r in range(50)]
    with pytest.raises(ValueError, match="round_tokens=0 must be >= 1"):
        round_budget(3, 0, 0)


class Script(EngineClient):
    """Each token: a hash of (seed, position, version); EOS ends it. Records each round's request ids."""

    def __init__(self):
        self.version, self.eos_token_ids, self.rounds = 0, frozenset([EOS]), []

    async def generate(self, prompt_ids, sampling, seed, *, request_id=None, images=None, partial=None):
        tokens, log_probs = [], []
        for j in range(sampling.max_tokens):
            digest = hashlib.blake2b(f"{seed}:{len(prompt_ids) + j}:{self.version}".encode(), digest_size=4).digest()
            token = int.from_bytes(digest, "little") % 12
            tokens.append(token)
            log_probs.append(-token / 7 - self.version)
            if token == EOS:
                break
        return Generation(request_id, tokens, log_probs, [self.version] * len(tokens),
                          "stop" if tokens[-1] == EOS else "length")

    async def generate_round(self, requests):
        self.rounds.append([r.request_id for r in requests])
        return await super().generate_round(requests)

    async def pause(self, *, clear_cache=True):
        pass

    async def resume(self):
        pass

    async def load_weights(self, named_tensors, version):
        self.version = version
        return 0.0


def prompts(start=0):
    for i in itertools.count(start):
        yield StreamPrompt(f"p{i}", [1 + i % 5, 2 + i % 3], seed=7, index=i)


def stream(start=0, round_tokens=8, partial=True):
    """Its ``scored``: the uids of the groups ``on_group`` saw (the trainer's rewards)."""
    rule = StalenessRule(threshold=1.0, window=K, max_staleness=1, partial_rollout=partial)
    scored = []

    async def on_group(group):
        await asyncio.sleep(0)  # as the trainer's reward thread: the rounds' loop goes on meanwhile
        scored.append(group.uid)

    s = StreamRounds([Script(), Script()], prompts(start), n=N, sampling=Sampling(1, 1.0, 1.0, -1, R), rule=rule,
                     buffer=GroupBuffer(N), slots_per_engine=2 * N, round_tokens=round_tokens, seed=11, k=K,
                     loads_after=lambda s: s <= STEPS, on_group=on_group)
    s.scored = scored
    return s


async def drive(s: StreamRounds, first: int, save_at: int | None = None):
    """The trainer's side from step ``first`` on: each step's responses; the state saved at ``save_at``."""
    s.start()
    out, saved = {}, None
    try:
        for step in range(first, STEPS + 1):
            groups = await s.take(K, step - 1)
            assert all(g.uid in s.scored for g in groups)  # every group the trainer gets was scored first
            out[step] = [(r.uid, r.index, r.tokens, r.versions, r.log_probs) for g in groups for r in g.responses]
            await s.load_weights(f"weights {step}", step)
            s.release(step)
            if step == save_at:
                saved = json.loads(json.dumps(s.snapshots[step]))
    finally:
        await s.close()
    return out, saved


def resumed(state, first_prompt_shift=0):
    s = stream(state["first_prompt"] + first_prompt_shift)
    s.restore(state, "weights saved")
    out = asyncio.run(drive(s, state["version"] + 1))[0]
    saved = [g for step in state["assigned"].values() for g in step["groups"]] + state["ready"]
    assert s.scored[:len(saved)] == [f"p{g['prompt']}" for g in saved]  # the saved groups rescored first
    return out


def test_a_saved_state_continues_as_the_uninterrupted_stream():
    full, state = asyncio.run(drive(stream(), 1, save_at=2))
    again, _ = asyncio.run(drive(stream(), 1))
    assert again == full  # the schedule depends on nothing but the inputs
    assert any(len(set(r[3])) > 1 for rows in full.values() for r in rows)  # responses crossed loads
    live = [r for engine in state["live"] for r in engine]
    assert any(r["response"]["tokens"] for r in live)  # partial responses in flight in the state
    assert state["assigned"] or state["ready"]  # and groups the trainer had not taken yet
    assert resumed(state) == {t: full[t] for t in range(3, STEPS + 1)}
    # negative controls: the state's round (the budgets drawn from it) and its chunk counts (the seeds) are read
    later = dict(state, round=state["round"] + 1)
    assert resumed(later) != {t: full[t] for t in range(3, STEPS + 1)}
    chunks = json.loads(json.dumps(state))
    for engine in chunks["live"]:
        for r in engine:
            r["chunks"] += 1
    assert resumed(chunks) != {t: full[t] for t in range(3, STEPS + 1)}
    other, _ = asyncio.run(drive(stream(round_tokens=6), 1))
    assert other != full


def test_a_prompt_stream_replayed_from_too_late_or_on_other_engines_is_refused():
    _, state = asyncio.run(drive(stream(), 1, save_at=2))
    with pytest.raises(ValueError, match="the prompt stream replays from"):
        resumed(state, first_prompt_shift=1)
    with pytest.raises(ValueError, match="ran on 3 engines, this run has 2 .actor_rollout_ref.rollout.num_replicas"):
        resumed(dict(state, live=state["live"] + [[]]))


def test_without_partial_rollouts_the_responses_at_a_load_restart_and_the_state_resumes():
    full, state = asyncio.run(drive(stream(partial=False), 1, save_at=2))
    rows = [r for step in full.values() for r in step]
    assert not any(len(set(r[3])) > 1 for r in rows)  # none holds two versions
    assert state["regenerated"] > 0  # the responses in flight at the loads were restarted, counted
    s = stream(state["first_prompt"], partial=False)
    s.restore(state, "weights saved")
    assert asyncio.run(drive(s, 3))[0] == {t: full[t] for t in range(3, STEPS + 1)}
