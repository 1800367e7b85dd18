"""Loading a user's function by name (``reward.fn``, ``rollout.multi_turn.tools``), with no heavy imports:
a tool-worker process (rlpad.rollout.tool_worker) loads its tools with it."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
from typing import Any

__all__ = ["article", "import_class", "import_class_having", "load_function", "read_yaml"]


def article(noun: str) -> str:
    """``noun`` with its indefinite article: ``a list``, ``an int``."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def import_class(target: str) -> Any:
    """What ``pkg.module.Class`` or ``pkg.module:Class`` names (ImportError, AttributeError or ValueError as
    raised: the caller names its config key)."""
    module, _, attr = target.partition(":") if ":" in target else target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def import_class_having(target: str, methods: tuple[str, ...], shape: str, where: str) -> type:
    """The class ``target`` names, with every one of ``methods`` callable; ValueError ``"{where}: ..."`` naming
    what is missing (``shape``: what such a class is, e.g. "a tool class (verl's BaseTool shape)")."""
    try:
        cls = import_class(target)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}: cannot import {target!r} ({e})") from e
    missing = [m for m in methods if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"{where}: {target} is not {shape}; it lacks {', '.join(missing) or 'a class'}")
    return cls


def read_yaml(path: str, key: str, empty: Any) -> Any:
    """The YAML document at ``path`` (``empty`` when it holds nothing); ValueError naming ``key`` when it cannot
    be read."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f) or empty
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{key}={path!r} cannot be read as YAML: {' '.join(str(e).split())}") from e


def load_function(spec: str, key: str) -> Any:
    """The function named by ``spec`` (``"pkg.module:function"`` or ``"path/to/file.py:function"``);
    ValueError naming the config ``key`` when it cannot be found."""
    module_name, sep, func_name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not func_name:
        raise ValueError(f"{key}={spec!r} must name a function as 'package.module:function'")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise ValueError(f"{key}={spec!r}: file {module_name!r} does not exist")
            file_spec = importlib.util.spec_from_file_location(f"rlpad_custom_{abs(hash(module_name))}",
                                                               module_name)
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}={spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, func_name, None)
    if fn is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(func_name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{key}={spec!r}: module {module_name!r} has no function {func_name!r}{hint}")
    if not callable(fn):
        raise ValueError(f"{key}={spec!r}: {func_name!r} is {article(type(fn).__name__)}, not a function")
    return fn
