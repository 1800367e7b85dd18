"""reward.* keys: verl 0.9's names, verl's legacy names mapped as its migration does, refusals in one line."""

import pytest

from rlpad.config.verl_keys import LEGACY_KEYS, LEGACY_REFUSED
from rlpad.recipe.load import config_from_dict, load_config


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
    (["reward.extra_fns={rule: a:b}"], "names 'rule' and 'reward_model' are taken"),
    (["reward.reward_kwargs={overlong_buffer_cfg: {enable: true}}"], "reward_model.overlong_buffer"),
    (["reward.reward_model.dtype=int8"], "reward.reward_model.dtype='int8'"),
])
def test_reward_problems(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)
