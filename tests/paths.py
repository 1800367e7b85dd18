"""Paths the tests share: the repository root, its recipes, and the warm-start cache."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "rlpad")  # the tests' shared warm-start cache: built once for all of them


def recipe(name: str) -> str:
    """The path of ``recipes/<name>.yaml``."""
    return os.path.join(ROOT, "recipes", f"{name}.yaml")
