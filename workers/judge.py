"""The generative judge's engines on Ray: ``reward.judge.rollout.num_replicas`` vLLM rollout actors of the
judge's own model (:class:`workers.rollout.RolloutReplicas`, the machinery the policy's engines use),
each with its own CPU (and ``tensor_model_parallel_size`` GPUs on CUDA), never in the colocated pool.
The driver reaches them through ``RayWorkers.judge_generate`` (rlpad.rewards.judge): one call per batch,
split between the replicas in whole contiguous slices, greedy.
"""

from __future__ import annotations

from typing import Any

from rlpad.config.schema import Config
from rlpad.rewards.judge_rules import engine_settings
from workers.placement import engine_resources
from workers.rollout import RolloutReplicas

__all__ = ["judge_engine_resources", "judge_replicas"]


def judge_engine_resources(config: Config, gpus: int) -> dict[str, float]:
    """The Ray resources all judge engines take together (empty without a judge); ``gpus``: 1 on CUDA, else 0."""
    judge = config.reward.judge
    return engine_resources(judge.rollout.num_replicas, judge.rollout.tensor_model_parallel_size, gpus) \
        if judge.enable else {}


def judge_replicas(config: Config, resolve_path: Any, gpus: int) -> RolloutReplicas:
    """Start the judge's engines (``resolve_path``: driver paths -> paths on the engine's node, workers.staging)."""
    judge = config.reward.judge
    rollout, data = engine_settings(judge, config.trainer.seed)
    return RolloutReplicas(judge.model_path, rollout, data, num_replicas=judge.rollout.num_replicas,
                           num_gpus=gpus * judge.rollout.tensor_model_parallel_size, resolve_path=resolve_path,
                           trust_remote_code=config.actor_rollout_ref.model.trust_remote_code,
                           device="cuda" if gpus else "cpu")
