"""Loading a :class:`~rlpad.config.schema.Config`: YAML recipe + ``a.b.c=value`` overrides + checks.

Layers, later wins: the dataclass defaults, the recipe file, each CLI override in order.
Every key is checked against the schema first, so a typo fails with the full dotted key and a
close match; values are then merged with OmegaConf (structured config), which converts
``"16"`` to ``16`` and ``"false"`` to ``False`` and rejects what does not fit the declared type.
Finally :func:`rlpad.recipe.checks.validate_config` checks the values against each other (batch sizes,
modes, ...).

Override values are read according to the field they set: ``str`` fields take the text as is
(unless it reads as a YAML list or mapping, which such a field refuses, as Hydra reads it), list
and section fields parse it as YAML (``data.train_files=[a.parquet,b.parquet]``), and
``null`` clears an optional field. A single string given to a list field becomes a one-item
list (``data.train_files=train.parquet``), as verl accepts.

verl's legacy reward names (``reward_model.enable``, ``custom_reward_function.path``, ...) are read
as their ``reward.*`` names (:data:`rlpad.config.verl_keys.LEGACY_KEYS`, the mapping of verl's own
migration); those that mean nothing in rlpad fail with what replaced them (``LEGACY_REFUSED``).
"""

from __future__ import annotations

import copy
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

from rlpad.config.schema import Config
from rlpad.config.verl_keys import LEGACY_KEYS, LEGACY_REFUSED, REMOVED_KEYS
from rlpad.recipe.checks import validate_config

__all__ = ["config_from_dict", "config_to_dict", "load_config", "migrate_legacy_keys", "parse_override", "save_config",
           "to_yaml"]


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
        mapping = _unwrap_optional(tp)[0]
        if typing.get_origin(mapping) is dict:  # a key inside a mapping field (engine_kwargs.vllm.x): any name
            tp = typing.get_args(mapping)[1] if typing.get_args(mapping) else Any
            continue
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
        elif typing.get_origin(tp) is list and value is not None and not isinstance(value, list | tuple | str):
            raise ValueError(f"{source}: config key {full!r} expects {_type_name(fields[key])}, got {value!r}")
        elif typing.get_origin(tp) is list and isinstance(value, list | tuple) and any(
                isinstance(v, Mapping | list | tuple) for v in value):
            raise ValueError(f"{source}: config key {full!r} expects {_type_name(tp)}, got {value!r}")
        elif tp in (str, int, float, bool) and isinstance(value, Mapping | list | tuple):
            raise ValueError(f"{source}: config key {full!r} expects {_type_name(fields[key])}, got {value!r}")
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- verl's legacy reward names


def _legacy_refusal(key: str) -> str | None:
    """What replaced the legacy key ``key`` (or a section above it) when it means nothing in rlpad, else None."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        note = LEGACY_REFUSED.get(".".join(parts[:end]))
        if note is not None:
            return f"{key!r} is verl's legacy key {'.'.join(parts[:end])!r}, which means nothing in rlpad: {note}"
    return None


def _pop(raw: dict, key: str) -> Any:
    """Remove dotted ``key`` from nested ``raw`` (and the sections it leaves empty); its value or _MISSING."""
    head, _, rest = key.partition(".")
    if not isinstance(raw, dict) or head not in raw:
        return _MISSING
    if not rest:
        return raw.pop(head)
    value = _pop(raw[head], rest)
    if isinstance(raw[head], dict) and not raw[head]:
        del raw[head]
    return value


def _leaf_keys(raw: Any, prefix: str = "") -> list[str]:
    if not isinstance(raw, Mapping) or not raw:
        return [prefix[:-1]] if prefix else []
    return [k for key, value in raw.items() for k in _leaf_keys(value, f"{prefix}{key}.")]


def migrate_legacy_keys(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``raw`` (nested recipe keys) with verl's legacy reward names moved to their ``reward.*`` names;
    ValueError (one line per key) for a legacy key that means nothing in rlpad, or one set under
    both names."""
    if not isinstance(raw, Mapping):
        return raw
    out = copy.deepcopy(dict(raw))
    problems = [line for key in _leaf_keys(out) if (line := _legacy_refusal(key))]
    for old, new in LEGACY_KEYS.items():
        value = _pop(out, old)
        if value is _MISSING:
            continue
        if _lookup(out, new) is not _MISSING:
            problems.append(f"{old!r} is verl's legacy name of {new!r}: set one of them, not both")
            continue
        section = out
        *parents, leaf = new.split(".")
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = value
    if problems:
        raise ValueError(f"{source}: " + "\n  ".join(problems))
    return out


# ----------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b.c=value"`` -> ``("a.b.c", value)``, the value read according to the field's type."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {text!r} is not of the form key=value (e.g. data.train_batch_size=32)")
    if (refused := _legacy_refusal(key)) is not None:
        raise ValueError(f"override {text!r}: {refused}")
    key = LEGACY_KEYS.get(key, key)
    try:
        tp, optional = _unwrap_optional(_annotation(key))
    except KeyError:
        raise ValueError(f"override {text!r}: unknown config key {key!r}{_suggest(key)}") from None
    if optional and value.strip() in ("null", "None", "~"):
        return key, None
    if tp is str:  # as is, unless it is a YAML list or mapping (Hydra's reading): refused by the key check
        if value.strip()[:1] in ("[", "{"):
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                return key, value
            if isinstance(parsed, list | dict):
                return key, parsed
        return key, value
    if tp in (int, float, bool):  # OmegaConf converts the text ("16", "1e-6", "false") or rejects it
        return key, value.strip()
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ValueError(f"override {text!r}: cannot parse the value as YAML ({e.__class__.__name__})") from None


def _merge(cfg: Any, raw: Mapping[str, Any], source: str) -> None:
    """Merge ``raw`` into ``cfg`` in place (a copy of :func:`_defaults`: one copy per load, not per merge)."""
    checked = _check_keys(migrate_legacy_keys(raw, source), Config, "", source)
    try:
        cfg.merge_with(checked)
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
        _merge(cfg, nested, f"override {text!r}")
    return cfg


def _finish(cfg: Any, source: str) -> Config:
    try:
        config = OmegaConf.to_object(cfg)  # resolves ${...} interpolations and checks their types
    except OmegaConfBaseException as e:
        raise _type_error(e, source) from None
    return validate_config(config)


@cache
def _frozen_defaults() -> Any:
    base = OmegaConf.structured(Config)
    OmegaConf.set_readonly(base, True)
    return base


def _defaults() -> Any:
    """A fresh, writable OmegaConf tree of the schema's defaults: a copy of one read-only tree built once
    per process (building it is ~0.4 s on CPU, most of a load; the copy ~0.05 s)."""
    cfg = copy.deepcopy(_frozen_defaults())
    OmegaConf.set_readonly(cfg, False)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """The defaults, overlaid by the YAML recipe at ``path`` (optional) and ``overrides``, validated.

    Raises FileNotFoundError for a missing recipe and ValueError (naming the dotted key, with a
    close match for typos) for unknown keys, wrong types and inconsistent values.
    """
    cfg = _defaults()
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"recipe file not found: {path!r}")
        with open(path, encoding="utf-8") as f:
            try:
                raw = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {e}") from None
        _merge(cfg, raw or {}, path)
    return _finish(_apply_overrides(cfg, overrides), path or "config")


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Like :func:`load_config`, from a nested dict (e.g. :func:`config_to_dict`'s output)."""
    cfg = _defaults()
    _merge(cfg, data, "config dict")
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
