"""Advantage estimators by name (``algorithm.adv_estimator``): one registry.

:data:`ESTIMATORS` maps a name to its function and what it needs. The config's valid names and
checks (rlpad.recipe.load), whether a run builds a critic (:func:`uses_critic`) and the
trainer's advantage step all derive from it, so a new estimator is one function and one entry
here (its math: rlpad.algorithms.estimators). The functions import the torch side when they run:
this module stays torch-free, so loading a config does too (tests/test_config.py checks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlpad.config.schema import Config

if TYPE_CHECKING:
    import torch

    from rlpad.batch import Batch

__all__ = ["ESTIMATORS", "AdvantageEstimator", "get_estimator", "uses_critic"]


@dataclass(frozen=True)
class AdvantageEstimator:
    """``compute(batch, config) -> (advantages, returns)``, both (B, R), from the batch's
    ``token_level_rewards`` and ``response_mask`` (and ``values`` when ``uses_critic``)."""

    compute: Callable[[Batch, Config], tuple[torch.Tensor, torch.Tensor]]
    uses_critic: bool = False  # reads the critic's values: the run builds a critic group
    min_group_size: int = 1  # responses per prompt (actor_rollout_ref.rollout.n) it needs
    needs: str = ""  # why min_group_size (for the config error)


def _grpo(batch: Batch, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    from rlpad.algorithms.estimators import compute_grpo_advantages

    return compute_grpo_advantages(
        batch["token_level_rewards"], batch["response_mask"].float(), batch["uid"],
        norm_adv_by_std=config.algorithm.norm_adv_by_std_in_grpo,
        expected_group_size=config.actor_rollout_ref.rollout.n)


def _gae(batch: Batch, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    from rlpad.algorithms.estimators import compute_gae_advantages

    algo = config.algorithm
    return compute_gae_advantages(batch["token_level_rewards"], batch["values"], batch["response_mask"].float(),
                                  algo.gamma, algo.lam)


ESTIMATORS: dict[str, AdvantageEstimator] = {
    # GRPO: each sequence's score normalised within its prompt's group (Dr.GRPO: norm_adv_by_std_in_grpo=false)
    "grpo": AdvantageEstimator(_grpo, min_group_size=2, needs="GRPO compares responses within a group"),
    # PPO: GAE over the critic's values (algorithm.gamma, algorithm.lam)
    "gae": AdvantageEstimator(_gae, uses_critic=True),
}


def get_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; ValueError naming the choices otherwise."""
    if name not in ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={name!r} is not valid; choose one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def uses_critic(config: Config) -> bool:
    """Whether the run needs a critic: its advantage estimator reads values (GAE)."""
    return get_estimator(config.algorithm.adv_estimator).uses_critic
