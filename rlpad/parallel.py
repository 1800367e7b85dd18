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
from rlpad.config.schema import ActorRolloutRefConfig, Config, CriticConfig
from rlpad.embedded.shapes import ARCHITECTURES, WARM_START_DIMS, tiny_arch, tiny_heads

__all__ = ["ROLE_KEYS", "attention_heads", "data_parallel_groups", "dp_size", "role_world", "sequence_parallel_problems",
           "sp_size"]

# The config key of each role's sequence-parallel size.
ROLE_KEYS = {"actor": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
             "ref": "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
             "critic": "critic.ulysses_sequence_parallel_size",
             "teacher": "actor_rollout_ref.ref.ulysses_sequence_parallel_size"}  # distillation: scores as the ref


def sp_size(section: ActorRolloutRefConfig | CriticConfig, role: str) -> int:
    """The sequence-parallel size of ``role`` from its worker's config section (``actor_rollout_ref``
    for the actor and the reference, whose null size means the actor's; ``critic`` for the critic)."""
    if role == "critic":
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


def sequence_parallel_problems(config: Config) -> list[str]:
    """Every role's sequence-parallel size against its world, its model and its attention."""
    arr = config.actor_rollout_ref
    roles = [("actor", arr, arr.model)] + [("ref", arr, arr.model)] * config.builds_ref
    estimator = ESTIMATORS.get(config.algorithm.adv_estimator)  # an unknown one is reported elsewhere
    roles += [("critic", config.critic, config.critic.model)] * bool(estimator is not None and estimator.uses_critic)
    world, problems = role_world(config), []
    for role, section, model in roles:
        key, sp = ROLE_KEYS[role], sp_size(section, role)
        model_key = "critic.model" if role == "critic" else "actor_rollout_ref.model"
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
        if not model.use_remove_padding:
            problems.append(f"{key}={sp} needs {model_key}.use_remove_padding=true (the ranks share one packed row)")
        if model.attn_implementation not in ("auto", "rlpad_varlen"):
            problems.append(f"{key}={sp} needs {model_key}.attn_implementation auto or rlpad_varlen (its attention "
                            f"exchanges the row's slices), got {model.attn_implementation!r}")
        heads = attention_heads(model.path)
        if heads is not None and heads[0] % sp:
            problems.append(f"{key}={sp} must divide the query heads of {model_key}.path={model.path!r}: "
                            f"{heads[0]} (each rank attends with heads / sp of them)")
    return problems
