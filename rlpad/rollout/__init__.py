"""Rollout backends (vLLM, Hugging Face generate) and the rollout batch layout they produce."""

from __future__ import annotations

from rlpad.config import DataConfig, RolloutConfig
from rlpad.rollout.base import NamedTensors, RolloutBackend, Sampling

__all__ = ["NamedTensors", "RolloutBackend", "Sampling", "build_rollout"]


def build_rollout(model_path: str, rollout: RolloutConfig, data: DataConfig, **kwargs) -> RolloutBackend:
    """The backend named by ``rollout.name`` (``vllm`` or ``hf``)."""
    if rollout.name == "vllm":
        from rlpad.rollout.vllm import VLLMRollout

        return VLLMRollout(model_path, rollout, data, **kwargs)
    if rollout.name == "hf":
        from rlpad.rollout.hf import HFRollout

        return HFRollout(model_path, rollout, data, **kwargs)
    raise ValueError(f"actor_rollout_ref.rollout.name must be 'vllm' or 'hf', got {rollout.name!r}")
