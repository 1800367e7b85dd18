"""The env_agent loop on the real HF engine: per-turn rewards on each turn's last generated token, the
environment's tokens masked, the reward stage's rule, a raising and a hanging environment contained."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from rlpad.algorithms.estimators import compute_gae_advantages
from rlpad.batch import Batch
from rlpad.config.schema import AgentConfig, DataConfig, MultiTurnConfig, RolloutConfig
from rlpad.embedded.tiny import build_tokenizer
from rlpad.config.rewards import RewardConfig
from rlpad.rewards.combine import PART_PREFIX, CombinedReward, part_metrics
from rlpad.rewards.stage import score_rewards, validation_scores
from rlpad.rewards.rules import REWARD_EXTRA_INFO, place_scores
from rlpad.rollout.environments import environment_problems
from rlpad.rollout.hf import HFRollout
from processes import alive
from test_rollout_layout import P, make_model, prompt_batch

TOK = build_tokenizer()
EOS = TOK.eos_token_id
R = 24


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs")
    model = make_model()
    model.save_pretrained(path)
    build_tokenizer(path)
    return model, str(path)


def rollout(folder, environment, timeout=10.0, max_user_turns=None):
    model, path = folder
    cfg = RolloutConfig(name="hf", n=2, temperature=1.0, seed=0,
                        multi_turn=MultiTurnConfig(max_assistant_turns=3, max_user_turns=max_user_turns),
                        agent=AgentConfig(default_agent_loop="env_agent", environment=environment, env_timeout=timeout,
                                          env_workers=2))
    return HFRollout(model, cfg, DataConfig(max_prompt_length=P, max_response_length=R), tokenizer_path=path)


def plain_rows_rollout(folder, environment, **kwargs):
    """The 6 test prompts x n=2 through ``environment`` on the hf engine (seed 5), every row tagged plain."""
    hf = rollout(folder, environment, **kwargs)
    batch = prompt_batch()
    batch["extra_info"] = [{"tag": "plain"}] * 6
    try:
        return hf.generate(batch, seed=5)
    finally:
        hf.shutdown()


def runs(mask):
    """(start, end) of each run of 1s in a 0/1 list (end exclusive)."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_env_loop_rewards_on_each_turns_last_token_and_masks(folder):
    from rlpad.algorithms.losses import compute_policy_loss
    from rlpad.core.forward import compute_log_probs
    from rlpad.embedded.exactness import ENGINE_LOGPROB_TOL

    hf = rollout(folder, "mt_envs:TurnEnv")
    batch = prompt_batch()
    tags = ["greet", "plain", "plain", "greet", "plain", "plain"]
    batch["extra_info"] = [{"tag": t} for t in tags]
    batch["agent_name"] = ["env_agent", "single_turn_agent", "env_agent", "env_agent", "env_agent", "env_agent"]
    try:
        out = hf.generate(batch, seed=5)
        plain = hf.generate(batch.index(torch.tensor([1])), seed=5)  # a replica's slice without an environment's row
    finally:
        hf.shutdown()
    # the slice carries the environment's fields all the same (zeros, no row), so a step's slices concatenate
    assert plain["env_rows"].tolist() == [False, False] and not plain["env_scores"].any()
    assert Batch.concat([out, plain])["env_rows"].tolist() == out["env_rows"].tolist() + [False, False]
    mask, resp = out["response_mask"], out["responses"]
    length = out["attention_mask"][:, P:].sum(1)
    rows = out["env_rows"]
    assert rows.tolist() == [k // 2 != 1 for k in range(12)]
    expected = torch.zeros(12, R)
    multi = 0
    for k in range(12):
        if not rows[k]:
            assert (out["env_scores"][k] == 0).all()
            continue
        ids, m = resp[k, : length[k]].tolist(), mask[k, : length[k]].tolist()
        turns = runs(m)
        multi += len(turns) >= 2
        # the environment's tokens: "go" first on greet rows, then "ok<k>" after each turn but the last (cut at R)
        env_text = [(0, turns[0][0])] + [(turns[t][1], turns[t + 1][0] if t + 1 < len(turns) else length[k])
                                         for t in range(len(turns))]
        assert ids[: turns[0][0]] == (enc("go") if tags[k // 2] == "greet" else [])
        for t, (a, b) in enumerate(env_text[1:], start=1):
            assert ids[a:b] == enc(f"ok{t}")[: b - a] and (t < len(turns) or b == a or b == R)
        for t, (a, b) in enumerate(turns, start=1):  # turn t's reward on its last token, from its decoded text
            body = ids[a:b - 1] if ids[b - 1] == EOS else ids[a:b]
            assert EOS not in body
            expected[k, b - 1] = t + len(TOK.decode(body)) / 100
    assert multi >= 3  # rows with rewards on two or more turns (what the negative control needs)
    assert torch.equal(out["env_scores"], expected)
    assert not torch.equal(place_scores(expected.sum(-1), mask)[rows], expected[rows])  # all on the last token: not it
    env = out["attention_mask"][:, P:].bool() & ~mask.bool()
    assert env[rows].any() and (out["rollout_log_probs"][env] == 0).all()
    lp, _ = compute_log_probs(folder[0], out["input_ids"], out["attention_mask"], out["position_ids"], R,
                              use_remove_padding=True, response_mask=mask)
    gen = mask.bool()
    assert (lp[env] == 0).all() and (lp - out["rollout_log_probs"])[gen].abs().max() < ENGINE_LOGPROB_TOL
    new = lp.detach().clone().requires_grad_(True)
    loss, _ = compute_policy_loss(out["rollout_log_probs"], new, torch.ones_like(new), mask)
    loss.backward()
    assert (new.grad[env] == 0).all() and (new.grad[gen] != 0).all()
    # the reward stage: the environment wins on its rows, the reward function scores only the others
    called = []

    def reward_fn(data_source, solution_str, ground_truth, extra_info=None):
        called.append(extra_info["tag"])
        return 0.5

    out["data_source"] = ["t"] * 12
    token, seq, acc = score_rewards(out, TOK, reward_fn)
    assert called == ["plain", "plain"]  # row 1's two samples
    assert torch.equal(token[rows], expected[rows]) and torch.equal(seq[rows], expected[rows].sum(-1))
    assert torch.equal(token[~rows], place_scores(torch.full((2,), 0.5), mask[~rows])) and (seq[~rows] == 0.5).all()
    assert torch.equal(acc, seq)
    task, trained = validation_scores(out, TOK, reward_fn)
    assert torch.equal(task, seq) and trained is None
    # the rows without an environment get the reward function's extras (infos, parts) as a batch without
    # environments has them; the environment's rows {} and NaN (not scored)
    plain_rows = out.index((~rows).nonzero().flatten())
    plain_rows.tensors.pop("env_rows"), plain_rows.tensors.pop("env_scores")
    combined = CombinedReward(RewardConfig(weights={"rule": 2.0}), lambda **kw: {"score": 0.5, "tag": kw["extra_info"]["tag"]})
    alone = combined.score(plain_rows, TOK)
    mixed = score_rewards(out, TOK, combined)
    infos = list(out[REWARD_EXTRA_INFO])
    assert [infos[k] for k in range(12) if not rows[k]] == list(plain_rows[REWARD_EXTRA_INFO]) == [{"score": 0.5, "tag": "plain"}] * 2
    assert all(infos[k] == {} for k in range(12) if rows[k])
    part = out[PART_PREFIX + "rule"]
    assert torch.equal(part[~rows], plain_rows[PART_PREFIX + "rule"]) and part[rows].isnan().all()
    assert torch.equal(mixed[1][~rows], alone[1]) and (alone[1] == 1.0).all()
    assert part_metrics(out) == part_metrics(plain_rows) == {"reward/rule/mean": 0.5}
    # GAE (gamma = lam = 1, values 0) sees each turn's reward: a generated token's return is the rewards from it on
    _, returns = compute_gae_advantages(token, torch.zeros_like(token), mask, 1.0, 1.0)
    after = expected.flip(-1).cumsum(-1).flip(-1) * mask
    assert torch.allclose(returns[rows], after[rows], atol=1e-6)


def test_max_user_turns_ends_an_episode_after_that_many_replies(folder):
    """verl's multi_turn.max_user_turns=1: every episode is one turn and the environment's first reply (kept as
    context, mask 0), where TurnEnv would go on for 3 turns (the test above sees rows with two or more)."""
    out = plain_rows_rollout(folder, "mt_envs:TurnEnv", max_user_turns=1)
    length = out["attention_mask"][:, P:].sum(1)
    replied = 0
    for k in range(12):
        ids, m = out["responses"][k, : length[k]].tolist(), out["response_mask"][k, : length[k]].tolist()
        (a, b), = runs(m)  # one turn
        assert a == 0 and ids[b:] == enc("ok1")[: len(ids) - b]
        replied += b < len(ids)
    assert replied >= 6  # the turns that ended before the budget got the reply, and nothing came after it
    assert (out["env_scores"] != 0).sum(-1).tolist() == [1] * 12


def test_raising_and_hanging_environments_end_their_trajectories(folder, tmp_path, monkeypatch):
    out = plain_rows_rollout(folder, "mt_envs:RaisingEnv")
    for k in range(12):  # one rewarded turn at most; a second turn's step raised and ended it
        n_turns = len(runs(out["response_mask"][k].tolist()))
        assert n_turns <= 2 and (out["env_scores"][k] != 0).sum() == 1
    pids = tmp_path / "pids"
    monkeypatch.setenv("RLPAD_TEST_ENV_PIDS", str(pids))
    start = time.monotonic()
    out = plain_rows_rollout(folder, "mt_envs:HangingEnv", timeout=1.0)
    assert time.monotonic() - start < 120  # not the hang (300 s): the calls were answered at env_timeout
    assert (out["env_scores"] == 0).all() and out["env_rows"].all()
    assert all(len(runs(out["response_mask"][k].tolist())) == 1 for k in range(12))
    hung = {int(p) for p in pids.read_text().split()}
    assert hung
    assert not any(alive(pid) for pid in hung)  # no process of a hung environment left


def test_environment_keys_refused_in_one_line():
    key = "actor_rollout_ref.rollout.agent"
    assert environment_problems(AgentConfig(environment="guess_number")) == []
    assert environment_problems(AgentConfig(environment="nope", env_timeout=0, env_workers=0)) == [
        f"{key}.env_timeout=0 must be > 0", f"{key}.env_workers=0 must be >= 1",
        f"{key}.environment='nope' is neither a registered environment (guess_number) nor pkg.module:Class"]
    (problem,) = environment_problems(AgentConfig(environment="mt_envs:Missing"))
    assert problem.startswith(f"{key}.environment: cannot import 'mt_envs:Missing'") and "\n" not in problem
    assert environment_problems(replace(AgentConfig(), default_agent_loop="env_agent")) == [
        f"{key}.default_agent_loop=env_agent needs {key}.environment (rows may name theirs in extra_info.env_name; "
        "set the key to the default) or actor_rollout_ref.rollout.multi_turn.interaction_config_path"]


def test_a_verl_interaction_yaml_runs_through_the_env_loop(folder, tmp_path):
    log = tmp_path / "finalized"
    path = tmp_path / "interaction.yaml"
    path.write_text(f"interaction:\n  - name: guess\n    class_name: mt_envs.GuessInteraction\n"
                    f"    config: {{scale: 0.5, stop_after: 2, log: {log}}}\n")
    model, tok_path = folder
    cfg = RolloutConfig(name="hf", n=2, temperature=1.0, seed=0,
                        multi_turn=MultiTurnConfig(max_assistant_turns=3, interaction_config_path=str(path)),
                        agent=AgentConfig(default_agent_loop="env_agent", env_workers=2))
    hf = HFRollout(model, cfg, DataConfig(max_prompt_length=P, max_response_length=R), tokenizer_path=tok_path)
    batch = prompt_batch()
    secrets = [3, 6, 9, 12, 2, 5]
    batch["extra_info"] = [{"interaction_kwargs": {"name": "guess", "secret": s}} for s in secrets]
    batch["raw_prompt"] = [[{"role": "user", "content": "guess"}]] * 6
    try:
        out = hf.generate(batch, seed=3)
    finally:
        hf.shutdown()
    mask, resp, length = out["response_mask"], out["responses"], out["attention_mask"][:, P:].sum(1)
    assert out["env_rows"].all()
    expected, finalized, two = torch.zeros(12, R), 0, 0
    for k in range(12):
        ids, turns = resp[k, : length[k]].tolist(), runs(mask[k, : length[k]].tolist())
        assert 1 <= len(turns) <= 2 and turns[0][0] == 0  # stop_after 2 ends the episode before max_assistant_turns
        texts = [TOK.decode(ids[a:b - 1] if ids[b - 1] == EOS else ids[a:b]) for a, b in turns]
        for t, ((a, b), text) in enumerate(zip(turns, texts), start=1):
            # the conversation generate_response saw: the prompt, then each turn and reply (2t messages)
            expected[k, b - 1] = 0.5 * (2 * t + len(text) / 100)
            reply = "higher" if len(text) < secrets[k // 2] else "lower" if len(text) > secrets[k // 2] else "right"
            end = turns[t][0] if t < len(turns) else length[k]
            assert ids[b:end] == (enc(reply)[: end - b] if t < len(turns) else [])  # the reply rendered, mask 0
        ended = len(turns) == 2 or "right" in [("right" if len(x) == secrets[k // 2] else "") for x in texts]
        finalized += ended
        two += len(turns) == 2
    assert two >= 3 and torch.equal(out["env_scores"], expected)
    ids = log.read_text().split()  # finalize_interaction ran once per episode the interaction ended
    assert len(ids) == len(set(ids)) == finalized and all(i.startswith("guess-") for i in ids)


def test_interactions_no_row_runs_are_named_at_start_up():
    """interaction_config_path with no data row on env_agent (by default_agent_loop or agent_name): one warning."""
    from rlpad.rollout.agent_loops import loop_names
    from rlpad.rollout.interactions import interaction_notice

    rows = [None, "tool_agent", None]
    assert interaction_notice("i.yaml", set(loop_names(rows, AgentConfig(), False))) == (
        "warning: actor_rollout_ref.rollout.multi_turn.interaction_config_path=i.yaml is set but no data row runs the "
        "env_agent loop (the rows run single_turn_agent, tool_agent): its interactions never run; set "
        "actor_rollout_ref.rollout.agent.default_agent_loop=env_agent or the rows' agent_name")
    assert interaction_notice("i.yaml", set(loop_names(rows, AgentConfig(default_agent_loop="env_agent"), False))) is None
    assert interaction_notice("i.yaml", set(loop_names([*rows, "env_agent"], AgentConfig(), True))) is None
    assert interaction_notice(None, set(loop_names(rows, AgentConfig(), False))) is None


def test_interaction_yaml_loads_verls_example_and_refuses_bad_entries_in_one_line(tmp_path):
    from rlpad.rollout.interactions import load_interaction_config

    key = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"

    def load(text):
        path = tmp_path / "i.yaml"
        path.write_text(text)
        return load_interaction_config(str(path))

    # verl's gsm8k example (examples/sglang_multiturn/config/interaction_config), class_name changed to a class
    # importable here; with and without its name (verl's rule: the class's name less "Interaction", lower-cased)
    example = 'interaction:\n  - name: "gsm8k"\n    class_name: "mt_envs.Gsm8kInteraction"\n    config: {}\n'
    (spec,) = load(example).values()
    assert (spec.name, spec.class_name, spec.config) == ("gsm8k", "mt_envs.Gsm8kInteraction", {"name": "gsm8k"})
    assert list(load(example.replace('  - name: "gsm8k"\n    class_name', "  - class_name"))) == ["gsm8k"]
    bad = {
        "tools: []\n": f"{key}: {tmp_path / 'i.yaml'} must hold interaction: [{{name, class_name, config}}, ...]",
        "interaction:\n  - name: a\n": f"{key}: interaction[0] needs class_name: pkg.module.Class",
        "interaction:\n  - {class_name: mt_envs.GuessInteraction}\n  - {name: guess, class_name: mt_envs.Gsm8kInteraction}\n":
            f"{key}: interaction[1] (guess): two interactions named 'guess'",
        "interaction:\n  - {name: t, class_name: mt_envs.TurnEnv}\n":
            f"{key}: interaction[0] (t): mt_envs.TurnEnv is not an interaction class (verl's BaseInteraction shape); "
            "it lacks start_interaction, generate_response",
        "interaction:\n  - {name: g, class_name: mt_envs.GuessInteraction, config: [1]}\n":
            f"{key}: interaction[0] (g): config must be a mapping, got list",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError) as e:
            load(text)
        assert str(e.value) == message
    with pytest.raises(ValueError, match=rf"^{key}: interaction\[0\] \(missing\): cannot import 'mt_envs.Missing'"):
        load("interaction:\n  - {name: missing, class_name: mt_envs.Missing}\n")
    path = tmp_path / "i.yaml"
    path.write_text(example)
    agent = AgentConfig(default_agent_loop="env_agent")
    assert environment_problems(agent, str(path)) == []  # the interactions stand for the default environment
    path.write_text("interaction: 3\n")
    assert environment_problems(agent, str(path)) == [
        f"{key}: {path} must hold interaction: [{{name, class_name, config}}, ...]"]


def test_overlong_shaping_keeps_each_turns_reward_where_it_is():
    from rlpad.batch import Batch
    from rlpad.config.schema import Config
    from rlpad.training.dynamic_sampling import SEQ_SCORE, shape_rewards

    config = Config()
    config.data.max_response_length = 8
    config.reward_model.overlong_buffer.enable, config.reward_model.overlong_buffer.len = True, 4
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])  # row 0: two turns, a reply between
    attention = torch.cat([torch.ones(2, 2, dtype=torch.long), torch.tensor([[1] * 7 + [0], [1, 1, 1, 0, 0, 0, 0, 0]])], 1)
    scores = torch.tensor([[0, 0.5, 0, 0, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0, 0, 0]])
    batch = Batch({"token_level_scores": scores.clone(), SEQ_SCORE: scores.sum(-1), "response_mask": mask,
                   "attention_mask": attention, "responses": torch.zeros(2, 8, dtype=torch.long)})
    shaped, _ = shape_rewards(batch, config)
    penalty = -(7 - 4) / 4  # row 0: 7 response tokens, 3 into the buffer; row 1: none
    want = scores.clone()
    want[0, 6] += penalty
    assert torch.equal(batch["token_level_scores"], want) and shaped.tolist() == [1.5 + penalty, 1.0]
    assert batch["token_level_scores"][0, 1] == 0.5  # re-placing the shaped sum (the old rule) moved it to column 6


def test_guess_number_env_and_its_warm_start_traces():
    from rlpad.embedded.toy_guess import EOS as END, GuessNumberEnv, sft_examples

    env = GuessNumberEnv()
    assert env.reset({"extra_info": {"secret": 11}}) == []
    assert env.step("8") == ([{"role": "user", "content": "higher"}], 0.0, False, {"valid": True})
    assert env.step("13")[0] == [{"role": "user", "content": "lower"}] and env.step("x")[1:3] == (0.0, False)
    assert env.step(" 11 ")[1:3] == (1.0, True)
    within = 0
    examples = sft_examples(2000)
    for prompt, segments in examples:  # each trace is an episode the environment would answer as written
        env = GuessNumberEnv()
        env.reset({"extra_info": {"secret": int(segments[-1][0])}})
        guesses = [s[0].removesuffix(END) for s in segments if s[1]]
        replies = [s[0] for s in segments if not s[1]]
        for guess, said in zip(guesses, replies):
            assert env.step(guess)[0] == [{"role": "user", "content": said}]
        assert env.step(guesses[-1])[1] == 1.0
        within += len(guesses) <= 4
    assert abs(within / len(examples) - 0.61) < 0.03  # the searcher the docs cite (bisection: 1.0)
