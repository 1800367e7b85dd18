"""reward.* keys: verl 0.9's names, verl's legacy names mapped as its migration does, refusals in one line."""

from pathlib import Path

import pytest

from rlpad.config.rewards import RewardConfig, RewardModelScoringConfig as RewardScoring
from rlpad.config.verl_keys import LEGACY_KEYS, LEGACY_REFUSED, NO_EFFECT_KEYS
from rlpad.parallel import sp_size
from rlpad.recipe.load import config_from_dict, load_config
from rlpad.rewards.settings import part_weight, reward_model_section, reward_notices
from rlpad.rewards.sources import data_source_problems
from paths import ROOT


def test_verl_09_names_load():
    cfg = load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.model_path=/rm",
                             "reward.reward_manager.name=dapo", "reward.custom_reward_function.path=my.py",
                             "reward.custom_reward_function.name=score", "reward.reward_kwargs={scale: 2}"])
    r = cfg.reward
    assert (r.reward_model.enable, r.reward_model.model_path, r.reward_manager.name) == (True, "/rm", "dapo")
    assert r.function_spec == "my.py:score" and r.reward_kwargs == {"scale": 2}
    assert load_config().reward.function_spec == load_config().reward.fn  # reward.fn still decides


@pytest.mark.parametrize("old,new", sorted(LEGACY_KEYS.items()))
def test_each_legacy_name_lands_on_its_new_key(old, new):
    value = {"reward_model.enable": True, "reward_model.reward_kwargs": {"a": 1}, "reward_model.reward_manager": "dapo",
             "reward_model.micro_batch_size_per_gpu": 8, "reward_model.use_dynamic_bsz": True,
             "reward_model.forward_max_token_len_per_gpu": 4096,
             "reward_model.ulysses_sequence_parallel_size": 2}.get(old, "/some/path")
    extra = ["reward.reward_model.model_path=/rm"] if old == "reward_model.enable" else []
    via_override = load_config(None, [f"{old}={value}" if not isinstance(value, dict) else f"{old}={{a: 1}}"] + extra)
    nested: dict = {}
    section = nested
    *parents, leaf = old.split(".")
    for part in parents:
        section = section.setdefault(part, {})
    section[leaf] = value
    via_recipe = config_from_dict(nested, extra)
    for cfg in (via_override, via_recipe):
        got = cfg.reward
        for part in new.split(".")[1:]:
            got = getattr(got, part) if not isinstance(got, dict) else got[part]
        assert got == value


def test_dapo_overlong_buffer_still_under_reward_model():
    cfg = config_from_dict({"data": {"max_response_length": 64},
                            "reward_model": {"enable": True, "model": {"path": "/rm"},
                                             "overlong_buffer": {"enable": True, "len": 16, "penalty_factor": 0.5}}})
    assert cfg.reward_model.overlong_buffer.len == 16 and cfg.reward.reward_model.model_path == "/rm"


@pytest.mark.parametrize("key", sorted(LEGACY_REFUSED))
def test_legacy_keys_without_meaning_are_refused_in_one_line(key):
    with pytest.raises(ValueError) as e:
        load_config(None, [f"{key}.x=1" if key in ("reward_model.rollout", "sandbox_fusion") else f"{key}=1"])
    message = str(e.value)
    assert "\n" not in message and "legacy" in message and LEGACY_REFUSED[key] in message


def test_legacy_and_new_name_together_is_refused():
    with pytest.raises(ValueError, match="legacy name of 'reward.reward_model.model_path'"):
        config_from_dict({"reward_model": {"model": {"path": "/a"}}, "reward": {"reward_model": {"model_path": "/b"}}})


@pytest.mark.parametrize("overrides,match", [
    (["reward.reward_manager.name=prime"], "reward.reward_manager.name='prime'"),
    (["reward.reward_model.enable=true"], "needs reward.reward_model.model_path"),
    (["reward.custom_reward_function.path=a.py", "reward.fn=b:c"], "both name the reward function"),
    (["reward.weights={reward_model: 1.0}"], "reward.weights.reward_model names no reward part"),
    (["reward.source_weights={gsm8k: {judge: 1.0}}"], "reward.source_weights.gsm8k.judge names no reward part"),
    (["reward.normalize=[nope]"], r"reward.normalize\[\]=nope"),
    (["reward.clip=-1"], "reward.clip=-1.0 must be > 0"),
    (["reward.extra_fns={rule: a:b}"], "names 'rule', 'reward_model' and 'judge' are taken"),
    (["reward.reward_kwargs={overlong_buffer_cfg: {enable: true}}"], "reward_model.overlong_buffer"),
    (["reward.reward_model.dtype=int8"], "reward.reward_model.dtype='int8'"),
])
def test_reward_problems(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


RM_SP = "reward.reward_model.ulysses_sequence_parallel_size"
RM_ON = ["reward.reward_model.enable=true", "reward.reward_model.model_path=/rm"]


@pytest.mark.parametrize("overrides,wanted", [
    ([f"{RM_SP}=2", "trainer.n_gpus_per_node=3"], f"{RM_SP}=2 must divide the reward_model's ranks: the reward_model "
                                                  "group has 3 ranks"),
    ([f"{RM_SP}=2", "trainer.backend=local"], "trainer.backend=local runs one rank"),
    ([f"{RM_SP}=2", "trainer.n_gpus_per_node=2", "reward.reward_model.use_remove_padding=false"],
     f"{RM_SP}=2 needs reward.reward_model.use_remove_padding=true"),
    ([f"{RM_SP}=2", "trainer.n_gpus_per_node=2", "reward.reward_model.attn_implementation=flash_attention_2"],
     f"{RM_SP}=2 needs reward.reward_model.attn_implementation auto or rlpad_varlen"),
    ([f"{RM_SP}=0"], f"{RM_SP}=0 must be >= 1"),
    (["reward.reward_model.share_prompts=true", "reward.reward_model.use_remove_padding=false"],
     "reward.reward_model.share_prompts=true needs reward.reward_model.use_remove_padding=true"),
])
def test_reward_model_sequence_parallel_and_shared_prompt_problems(overrides, wanted):
    """Each refused in one line naming its key, at load (before any worker or model starts)."""
    with pytest.raises(ValueError) as e:
        load_config(None, RM_ON + overrides)
    lines = [line.strip() for line in str(e.value).splitlines()[1:]]
    assert any(wanted in line for line in lines), str(e.value)


def test_reward_model_query_heads_from_its_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 3, "num_key_value_heads": 1}')
    on = ["reward.reward_model.enable=true", f"reward.reward_model.model_path={tmp_path}", "trainer.n_gpus_per_node=2"]
    with pytest.raises(ValueError, match=f"{RM_SP}=2 must divide the query heads of reward.reward_model.model_path="):
        load_config(None, on + [f"{RM_SP}=2"])
    load_config(None, [k for k in on if "enable" not in k] + [f"{RM_SP}=2"])  # no reward model: its size is unused
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 1}')
    assert sp_size(load_config(None, on + [f"{RM_SP}=2"]).reward.reward_model, "reward_model") == 2


@pytest.mark.parametrize("actor, own, rmpad, shares", [
    (True, None, True, True), (True, None, False, False), (False, None, True, False),
    (True, False, True, False), (False, True, True, True)])
def test_reward_model_share_prompts_follows_the_actor_unless_set(actor, own, rmpad, shares):
    """null: the actor's setting where the reward model runs the packed row; an explicit value wins."""
    cfg = load_config(None, [f"actor_rollout_ref.model.share_prompts={str(actor).lower()}",
                             f"reward.reward_model.use_remove_padding={str(rmpad).lower()}"]
                      + ([] if own is None else [f"reward.reward_model.share_prompts={str(own).lower()}"]))
    assert reward_model_section(cfg).share_prompts is shares
    assert cfg.reward.reward_model.share_prompts is own  # the loaded config keeps what the user wrote


def test_a_legacy_reward_model_recipe_means_what_verl_means():
    """Issue 51 item 11: verl 0.9 scores with the reward model alone when no custom function is set; rlpad
    follows (the rule weighs 0 unless weighted or a function is named) and says so at start; with a function
    named, both are summed, and the start line says how verl would differ."""
    legacy = load_config(None, ["reward_model.enable=true", "reward_model.model.path=/rm"]).reward
    assert part_weight(legacy, "rule", "openai/gsm8k") == 0.0 and part_weight(legacy, "reward_model", "x") == 1.0
    (line,) = reward_notices(legacy)
    assert "the reward model's score alone" in line and "verl 0.9" in line
    named = load_config(None, ["reward_model.enable=true", "reward_model.model.path=/rm",
                               "custom_reward_function.path=my_reward.py"]).reward
    assert part_weight(named, "rule", "openai/gsm8k") == 1.0
    (line,) = reward_notices(named)
    assert "my_reward.py:compute_score" in line and "verl 0.9 would use the function alone" in line
    weighted = load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.model_path=/rm",
                                  "reward.weights={rule: 0.5}"]).reward
    assert part_weight(weighted, "rule", "x") == 0.5 and reward_notices(weighted) == []
    assert reward_notices(load_config(None, []).reward) == [] and part_weight(load_config(None, []).reward, "rule", "x") == 1


FILTER = ["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=4"]


@pytest.mark.parametrize("overrides", [RM_ON, ["reward.weights={rule: 0.0}"],
                                       ["reward.source_weights={gsm8k: {rule: 0.0}}"]])
def test_the_filter_never_reads_an_untrained_rule(overrides):
    """Issue 51 item 14: algorithm.filter_groups.metric=acc reads the rule's acc; where the rule weighs 0 it is
    not trained on (nor computed): refused at load, in one line; metric=score (the trained reward) is taken."""
    with pytest.raises(ValueError, match="algorithm.filter_groups.metric=acc reads the rule part's acc, but the rule "
                                         "is not trained on"):
        load_config(None, FILTER + overrides)
    load_config(None, FILTER + overrides + ["algorithm.filter_groups.metric=score"])


def test_the_reward_against_the_datas_sources():
    """Issue 51 items 12 and 14: set-up checks of the reward against the data's sources: a source_weights key
    no row has (a typo, ignored before), a source the default rule has no reward for where it weighs."""
    typo = RewardConfig(source_weights={"openai/gsm8k_": {"rule": 2.0}})
    (problem,) = data_source_problems(typo, ["openai/gsm8k"])
    assert problem.startswith("reward.source_weights.openai/gsm8k_: no row of the training or validation data")
    rm = RewardScoring(enable=True, model_path="/rm")
    assert data_source_problems(RewardConfig(reward_model=rm), ["Anthropic/hh-rlhf"]) == []  # the RM alone
    (problem,) = data_source_problems(RewardConfig(reward_model=rm, weights={"rule": 1.0}), ["Anthropic/hh-rlhf",
                                                                                              "openai/gsm8k"])
    assert "has no reward for data_source 'Anthropic/hh-rlhf'" in problem and "gsm8k" not in problem
    assert data_source_problems(RewardConfig(weights={"rule": 1.0}, source_weights={"Anthropic/hh-rlhf": {"rule": 0}}),
                                ["Anthropic/hh-rlhf"]) == []
    assert data_source_problems(RewardConfig(fn="my.module:fn"), ["Anthropic/hh-rlhf"]) == []  # its own sources


def test_the_docs_name_the_default_function_and_what_verls_serving_keys_do():
    """Issue 51 item 18: docs/rewards.md names the default reward function the code has (it named
    rules:compute_score) and says, as the tables do, which of verl's reward-model keys load with the no-effect
    notice (it called reward_model.num_workers and reward_model.rollout.* refused) and which are refused."""
    text = " ".join((Path(ROOT) / "docs" / "rewards.md").read_text().split())
    assert f"The default, `{RewardConfig.fn}`" in text
    no_effect = text[text.index("Accepted with no effect"):text.index("Refused at load, in one line")]
    refused = text[text.index("Refused at load, in one line"):]
    refused = refused[:refused.index("verl's DAPO")]
    for key in (k for k in NO_EFFECT_KEYS if k.startswith("reward_model.")):
        assert f"`{key}`" in no_effect and f"`{key}`" not in refused, key
    for key in LEGACY_REFUSED:
        assert f"`{key}`" in refused, key


@pytest.mark.parametrize("fn", [RewardConfig.fn, "rlpad.rewards.rules:compute_score"])
def test_the_rule_scores_the_code_sources_in_set_up(fn):
    """Both built-in functions run code sources' programs (rlpad.code): set-up must not refuse them as
    unknown sources; an unknown source still is."""
    from rlpad.code.sources import SCORED_SOURCES
    from rlpad.rewards.sources import rule_scores_source

    assert all(rule_scores_source(fn, s) for s in SCORED_SOURCES)
    assert not rule_scores_source(fn, "nobody/knows")
    problems = data_source_problems(RewardConfig(fn=fn), ["rlpad/toy_code", "codecontests"])
    assert not any("has no reward for data_source" in p for p in problems), problems
