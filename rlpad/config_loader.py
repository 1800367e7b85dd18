"""Loading a :class:`~rlpad.config.Config`: YAML recipe + ``a.b.c=value`` overrides + checks.

Layers, later wins: the dataclass defaults, the recipe file, each CLI override in order.
Every key is checked against the schema first, so a typo fails with the full dotted key and a
close match; values are then merged with OmegaConf (structured config), which converts
``"16"`` to ``16`` and ``"false"`` to ``False`` and rejects what does not fit the declared type.
Finally :func:`validate_config` checks the values against each other (batch sizes, modes, ...).

Override values are read according to the field they set: ``str`` fields take the text as is,
list and section fields parse it as YAML (``data.train_files=[a.parquet,b.parquet]``), and
``null`` clears an optional field. A single string given to a list field becomes a one-item
list (``data.train_files=train.parquet``), as verl accepts.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlpad.advantages import ESTIMATORS
from rlpad.config import (
    ATTN_IMPLEMENTATIONS, BACKENDS, DEVICES, DTYPES, LOG_LEVELS, LOSS_AGG_MODES, OLD_LOG_PROB_LAYOUTS, REMOVED_KEYS,
    FILTER_METRICS, ROLLOUT_CORRECTION_MODES, TRUNCATION_MODES, Config, kl_kind,
)
from rlpad.lora import lora_value_problems, syncs_adapter
from rlpad.metrics import LOGGERS
from rlpad.parallel import role_world, sequence_parallel_problems, sp_size
from rlpad.policy_loss import policy_loss_problems
from rlpad.rollout import BACKENDS as ROLLOUT_BACKENDS, backend_class
from rlpad.rollout.tools import multi_turn_problems
from rlpad.topology import layout_problems

__all__ = [
    "config_from_dict", "config_to_dict", "load_config",
    "parse_override", "save_config", "to_yaml", "validate_config",
]


# ----------------------------------------------------------------------------- schema walking


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@cache
def _fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@cache
def _all_keys() -> tuple[str, ...]:
    """Every dotted key of the schema, sections included."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _fields(cls).items():
            out.append(prefix + name)
            if _is_section(tp):
                walk(tp, prefix + name + ".")

    walk(Config, "")
    return tuple(out)


def _suggest(key: str) -> str:
    """`` (did you mean x.y.z?)`` for the closest schema key, what replaced a removed key, or ``""``."""
    if key in REMOVED_KEYS:
        return f": it was removed; {REMOVED_KEYS[key]}"
    keys = _all_keys()
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    match = [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.7)]
    if not match:
        match = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)
    if not match:  # the right name in the wrong section: compare the last part only
        by_leaf = {k.rpartition(".")[2]: k for k in reversed(keys)}
        close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.8)
        match = [by_leaf[close[0]]] if close else []
    return f" (did you mean {match[0]}?)" if match else ""


def _annotation(key: str) -> Any:
    """The declared type of dotted ``key`` (``a.b[0]``: the list's item type); KeyError if unknown."""
    tp: Any = Config
    for part in key.split("[", 1)[0].split("."):
        if not _is_section(tp) or part not in _fields(tp):
            raise KeyError(key)
        tp = _fields(tp)[part]
    if "[" in key and typing.get_args(_unwrap_optional(tp)[0]):
        tp = typing.get_args(_unwrap_optional(tp)[0])[0]
    return tp


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if _is_section(tp):
        return f"a section ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), True
    return tp, False


def _check_keys(raw: Any, cls: type, prefix: str, source: str) -> dict[str, Any]:
    """``raw`` checked against section ``cls``: unknown keys raise; strings for list fields are wrapped."""
    where = prefix[:-1] or "the top level"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: {where} must be a mapping of keys, got {type(raw).__name__} {raw!r}")
    out: dict[str, Any] = {}
    fields = _fields(cls)
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in fields:
            raise ValueError(f"{source}: unknown config key {full!r}{_suggest(str(full))}")
        tp, _ = _unwrap_optional(fields[key])
        if _is_section(tp):
            out[key] = _check_keys(value, tp, full + ".", source)
        elif typing.get_origin(tp) is list and isinstance(value, str) and "${" not in value:
            out[key] = [value]
        elif typing.get_origin(tp) is list and isinstance(value, list | tuple) and any(
                isinstance(v, Mapping | list | tuple) for v in value):
            raise ValueError(f"{source}: config key {full!r} expects {_type_name(tp)}, got {value!r}")
        elif tp in (str, int, float, bool) and isinstance(value, Mapping | list | tuple):
            raise ValueError(f"{source}: config key {full!r} expects {_type_name(fields[key])}, got {value!r}")
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b.c=value"`` -> ``("a.b.c", value)``, the value read according to the field's type."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {text!r} is not of the form key=value (e.g. data.train_batch_size=32)")
    try:
        tp, optional = _unwrap_optional(_annotation(key))
    except KeyError:
        raise ValueError(f"override {text!r}: unknown config key {key!r}{_suggest(key)}") from None
    if optional and value.strip() in ("null", "None", "~"):
        return key, None
    if tp is str:
        return key, value
    if tp in (int, float, bool):  # OmegaConf converts the text ("16", "1e-6", "false") or rejects it
        return key, value.strip()
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ValueError(f"override {text!r}: cannot parse the value as YAML ({e.__class__.__name__})") from None


def _merge(base: Any, raw: Mapping[str, Any], source: str) -> Any:
    checked = _check_keys(raw, Config, "", source)
    try:
        return OmegaConf.merge(base, checked)
    except OmegaConfBaseException as e:
        raise _type_error(e, source, checked) from None


_MISSING = object()


def _lookup(raw: Any, key: str) -> Any:
    """The value at dotted ``key`` (with ``[i]`` indices) in nested ``raw``, or ``_MISSING``."""
    for part in key.replace("[", ".[").split("."):
        try:
            raw = raw[int(part[1:-1])] if part.startswith("[") else raw[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return _MISSING
    return raw


def _type_error(e: OmegaConfBaseException, source: str, raw: Any = None) -> ValueError:
    key = getattr(e, "full_key", None) or "?"
    try:
        expected = f"expects {_type_name(_annotation(key))}"
    except KeyError:
        expected = "is invalid"
    value = _lookup(raw, key) if raw is not None else _MISSING
    got = f"got {value!r}" if value is not _MISSING else (str(e).splitlines() or [type(e).__name__])[0]
    return ValueError(f"{source}: config key {key!r} {expected}, {got}")


def _apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    for text in overrides:
        key, value = parse_override(text)
        nested: Any = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        cfg = _merge(cfg, nested, f"override {text!r}")
    return cfg


def _finish(cfg: Any, source: str) -> Config:
    try:
        config = OmegaConf.to_object(cfg)  # resolves ${...} interpolations and checks their types
    except OmegaConfBaseException as e:
        raise _type_error(e, source) from None
    return validate_config(config)


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """The defaults, overlaid by the YAML recipe at ``path`` (optional) and ``overrides``, validated.

    Raises FileNotFoundError for a missing recipe and ValueError (naming the dotted key, with a
    close match for typos) for unknown keys, wrong types and inconsistent values.
    """
    cfg = OmegaConf.structured(Config)
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"recipe file not found: {path!r}")
        with open(path, encoding="utf-8") as f:
            try:
                raw = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {e}") from None
        cfg = _merge(cfg, raw or {}, path)
    return _finish(_apply_overrides(cfg, overrides), path or "config")


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Like :func:`load_config`, from a nested dict (e.g. :func:`config_to_dict`'s output)."""
    cfg = _merge(OmegaConf.structured(Config), data, "config dict")
    return _finish(_apply_overrides(cfg, overrides), "config dict")


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as plain nested dicts/lists (JSON/YAML-safe)."""
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    """The resolved config as YAML, loadable again with :func:`load_config`."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write :func:`to_yaml` to ``path`` (parent folders created)."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_yaml(config))


# ----------------------------------------------------------------------------- semantic checks


def _dapo_problems(config: Config) -> list[str]:
    """algorithm.filter_groups, data.gen_batch_size and reward_model.overlong_buffer (rlpad/dynamic_sampling.py)."""
    fg, d, ob = config.algorithm.filter_groups, config.data, config.reward_model.overlong_buffer
    problems = []
    if fg.metric not in FILTER_METRICS:
        problems.append(f"algorithm.filter_groups.metric={fg.metric!r} is not valid; choose one of "
                        f"{', '.join(FILTER_METRICS)}")
    if d.gen_batch_size is not None and d.gen_batch_size < 1:
        problems.append(f"data.gen_batch_size={d.gen_batch_size} must be >= 1 (or null: data.train_batch_size)")
    elif not fg.enable and d.gen_batch_size not in (None, d.train_batch_size):
        problems.append(f"data.gen_batch_size={d.gen_batch_size} differs from data.train_batch_size="
                        f"{d.train_batch_size}: generation batches of another size need "
                        "algorithm.filter_groups.enable=true (dynamic sampling)")
    k = config.trainer.max_off_policy_steps
    if fg.enable and k >= 1:
        problems.append(f"algorithm.filter_groups.enable=true is not supported with trainer.max_off_policy_steps={k}: "
                        "dynamic sampling decides how many prompts a step generates only after scoring them, so "
                        "the batches cannot be generated ahead; set max_off_policy_steps=0")
    if ob.enable:
        if not 0 < ob.len <= d.max_response_length:
            problems.append(f"reward_model.overlong_buffer.len={ob.len} must be in [1, data.max_response_length="
                            f"{d.max_response_length}]")
        if ob.penalty_factor < 0:
            problems.append(f"reward_model.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")
    return problems


def validate_config(config: Config) -> Config:
    """Check values against each other; ValueError listing every problem by its dotted key."""
    problems: list[str] = []
    d, arr, alg = config.data, config.actor_rollout_ref, config.algorithm
    actor, rollout, ref, critic, trainer = arr.actor, arr.rollout, arr.ref, config.critic, config.trainer

    def one_of(key: str, value: Any, choices: Sequence[str]) -> None:
        if value not in choices:
            problems.append(f"{key}={value!r} is not valid; choose one of {', '.join(choices)}")

    def positive(key: str, value: float | None, optional: bool = False) -> None:
        if value is None and optional:
            return
        if value is None or value <= 0:
            problems.append(f"{key}={value!r} must be > 0")

    one_of("algorithm.adv_estimator", alg.adv_estimator, list(ESTIMATORS))
    estimator = ESTIMATORS.get(alg.adv_estimator)
    uses_critic = estimator is not None and estimator.uses_critic
    one_of("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    one_of("critic.loss_agg_mode", critic.loss_agg_mode, LOSS_AGG_MODES)
    problems += policy_loss_problems(actor)
    for key, kind in (("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type),
                      ("algorithm.kl_penalty", alg.kl_penalty)):
        try:
            kl_kind(kind)
        except ValueError as e:
            problems.append(f"{key}={kind!r}: {e}")
    one_of("data.truncation", d.truncation, TRUNCATION_MODES)
    one_of("actor_rollout_ref.rollout.name", rollout.name, list(ROLLOUT_BACKENDS))
    for key, dt in (("actor_rollout_ref.model.dtype", arr.model.dtype), ("critic.model.dtype", critic.model.dtype),
                    ("actor_rollout_ref.rollout.dtype", rollout.dtype)):
        one_of(key, dt, list(DTYPES))
    for key, mcfg in (("actor_rollout_ref.model", arr.model), ("critic.model", critic.model)):
        if mcfg.share_prompts and not mcfg.use_remove_padding:
            problems.append(f"{key}.share_prompts=true needs {key}.use_remove_padding=true "
                            "(the shared prompt lives in the packed row)")
        if mcfg.share_prompts_min_saved_fraction is not None and not 0 <= mcfg.share_prompts_min_saved_fraction <= 1:
            problems.append(f"{key}.share_prompts_min_saved_fraction={mcfg.share_prompts_min_saved_fraction!r} must be "
                            "a fraction in [0, 1] (of a micro-batch's valid tokens that sharing saves)")
    one_of("trainer.device", trainer.device, DEVICES)
    one_of("trainer.backend", trainer.backend, BACKENDS)
    one_of("trainer.log_level", trainer.log_level, LOG_LEVELS)
    models = [("actor_rollout_ref.model", arr.model)] + ([("critic.model", critic.model)] if uses_critic else [])
    for key, model in models:
        one_of(f"{key}.attn_implementation", model.attn_implementation, ATTN_IMPLEMENTATIONS)
        if model.attn_implementation == "sdpa" and model.use_remove_padding:
            problems.append(f"{key}.attn_implementation=sdpa runs the padded path only; set {key}.use_remove_padding=false "
                            "or choose auto / rlpad_varlen / flash_attention_2")
    one_of("algorithm.rollout_correction.mode", alg.rollout_correction.mode, ROLLOUT_CORRECTION_MODES)
    if not alg.rollout_correction.threshold > 1.0:
        problems.append(f"algorithm.rollout_correction.threshold={alg.rollout_correction.threshold!r} must be > 1 "
                        "(token_tis caps weights at it, seq_mask keeps geometric-mean ratios in [1/C, C])")
    k = trainer.max_off_policy_steps
    if k < 0:
        problems.append(f"trainer.max_off_policy_steps={k} must be >= 0 (0: synchronous training)")
    elif k >= 1 and alg.rollout_correction.mode == "none":
        problems.append(f"trainer.max_off_policy_steps={k} trains on batches up to {k} update(s) old: set "
                        "algorithm.rollout_correction.mode to token_tis or seq_mask to correct for the policy that "
                        "generated them (the behaviour policy, rollout_log_probs)")
    problems += _dapo_problems(config)
    one_of("actor_rollout_ref.actor.old_log_prob_layout", actor.old_log_prob_layout, OLD_LOG_PROB_LAYOUTS)
    for name in trainer.logger:
        one_of("trainer.logger[]", name, LOGGERS)
    if ":" not in config.reward.fn and "." not in config.reward.fn:
        problems.append(f"reward.fn={config.reward.fn!r} must be 'package.module:function'")
    problems += multi_turn_problems(rollout.multi_turn)

    # sizes
    if rollout.n < 1:
        problems.append(f"actor_rollout_ref.rollout.n={rollout.n} must be >= 1")
    elif estimator is not None and rollout.n < estimator.min_group_size:
        others = [name for name, e in ESTIMATORS.items() if e.min_group_size <= rollout.n]
        problems.append(f"actor_rollout_ref.rollout.n={rollout.n}: {estimator.needs} and needs "
                        f"n >= {estimator.min_group_size} (or use algorithm.adv_estimator={' | '.join(others)})")
    if rollout.val_kwargs.n < 1:
        problems.append(f"actor_rollout_ref.rollout.val_kwargs.n={rollout.val_kwargs.n} must be >= 1")
    if rollout.tensor_model_parallel_size < 1:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} "
                        "must be >= 1")
    problems += layout_problems(config)
    problems += lora_value_problems(config)
    if syncs_adapter(config) and rollout.name in ROLLOUT_BACKENDS and not backend_class(rollout.name).serves_lora:
        problems.append(f"actor_rollout_ref.rollout.lora_sync=adapter needs a rollout backend that serves LoRA "
                        f"adapters; actor_rollout_ref.rollout.name={rollout.name} does not (use lora_sync=merged)")
    positive("actor_rollout_ref.rollout.weight_sync_bucket_mb", rollout.weight_sync_bucket_mb)
    for key, value, optional in (
        ("data.train_batch_size", d.train_batch_size, False),
        ("data.val_batch_size", d.val_batch_size, True),
        ("data.max_prompt_length", d.max_prompt_length, False),
        ("data.max_response_length", d.max_response_length, False),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size, False),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu, True),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu, False),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs, False),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", rollout.log_prob_micro_batch_size_per_gpu, True),
        ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu, False),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", ref.log_prob_micro_batch_size_per_gpu, True),
        ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu, False),
        ("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size, False),
        ("critic.ppo_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu, True),
        ("critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu, False),
        ("critic.ppo_epochs", critic.ppo_epochs, False),
        ("trainer.total_training_steps", trainer.total_training_steps, True),
        ("trainer.total_epochs", trainer.total_epochs, False),
        ("trainer.n_gpus_per_node", trainer.n_gpus_per_node, False),
        ("trainer.nnodes", trainer.nnodes, False),
        ("actor_rollout_ref.rollout.temperature", rollout.temperature, False),
        ("actor_rollout_ref.actor.clip_ratio", actor.clip_ratio, False),
    ):
        positive(key, value, optional)
    if not 0 < rollout.top_p <= 1:
        problems.append(f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        problems.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} "
                        "must be in (0, 1]")
    if actor.optim.lr < 0 or critic.optim.lr < 0:
        problems.append("optim.lr must be >= 0")

    # batch arithmetic (verl semantics: mini-batch sizes count prompts, rollout.n responses each); a
    # mini-batch splits over the data-parallel groups (ranks / sequence-parallel size, rlpad.parallel)
    problems += sequence_parallel_problems(config)
    world = role_world(config)
    n = max(rollout.n, 1)
    sections = [("actor_rollout_ref.actor", arr, "actor")] + ([("critic", critic, "critic")] if uses_critic else [])
    for key, section, role in sections:
        mini = (actor if role == "actor" else critic).ppo_mini_batch_size
        sp = sp_size(section, role)
        dp = world // sp if sp >= 1 and world % sp == 0 else world
        if d.train_batch_size <= 0 or mini <= 0:
            continue
        if (d.train_batch_size * n) % (mini * n):
            problems.append(
                f"data.train_batch_size={d.train_batch_size} (x rollout.n={n} = {d.train_batch_size * n} responses) "
                f"must be divisible by {key}.ppo_mini_batch_size={mini} (x n = {mini * n})")
        elif (mini * n) % dp:
            groups = (f"{world} ranks / {key}.ulysses_sequence_parallel_size={sp}" if dp != world
                      else "trainer.n_gpus_per_node x trainer.nnodes")
            problems.append(f"{key}.ppo_mini_batch_size={mini} x rollout.n={n} = {mini * n} responses must split "
                            f"evenly over {dp} workers ({groups})")

    if problems:
        raise ValueError("invalid config:\n  " + "\n  ".join(problems))
    return config
