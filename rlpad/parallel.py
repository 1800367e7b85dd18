"""How a role's ranks split into data- and sequence-parallel groups (Ulysses); torch-free.

A role of ``world`` ranks with sequence-parallel size sp (``ulysses_sequence_parallel_size``) runs
``world / sp`` data-parallel groups of sp consecutive ranks: rank r is in group ``r // sp`` at
index ``r % sp``. Ranks are numbered node by node, so sp must divide ``trainer.n_gpus_per_node``
too: a group that crossed nodes would send each layer's two all-to-alls over the network. The batch is split over the groups; every rank of a group gets the same rows and
runs 1/sp of each packed row (:mod:`rlpad.core.sequence_parallel`). The sizes, and the rules a
config must meet for them, are written here once: the config checks (rlpad.recipe.load) and the
workers (workers/) read them.
"""

from __future__ import annotations

import json
import os
from rlpad.algorithms.advantages import ESTIMATORS
from rlpad.config.choices import VL_MODEL_TYPES
from rlpad.config.rewards import RewardModelScoringConfig
from rlpad.config.schema import ActorRolloutRefConfig, Config, CriticConfig
from rlpad.embedded.shapes import ARCHITECTURES, VL_ARCHITECTURES, WARM_START_DIMS, tiny_arch, tiny_heads

__all__ = ["ROLE_KEYS", "attention_heads", "data_parallel_groups", "dp_size", "is_vl_path", "role_world",
           "sequence_parallel_problems", "sp_size"]

# The config key of each role's sequence-parallel size.
ROLE_KEYS = {"actor": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
             "ref": "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
             "critic": "critic.ulysses_sequence_parallel_size",
             "teacher": "actor_rollout_ref.ref.ulysses_sequence_parallel_size",  # distillation: scores as the ref
             "reward_model": "reward.reward_model.ulysses_sequence_parallel_size"}


def sp_size(section: ActorRolloutRefConfig | CriticConfig | RewardModelScoringConfig, role: str) -> int:
    """The sequence-parallel size of ``role`` from its worker's config section (``actor_rollout_ref``
    for the actor and the reference, whose null size means the actor's; ``critic`` for the critic;
    ``reward.reward_model`` for the reward model)."""
    if role in ("critic", "reward_model"):
        return section.ulysses_sequence_parallel_size  # type: ignore[union-attr]
    if role in ("ref", "teacher") and section.ref.ulysses_sequence_parallel_size is not None:
        return section.ref.ulysses_sequence_parallel_size
    if role not in ("actor", "ref", "teacher"):
        raise ValueError(f"unknown role {role!r}; expected one of {sorted(ROLE_KEYS)}")
    return section.actor.ulysses_sequence_parallel_size


def dp_size(world: int, sp: int, role: str) -> int:
    """The data-parallel groups of a ``world``-rank role at sequence-parallel size ``sp``: ``world / sp``
    (ValueError unless sp >= 1 divides the world; the workers' check for groups built without a config load)."""
    if sp < 1 or world % sp:
        raise ValueError(f"{role}: sequence parallel size {sp} must divide the world size {world}")
    return world // sp


def data_parallel_groups(dp: int, sp: int) -> str:
    """What a batch splits over, for error messages: ``"N ranks"``, or ``"N data-parallel groups"`` when sp > 1."""
    return f"{dp} data-parallel groups" if sp > 1 else f"{dp} ranks"


def role_world(config: Config) -> int:
    """Ranks per role: ``trainer.n_gpus_per_node x trainer.nnodes``, or 1 for ``trainer.backend=local``."""
    trainer = config.trainer
    return 1 if trainer.backend == "local" else max(trainer.n_gpus_per_node, 1) * max(trainer.nnodes, 1)


def attention_heads(path: str) -> tuple[int, int] | None:
    """(query heads, key/value heads) of the model at ``path`` without loading it: ``tiny:<arch>``
    and ``embedded:<task>`` from rlpad.embedded.shapes, a folder from its config.json; None when
    unknown here (the worker checks the loaded model)."""
    arch = tiny_arch(path)
    if arch is not None:
        return tiny_heads(arch) if arch in ARCHITECTURES else None
    if path.startswith("embedded:"):
        return WARM_START_DIMS["num_attention_heads"], WARM_START_DIMS["num_key_value_heads"]
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    cfg = cfg if "num_attention_heads" in cfg else cfg.get("text_config", {})  # multimodal configs nest it
    heads = cfg.get("num_attention_heads")
    return (heads, cfg.get("num_key_value_heads") or heads) if isinstance(heads, int) else None


def is_vl_path(path: str) -> bool:
    """Whether the model at ``path`` is a vision-language model the core runs (``tiny:qwen2_5_vl``, a folder whose
    config.json has a model_type of :data:`rlpad.config.choices.VL_MODEL_TYPES`), without loading it."""
    arch = tiny_arch(path)
    if arch is not None:
        return arch in VL_ARCHITECTURES
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") in VL_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def sequence_parallel_problems(config: Config) -> list[str]:
    """Every role's sequence-parallel size against its world, its model and its attention."""
    arr, rm = config.actor_rollout_ref, config.reward.reward_model
    # (role, its section, its model's key, use_remove_padding, attn_implementation, path)
    lm = ("actor_rollout_ref.model", arr.model.use_remove_padding, arr.model.attn_implementation, arr.model.path)
    roles = [("actor", arr, *lm)] + [("ref", arr, *lm)] * config.builds_ref
    estimator = ESTIMATORS.get(config.algorithm.adv_estimator)  # an unknown one is reported elsewhere
    critic = config.critic.model
    roles += [("critic", config.critic, "critic.model", critic.use_remove_padding, critic.attn_implementation,
               critic.path)] * bool(estimator is not None and estimator.uses_critic)
    roles += [("reward_model", rm, "reward.reward_model", rm.use_remove_padding, rm.attn_implementation,
               rm.model_path or "")] * rm.enable
    world, problems = role_world(config), []
    for role, section, model_key, use_remove_padding, attn_implementation, path in roles:
        key, sp = ROLE_KEYS[role], sp_size(section, role)
        if sp < 1:
            problems.append(f"{key}={sp} must be >= 1")
            continue
        if sp == 1:
            continue
        per_node = config.trainer.n_gpus_per_node
        if world % sp:
            where = ("trainer.backend=local runs one rank" if config.trainer.backend == "local" else
                     f"the {role} group has {world} ranks (trainer.n_gpus_per_node x trainer.nnodes)")
            problems.append(f"{key}={sp} must divide the {role}'s ranks: {where}")
        elif world > 1 and per_node % sp:  # ranks are numbered node by node
            problems.append(f"{key}={sp} must divide trainer.n_gpus_per_node={per_node}: a group of {sp} ranks "
                            f"would span nodes ({config.trainer.nnodes} nodes), and each layer's two all-to-alls "
                            "would cross the network")
        if not use_remove_padding:
            problems.append(f"{key}={sp} needs {model_key}.use_remove_padding=true (the ranks share one packed row)")
        if is_vl_path(path):
            problems.append(f"{key}={sp}: sequence parallelism with images is not built ({model_key} is a vision-language "
                            "model); set it to 1")
        if attn_implementation not in ("auto", "rlpad_varlen"):
            problems.append(f"{key}={sp} needs {model_key}.attn_implementation auto or rlpad_varlen (its attention "
                            f"exchanges the row's slices), got {attn_implementation!r}")
        heads = attention_heads(path)
        if heads is not None and heads[0] % sp:
            path_key = f"{model_key}.model_path" if role == "reward_model" else f"{model_key}.path"
            problems.append(f"{key}={sp} must divide the query heads of {path_key}={path!r}: "
                            f"{heads[0]} (each rank attends with heads / sp of them)")
    return problems
