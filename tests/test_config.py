"""Config loading: recipe YAML + overrides, key/type errors naming the key, semantic checks."""

from __future__ import annotations

import dataclasses
import os
import types
import typing

import pytest

from rlpad.config.schema import Config
from rlpad.recipe.load import (
    config_from_dict, config_to_dict, load_config, parse_override, save_config, to_yaml,
)

RECIPE = os.path.join(os.path.dirname(__file__), "fixtures", "grpo_recipe.yaml")
GRPO = ["actor_rollout_ref.rollout.n=2"]  # the bare defaults are GRPO with n=1, which is rejected


def test_recipe_merges_onto_defaults():
    cfg = load_config(RECIPE)
    assert isinstance(cfg, Config)
    assert cfg.data.train_files == ["data/toy/train.parquet"]
    assert cfg.data.val_files == ["data/toy/val.parquet"]
    assert cfg.data.train_batch_size == 8
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-4)
    assert isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.trainer.default_local_dir == "outputs/toy"  # interpolation resolved
    # untouched keys keep the dataclass defaults
    assert cfg.actor_rollout_ref.actor.clip_ratio == Config().actor_rollout_ref.actor.clip_ratio
    assert cfg.critic == Config().critic


def test_overrides_win_and_are_typed():
    cfg = load_config(RECIPE, [
        "actor_rollout_ref.model.use_remove_padding=false",
        "data.train_files=[a.parquet,b.parquet]",
        "data.val_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "trainer.experiment_name=no",  # a str field keeps the text ("no" is not False)
        "reward.fn=my_pkg.rewards:score",
        "trainer.total_training_steps=null",
        "actor_rollout_ref.actor.optim={lr: 0.5, weight_decay: 0.0}",
    ])
    assert cfg.actor_rollout_ref.model.use_remove_padding is False
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.data.val_batch_size == 4
    assert cfg.trainer.experiment_name == "no"
    assert cfg.trainer.default_local_dir == "outputs/no"
    assert cfg.reward.fn == "my_pkg.rewards:score"
    assert cfg.trainer.total_training_steps is None
    assert cfg.actor_rollout_ref.actor.optim.lr == 0.5 and cfg.actor_rollout_ref.actor.optim.weight_decay == 0.0
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.9, 0.999]  # section override merges, not replaces


def test_no_recipe_uses_defaults():
    cfg = load_config(None, GRPO)
    assert cfg.data == Config().data


def test_a_load_leaves_the_next_load_its_defaults():
    """Loads share one defaults tree built per process: a load (also one that fails half way) must not
    change what the next load starts from."""
    load_config(RECIPE, ["data.train_files=[leak.parquet]", "actor_rollout_ref.actor.optim.betas=[0.5, 0.5]"])
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        config_from_dict({"critic": {"loss_agg_mode": "token-mean"}},
                         ["data.val_files=[leak.parquet]", "data.max_prompt_length=x"])
    assert load_config(None, GRPO).data == Config().data
    assert config_from_dict({}, GRPO).actor_rollout_ref == dataclasses.replace(
        Config().actor_rollout_ref, rollout=dataclasses.replace(Config().actor_rollout_ref.rollout, n=2))


def test_parse_override():
    assert parse_override("data.train_batch_size=32") == ("data.train_batch_size", "32")
    assert parse_override("data.val_files=[x.jsonl]") == ("data.val_files", ["x.jsonl"])
    assert parse_override("actor_rollout_ref.model.path=tiny:qwen2") == ("actor_rollout_ref.model.path", "tiny:qwen2")
    assert parse_override("data.val_batch_size=null") == ("data.val_batch_size", None)
    with pytest.raises(ValueError, match="key=value"):
        parse_override("data.train_batch_size")


@pytest.mark.parametrize("override, wanted", [
    ("actor_rollout_ref.actor.ppo_mini_batchsize=4", "did you mean actor_rollout_ref.actor.ppo_mini_batch_size?"),
    ("actor_rollout_ref.ppo_mini_batch_size=4", "did you mean actor_rollout_ref.actor.ppo_mini_batch_size?"),
    ("data.train_batch=4", "did you mean data.train_batch_size?"),
    ("algorithm.adv_estimater=gae", "did you mean algorithm.adv_estimator?"),
])
def test_unknown_override_key_suggests(override, wanted):
    with pytest.raises(ValueError) as e:
        load_config(RECIPE, [override])
    assert repr(override.split("=")[0]) in str(e.value) and wanted in str(e.value)


def test_unknown_key_in_recipe(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    n: 4\n    temprature: 0.7\n")
    with pytest.raises(ValueError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "'actor_rollout_ref.rollout.temprature'" in msg
    assert "did you mean actor_rollout_ref.rollout.temperature?" in msg


@pytest.mark.parametrize("override, key, expected", [
    ("data.train_batch_size=abc", "data.train_batch_size", "expects int, got 'abc'"),
    ("data.train_batch_size=1.5", "data.train_batch_size", "expects int"),
    ("actor_rollout_ref.model.use_remove_padding=maybe", "actor_rollout_ref.model.use_remove_padding", "expects bool"),
    ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr", "expects float"),
    ("data.max_prompt_length=null", "data.max_prompt_length", "expects int"),
    ("data.train_files=[a,{b: 1}]", "data.train_files", "expects a list of str"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,x]", "actor_rollout_ref.actor.optim.betas[1]", "expects float"),
    ("actor_rollout_ref.actor=3", "actor_rollout_ref.actor", "must be a mapping"),
])
def test_wrong_type_names_the_key(override, key, expected):
    with pytest.raises(ValueError) as e:
        load_config(RECIPE, [override])
    assert key in str(e.value) and expected in str(e.value)


def _leaf_keys(want) -> list[str]:
    """Every dotted leaf key of the schema whose declared type (``X | None`` unwrapped) passes ``want``."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in typing.get_type_hints(cls).items():
            if typing.get_origin(tp) in (typing.Union, types.UnionType):
                tp = next(a for a in typing.get_args(tp) if a is not type(None))
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")
            elif want(tp):
                out.append(prefix + name)

    walk(Config, "")
    return out


LIST_KEYS = _leaf_keys(lambda tp: typing.get_origin(tp) is list)
STR_KEYS = _leaf_keys(lambda tp: tp is str)


def _one_line_error(override: str, key: str, capsys) -> None:
    """``override`` fails at load naming ``key`` in one line, and ``python -m rlpad.train`` exits 2 with
    that one ``error:`` line (no traceback)."""
    from rlpad.train import main

    with pytest.raises(ValueError) as e:
        load_config(RECIPE, [override])
    assert f"config key {key!r} expects" in str(e.value) and "\n" not in str(e.value)
    assert main(["--config", RECIPE, override]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and key in err[0], err


def test_the_key_lists_are_the_schema():
    assert {"data.train_files", "data.val_files", "trainer.logger", "actor_rollout_ref.actor.optim.betas",
            "actor_rollout_ref.rollout.multi_turn.tools"} <= set(LIST_KEYS)
    assert {"trainer.resume_mode", "data.truncation", "reward.fn", "actor_rollout_ref.model.path"} <= set(STR_KEYS)
    assert not set(LIST_KEYS) & set(STR_KEYS)


@pytest.mark.parametrize("key", LIST_KEYS)
def test_a_mapping_for_a_list_key_is_a_one_line_error(key, capsys):
    _one_line_error(f"{key}={{a: 1}}", key, capsys)


@pytest.mark.parametrize("key", STR_KEYS)
def test_a_list_or_mapping_for_a_string_key_is_a_one_line_error(key, capsys):
    _one_line_error(f"{key}=[1, 2]", key, capsys)
    _one_line_error(f"{key}={{a: 1}}", key, capsys)


def test_list_and_string_keys_still_take_their_values():
    """Negative control for the two tests above: the same keys take a list and a string."""
    cfg = load_config(RECIPE, ["data.train_files=[a.parquet, b.parquet]", "trainer.resume_mode=disable",
                               "trainer.experiment_name=[run", "trainer.project_name=x]"])
    assert cfg.data.train_files == ["a.parquet", "b.parquet"] and cfg.trainer.resume_mode == "disable"
    assert cfg.trainer.experiment_name == "[run" and cfg.trainer.project_name == "x]"  # not YAML: text as is


def test_wrong_type_in_recipe(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    n: 4\ndata:\n  max_response_length: [1, 2]\n")
    with pytest.raises(ValueError, match=r"'data.max_response_length' expects int, got \[1, 2\]"):
        load_config(path)
    path.write_text("data:\n  truncation: {mode: left}\n")
    with pytest.raises(ValueError, match=r"'data.truncation' expects str"):
        load_config(path)
    path.write_text("data:\n  max_prompt_length: 12.5\n")
    with pytest.raises(ValueError, match=r"'data.max_prompt_length' expects int, got 12.5"):
        load_config(path)


def test_missing_or_malformed_recipe(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("data: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


@pytest.mark.parametrize("overrides, wanted", [
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo' is not valid; choose one of grpo, gae, reinforce_plus_plus, "),
    (["actor_rollout_ref.actor.loss_agg_mode=mean"], "actor_rollout_ref.actor.loss_agg_mode='mean'"),
    (["actor_rollout_ref.actor.kl_loss_type=k9"], "actor_rollout_ref.actor.kl_loss_type='k9'"),
    (["algorithm.kl_penalty=kl2"], "algorithm.kl_penalty='kl2'"),
    (["data.truncation=middle"], "data.truncation='middle' is not valid; choose one of error, left, right"),
    (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name='sglang'"),
    (["actor_rollout_ref.rollout.n=1"], "GRPO compares responses within a group and needs n >= 2"),
    (["actor_rollout_ref.rollout.n=0", "algorithm.adv_estimator=gae"], "actor_rollout_ref.rollout.n=0 must be >= 1"),
    (["data.train_batch_size=0"], "data.train_batch_size=0 must be > 0"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=-2"], "actor_rollout_ref.actor.ppo_mini_batch_size=-2 must be > 0"),
    (["data.val_batch_size=0"], "data.val_batch_size=0 must be > 0"),
    (["data.train_batch_size=6"], "must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size=4"),
    (["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"], "critic.ppo_mini_batch_size=3"),
    (["trainer.n_gpus_per_node=3"], "must split evenly over 3 workers"),
    (["actor_rollout_ref.rollout.temperature=0"], "actor_rollout_ref.rollout.temperature=0.0 must be > 0"),
    (["actor_rollout_ref.rollout.top_p=1.5"], "top_p=1.5 must be in (0, 1]"),
    (["trainer.logger=[console,wandbb]"], "'wandbb' is not valid"),
    (["actor_rollout_ref.model.dtype=float64"], "actor_rollout_ref.model.dtype='float64'"),
    (["actor_rollout_ref.rollout.num_replicas=0"], "actor_rollout_ref.rollout.num_replicas=0 must be >= 1"),
    (["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.num_replicas=2"],
     "hf backend seeds a whole generate call"),
    (["trainer.backend=local", "actor_rollout_ref.rollout.num_replicas=2"], "trainer.backend=local runs one rollout"),
    (["actor_rollout_ref.rollout.weight_sync_bucket_mb=0"], "weight_sync_bucket_mb=0.0 must be > 0"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=0"], "tensor_model_parallel_size=0 must be >= 1"),
    (["actor_rollout_ref.rollout.max_num_batched_tokens=32"], "actor_rollout_ref.rollout.max_num_batched_tokens=32 "
     "must be >= actor_rollout_ref.rollout.max_num_seqs=256"),  # vLLM's pydantic traceback before (issue 59)
    (["actor_rollout_ref.rollout.max_num_seqs=0"], "actor_rollout_ref.rollout.max_num_seqs=0 must be > 0"),
    (["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "algorithm.filter_groups.enable=true"],
     "algorithm.filter_groups.enable=true needs actor_rollout_ref.rollout.n >= 2"),
    (["trainer.critic_warmup=-1"], "trainer.critic_warmup=-1 must be >= 0"),
    (["actor_rollout_ref.rollout.mode=asyn"], "actor_rollout_ref.rollout.mode='asyn' is not valid; choose one of sync, async"),
    (["trainer.critic_warmup=2"], "algorithm.adv_estimator=grpo has no critic: nothing would train"),
])
def test_semantic_checks(overrides, wanted):
    with pytest.raises(ValueError) as e:
        load_config(RECIPE, overrides)
    assert wanted in str(e.value)


def test_filter_groups_and_critic_warmup_load_where_they_mean_something():
    """Negative controls of the three checks above: n = 2 filters, a critic warms up."""
    ppo = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4"]
    cfg = load_config(RECIPE, [*ppo, "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=true",
                               "trainer.critic_warmup=2"])
    assert cfg.algorithm.filter_groups.enable and cfg.trainer.critic_warmup == 2
    load_config(RECIPE, [*ppo, "actor_rollout_ref.rollout.n=1"])  # no filter: n = 1 is fine
    assert load_config(RECIPE, ["trainer.critic_warmup=1"]).trainer.critic_warmup == 1  # GRPO: 1 = from step 1
    budget = ["actor_rollout_ref.rollout.max_num_batched_tokens=32", "actor_rollout_ref.rollout.max_num_seqs=32"]
    assert load_config(RECIPE, budget).actor_rollout_ref.rollout.max_num_batched_tokens == 32  # = max_num_seqs: fine


def test_all_problems_reported_at_once():
    with pytest.raises(ValueError) as e:
        load_config(RECIPE, ["algorithm.adv_estimator=ppo", "data.truncation=middle"])
    assert "algorithm.adv_estimator" in str(e.value) and "data.truncation" in str(e.value)


def test_valid_variants():
    load_config(RECIPE, ["actor_rollout_ref.actor.kl_loss_type=k3+", "algorithm.adv_estimator=gae",
                         "actor_rollout_ref.rollout.n=1", "critic.ppo_mini_batch_size=8", "data.truncation=left",
                         "actor_rollout_ref.rollout.name=hf"])


def test_yaml_round_trip(tmp_path):
    cfg = load_config(RECIPE, ["data.seed=7", "data.val_batch_size=4"])
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert "ppo_mini_batch_size: 4" in to_yaml(cfg)
    assert config_to_dict(cfg)["actor_rollout_ref"]["rollout"]["n"] == 4


def test_rollout_replicas_default_and_explicit():
    from rlpad.topology import rollout_replicas

    cfg = load_config(RECIPE, ["trainer.n_gpus_per_node=4", "trainer.nnodes=2",
                               "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert rollout_replicas(cfg, cuda=True) == 4  # 8 rollout GPUs / TP 2
    assert rollout_replicas(cfg, cuda=False) == 1
    cfg = load_config(RECIPE, ["actor_rollout_ref.rollout.num_replicas=3"])
    assert rollout_replicas(cfg, cuda=False) == rollout_replicas(cfg, cuda=True) == 3
    assert load_config(RECIPE).actor_rollout_ref.rollout.weight_sync_bucket_mb == 512


@pytest.mark.parametrize("overrides, wanted", [
    (["trainer.colocate=true", "trainer.backend=local"], "trainer.colocate=true places Ray actors on a shared pool"),
    (["trainer.colocate=true", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "supports actor_rollout_ref.rollout.tensor_model_parallel_size=1 only (got 2)"),
    (["trainer.colocate=true", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.num_replicas=1"],
     "num_replicas=1: with trainer.colocate=true every bundle of the pool hosts one engine, so it must be null or 2"),
    (["trainer.colocate=true", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=hf"],
     "the hf backend cannot be split into replicas"),
    (["trainer.colocate=false", "actor_rollout_ref.actor.fsdp_config.param_offload=true"],
     "param_offload / optimizer_offload need trainer.colocate=true"),
])
def test_colocate_config_errors(overrides, wanted):
    with pytest.raises(ValueError) as e:
        load_config(RECIPE, overrides)
    assert wanted in str(e.value)


def test_colocate_default_and_replicas():
    from rlpad.topology import colocated, rollout_replicas

    cfg = load_config(RECIPE, ["trainer.n_gpus_per_node=4", "trainer.nnodes=2"])
    assert cfg.trainer.colocate is None
    assert colocated(cfg, cuda=True) and not colocated(cfg, cuda=False)  # auto: CUDA only
    assert rollout_replicas(cfg, cuda=True) == 8  # one engine per bundle of the 8-bundle pool
    tp = load_config(RECIPE, ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert not colocated(tp, cuda=True)  # auto never picks a layout it cannot build
    forced = load_config(RECIPE, ["trainer.colocate=true", "trainer.n_gpus_per_node=2"])
    assert colocated(forced, cuda=False) and rollout_replicas(forced, cuda=False) == 2
    offload = load_config(RECIPE, ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])  # colocate: auto
    assert colocated(offload, cuda=True)
    with pytest.raises(ValueError, match="need trainer.colocate=true"):
        colocated(offload, cuda=False)  # auto resolves to false on CPU: the offload would do nothing


def test_loading_a_config_stays_torch_free():
    """The registries the checks read (rollout backends, estimators) import their torch side lazily."""
    import subprocess
    import sys

    code = ("import sys; from rlpad.recipe.load import load_config; "
            f"load_config({RECIPE!r}, ['algorithm.adv_estimator=gae', 'critic.ppo_mini_batch_size=4', 'trainer.colocate=false']); "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "[]", out.stdout


def test_dtype_names_are_defined_once():
    import torch

    from rlpad.config.choices import DTYPES
    from rlpad.core.models import DTYPES as TORCH_DTYPES, parse_dtype

    assert list(TORCH_DTYPES) == list(DTYPES)
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("fp32") is torch.float32
    assert set(DTYPES.values()) == {"float32", "bfloat16", "float16"}  # what vLLM's dtype accepts
    with pytest.raises(ValueError, match="rollout.dtype='float64' is not valid; choose one of float32, fp32, bfloat16"):
        load_config(RECIPE, ["actor_rollout_ref.rollout.dtype=float64"])


def test_offload_without_colocation_fails_at_load_when_the_device_is_known():
    with pytest.raises(ValueError, match="param_offload / optimizer_offload need trainer.colocate=true"):
        load_config(RECIPE, ["trainer.device=cpu", "actor_rollout_ref.actor.fsdp_config.param_offload=true"])
    load_config(RECIPE, ["trainer.device=cuda", "actor_rollout_ref.actor.fsdp_config.param_offload=true"])  # colocated on CUDA
    load_config(RECIPE, ["trainer.device=auto", "actor_rollout_ref.actor.fsdp_config.param_offload=true"])  # decided at launch


def test_warm_start_cache_is_per_user_not_the_working_dir(monkeypatch, tmp_path):
    """The driver's warm start must not land in the working dir (Ray's package under `ray job submit`)."""
    from rlpad.config.schema import SFTConfig
    from rlpad.embedded.cache import cache_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "/srv/cache")
    assert cache_root(SFTConfig()) == "/srv/cache/rlpad"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", "/home/someone")
    assert cache_root(SFTConfig()) == "/home/someone/.cache/rlpad"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root(SFTConfig()) == "/home/someone/.cache/rlpad"
    assert cache_root(SFTConfig(cache_dir="~/c")) == "/home/someone/c"
    assert cache_root(SFTConfig(cache_dir="here")) == str(tmp_path / "here")  # explicit relative: the working dir
    assert load_config(RECIPE).sft.cache_dir is None


# ----------------------------------------------------------------------------- every key does something


def _sections() -> dict[type, set[str]]:
    """Each config dataclass -> the attribute names it lives under (``OptimConfig`` -> {"optim"})."""
    import dataclasses
    import typing

    out: dict[type, set[str]] = {Config: {"config"}}

    def walk(cls: type) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                out.setdefault(tp, set()).add(f.name)
                walk(tp)

    walk(Config)
    return out


def _section_paths() -> dict[type, set[str]]:
    """Each config dataclass -> the dotted paths it lives at (``RefFSDPConfig`` -> {"actor_rollout_ref.ref.fsdp_config"})."""
    import dataclasses
    import typing

    out: dict[type, set[str]] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                out.setdefault(tp, set()).add(prefix + f.name)
                walk(tp, prefix + f.name + ".")

    walk(Config, "")
    return out


def _field_reads(path: str, sections: dict[type, set[str]], functions_only: bool) -> set[tuple[str, str]]:
    """``(section class name, field)`` for every read ``<section>.field`` in the file at ``path``.

    A section is an attribute chain ending in its name (``config.trainer.seed``, ``self.config.rollout.n``),
    a name assigned from one in the same function (``t = config.trainer``; ``t.seed``) or a parameter
    annotated with its class (``cfg: OptimConfig``; ``cfg.lr``; a worker's ``config: CriticConfig``
    also types its ``self.config``). ``functions_only``: reads inside function bodies only.
    """
    import ast

    by_attr: dict[str, set[str]] = {}  # one name may be several sections (model: ModelConfig or CriticModelConfig; reward_model, reward.reward_model)
    for cls, attrs in sections.items():
        for attr in attrs:
            by_attr.setdefault(attr, set()).add(cls.__name__)
    names = {cls.__name__ for cls in sections}
    tree = ast.parse(open(path, encoding="utf-8").read())

    def annotated(arg: ast.arg) -> set[str]:
        hint = ast.unparse(arg.annotation).replace("|", " ").split() if arg.annotation is not None else []
        return names & set(hint)

    config_types = {c for n in ast.walk(tree) if isinstance(n, ast.arg) and n.arg == "config" for c in annotated(n)}
    if config_types:  # this file's workers keep their ``config`` parameter as ``self.config``
        by_attr["config"] = config_types

    def scope_reads(scope: ast.AST) -> set[tuple[str, str]]:
        bound: dict[str, set[str]] = {}

        def section_of(node: ast.AST) -> set[str]:
            if isinstance(node, ast.Attribute):
                return by_attr.get(node.attr, set())
            return bound.get(node.id, set()) if isinstance(node, ast.Name) else set()

        nodes = list(ast.walk(scope))
        for node in nodes:  # bindings first
            if isinstance(node, ast.arg) and annotated(node):
                bound.setdefault(node.arg, set()).update(annotated(node))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                             and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                    for t, v in pairs:
                        if isinstance(t, ast.Name) and section_of(v):
                            bound.setdefault(t.id, set()).update(section_of(v))
        return {(cls, node.attr) for node in nodes if isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load) for cls in section_of(node.value)}

    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    reads = set().union(*map(scope_reads, functions)) if functions else set()
    if not functions_only:
        module = ast.Module(body=[n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)],
                            type_ignores=[])
        reads |= scope_reads(module)
    return reads


def test_every_config_field_is_read_somewhere():
    """A config key that nothing reads does nothing (trainer.seed, sft.enable and
    optim.total_training_steps once did): every field of every section must be read as
    ``<section>.<field>`` in rlpad/ or workers/ outside the schema's definitions and outside
    rlpad/recipe/ (loading or checking a value is not using it). The exceptions are the verl keys of
    NO_EFFECT_KEYS, whose only effect is the start-up warning naming them."""
    import dataclasses
    import glob
    import typing

    from rlpad.config.verl_keys import NO_EFFECT_KEYS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sections = _sections()
    reads: set[tuple[str, str]] = set()
    for path in glob.glob(os.path.join(root, "rlpad", "**", "*.py"), recursive=True) + \
            glob.glob(os.path.join(root, "workers", "**", "*.py"), recursive=True):
        if os.path.join("rlpad", "recipe", "") in path:
            continue
        reads |= _field_reads(path, sections, functions_only=os.path.join("rlpad", "config", "") in path)
    unread = [f"{'/'.join(sorted(sections[cls]))}.{name}" for cls in sections if cls is not Config
              for name, tp in typing.get_type_hints(cls).items()
              if not dataclasses.is_dataclass(tp)  # a read typed as a base class (ModelConfig) serves its subclasses
              and not any((base.__name__, name) in reads for base in cls.__mro__)
              and not all(f"{path}.{name}" in NO_EFFECT_KEYS for path in _section_paths()[cls])]
    assert unread == [], f"config fields read nowhere: {unread}"


def test_field_reads_resolve_sections(tmp_path):
    """The scanner above sees a read through a chain, an alias and an annotated parameter, and
    not a same-named attribute of something else (negative control)."""
    src = tmp_path / "m.py"
    src.write_text("def f(config, cfg: OptimConfig, other):\n"
                   "    t = config.trainer\n"
                   "    return t.seed, config.data.shuffle, cfg.lr, other.seed, other.total_epochs\n")
    reads = _field_reads(str(src), _sections(), functions_only=False)
    assert {("TrainerConfig", "seed"), ("DataConfig", "shuffle"), ("OptimConfig", "lr")} <= reads
    assert ("TrainerConfig", "total_epochs") not in reads and not any(f == "seed" and s != "TrainerConfig"
                                                                      for s, f in reads)


def test_removed_key_names_its_replacement(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("sft:\n  enable: true\n")
    for call in (lambda: load_config(recipe), lambda: load_config(None, ["sft.enable=true"])):
        with pytest.raises(ValueError, match=r"'sft.enable': it was removed; the supervised warm start runs whenever "
                                             r"a model path is embedded:<task>"):
            call()


def test_warmup_ratio_needs_the_horizon():
    from rlpad.config.schema import OptimConfig
    from workers.optim import warmup_steps

    assert warmup_steps(OptimConfig(lr_warmup_steps_ratio=0.29, total_training_steps=100)) == 29
    assert warmup_steps(OptimConfig(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5, total_training_steps=100)) == 3
    with pytest.raises(ValueError, match="lr_warmup_steps_ratio=0.5 needs optim.total_training_steps > 0"):
        warmup_steps(OptimConfig(lr_warmup_steps_ratio=0.5))


SP = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


@pytest.mark.parametrize("overrides, wanted", [
    ([f"{SP}=2", "trainer.n_gpus_per_node=3"], f"{SP}=2 must divide the actor's ranks: the actor group has 3 ranks"),
    ([f"{SP}=2", "trainer.backend=local"], "trainer.backend=local runs one rank"),
    ([f"{SP}=2", "trainer.n_gpus_per_node=1", "trainer.nnodes=2"],  # divides the world (2), not a node
     f"{SP}=2 must divide trainer.n_gpus_per_node=1: a group of 2 ranks would span nodes (2 nodes)"),
    ([f"{SP}=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=false"],
     f"{SP}=2 needs actor_rollout_ref.model.use_remove_padding=true"),
    ([f"{SP}=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.model.attn_implementation=flash_attention_2"],
     "needs actor_rollout_ref.model.attn_implementation auto or rlpad_varlen"),
    ([f"{SP}=4", "trainer.n_gpus_per_node=4"],  # tiny:qwen2 has 2 query heads
     f"{SP}=4 must divide the query heads of actor_rollout_ref.model.path='tiny:qwen2': 2"),
    ([f"{SP}=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=0"],
     "actor_rollout_ref.ref.ulysses_sequence_parallel_size=0 must be >= 1"),
    (["critic.ulysses_sequence_parallel_size=2", "algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=4",
      "critic.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1"],
     "critic.ppo_mini_batch_size=1 x rollout.n=1 = 1 responses must split evenly over 2 workers "
     "(4 ranks / critic.ulysses_sequence_parallel_size=2)"),
])
def test_sequence_parallel_config_errors(overrides, wanted):
    with pytest.raises(ValueError) as e:
        load_config(RECIPE, overrides)
    assert wanted in str(e.value)


def test_sequence_parallel_sizes_per_role(tmp_path):
    """The reference follows the actor unless set; the mini-batch splits over world / sp groups; the
    query heads of a model folder come from its config.json (no torch)."""
    from rlpad.parallel import attention_heads, sp_size

    cfg = load_config(RECIPE, [f"{SP}=2", "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                               "data.train_batch_size=2"])  # 4 responses per mini-batch over 2 groups
    arr = cfg.actor_rollout_ref
    assert (sp_size(arr, "actor"), sp_size(arr, "ref"), sp_size(cfg.critic, "critic")) == (2, 2, 1)
    arr.ref.ulysses_sequence_parallel_size = 1
    assert sp_size(arr, "ref") == 1
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 2}')
    assert attention_heads(str(folder)) == (6, 2) and attention_heads("embedded:toy") == (2, 1)
    with pytest.raises(ValueError, match=f"{SP}=4 must divide the query heads of actor_rollout_ref.model.path=.*: 6"):
        load_config(RECIPE, [f"{SP}=4", "trainer.n_gpus_per_node=4", f"actor_rollout_ref.model.path={folder}"])
    load_config(RECIPE, [f"{SP}=2", "trainer.n_gpus_per_node=2", "trainer.nnodes=2"])  # a group within each node
    (folder / "config.json").write_text('{"num_attention_heads": 8, "num_key_value_heads": 2}')
    load_config(RECIPE, [f"{SP}=4", "trainer.n_gpus_per_node=4", f"actor_rollout_ref.model.path={folder}"])
