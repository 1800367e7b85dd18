"""LoRA's rules, torch-free: which modules get an adapter, the ranks vLLM serves, the config checks,
and how an adapter's parameter names map to the model's (docs/lora.md).

The peft side (applying adapters, merging, saving) is :mod:`rlpad.lora.adapters`; the config loader and
the weight export read the rules here, so a name is matched one way everywhere.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


__all__ = ["ALL_LINEAR", "LORA_SYNC_MODES", "VLLM_MAX_LORA_RANKS", "LoraSpec", "adapter_option_problems", "adapter_spec",
           "engine_lora_kwargs", "engine_max_lora_rank", "lora_key", "lora_spec", "lora_value_problems", "matches",
           "select_targets", "syncs_adapter"]

ALL_LINEAR = "all-linear"  # target_modules entry: every linear of the decoder (never the LM head)
# The values vLLM accepts as max_lora_rank (vllm.config.lora.MaxLoRARanks); an engine serving an adapter of
# rank r is built with the smallest of them >= r.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# actor_rollout_ref.rollout.lora_sync: how a LoRA actor's weights reach the engines at each sync.
LORA_SYNC_MODES = {
    "merged": "the full weights with W + (alpha / r) B A merged in, through the full-weight path",
    "adapter": "only the adapter tensors; the engines keep the base weights they started with and serve the "
               "adapter (vLLM's LoRA: enable_lora, LoRARequest)",
}
# A LoRA-wrapped linear's parameters in peft's module tree: <module>.base_layer.<p>, <module>.lora_A.<adapter>.weight
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?:(?P<base>base_layer)\.(?P<param>[^.]+)|(?P<ab>lora_[AB])\.[^.]+\.weight)$")


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA configuration: rank, alpha, the module names or suffixes it targets and excludes."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    exclude_modules: tuple[str, ...] = ()
    use_rslora: bool = False  # rank-stabilised LoRA: the scale is alpha / sqrt(rank) (a saved adapter's option)

    @property
    def scale(self) -> float:
        """The factor of ``B @ A`` in ``W + scale * B @ A``: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


# A saved adapter's peft options rlpad refuses (each changes what the adapter computes, and the actor, the merged
# export and vLLM would not all honour it): option -> (is it set?, what it is). Honoured: r, lora_alpha,
# target_modules (a list), exclude_modules, use_rslora; the rest (dropout, init, task type) changes nothing loaded.
_DEFAULT_INITS = (True, False, "gaussian", "eva", "orthogonal")  # inits that only draw the starting A, B
_REFUSED_ADAPTER_OPTIONS: dict[str, tuple[Any, str]] = {
    "peft_type": (lambda v: v not in (None, "LORA"), "not a LoRA adapter"),
    "use_dora": (bool, "DoRA's magnitude vectors: vLLM serves no DoRA, the merge and the trainer have no magnitude"),
    "bias": (lambda v: v not in (None, "none"), "trained biases: vLLM serves none, rlpad trains none"),
    "lora_bias": (bool, "a bias on lora_B: vLLM serves none"),
    "modules_to_save": (bool, "fully trained module copies: rlpad trains and syncs the adapters only"),
    "alpha_pattern": (bool, "per-module alphas: rlpad applies one scale to every module"),
    "rank_pattern": (bool, "per-module ranks: rlpad applies one rank to every module"),
    "layers_to_transform": (lambda v: v is not None, "adapters on some layers only: list the modules by name"),
    "layer_replication": (bool, "replicated layers"),
    "fan_in_fan_out": (bool, "transposed weights of Conv1D models"),
    "target_parameters": (bool, "adapters on parameters, not modules"),
    "trainable_token_indices": (bool, "trained token embeddings"),
    "use_qalora": (bool, "QALoRA"),
    "alora_invocation_tokens": (bool, "activated LoRA"),
    "use_bdlora": (bool, "block-diagonal LoRA"),
    **{f"{variant}_config": (bool, f"the LoRA variant {variant}")
       for variant in ("arrow", "kasa", "monteclora", "velora")},
    "init_lora_weights": (lambda v: v not in _DEFAULT_INITS, "an init that changes the base weights, as PiSSA, "
                                                             "OLoRA, LoftQ, CorDA do: convert it to a plain LoRA"),
}


def adapter_option_problems(cfg: dict[str, Any], key: str) -> list[str]:
    """One line per option of a saved adapter's ``adapter_config.json`` (``cfg``) that rlpad refuses, naming
    the option and ``key`` (the config key that points at the adapter)."""
    problems = [f"{key}: adapter_config.json sets {option}={cfg[option]!r}, which rlpad does not support ({what})"
                for option, (is_set, what) in _REFUSED_ADAPTER_OPTIONS.items()
                if option in cfg and is_set(cfg[option])]
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        problems.append(f"{key}: adapter_config.json sets target_modules={targets!r}, a regular expression (peft's "
                        "full match), which rlpad does not support: list the module names or suffixes")
    return problems


def _adapter_config(path: str) -> dict[str, Any]:
    config = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config):
        raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={path!r} is not a peft adapter folder "
                         "(no adapter_config.json)")
    with open(config, encoding="utf-8") as f:
        return json.load(f)


def lora_spec(model: Any) -> LoraSpec | None:
    """The LoRA of a model config (None: off). With ``lora_adapter_path``, the adapter's own r, alpha
    and target modules (its adapter_config.json)."""
    if not model.uses_lora:
        return None
    if model.lora_adapter_path is None:
        return LoraSpec(model.lora_rank, float(model.lora_alpha), tuple(model.target_modules),
                        tuple(model.exclude_modules))
    return adapter_spec(model.lora_adapter_path, f"actor_rollout_ref.model.lora_adapter_path={model.lora_adapter_path!r}")


def adapter_spec(path: str, what: str) -> LoraSpec:
    """The LoRA of the peft adapter folder ``path``: its r, alpha, target modules, exclusions and ``use_rslora``;
    ValueError (naming ``what``) for an option rlpad does not honour."""
    cfg = _adapter_config(path)
    problems = adapter_option_problems(cfg, what)
    if problems:
        raise ValueError("\n".join(problems))
    targets = cfg.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    exclude = cfg.get("exclude_modules") or ()
    return LoraSpec(int(cfg["r"]), float(cfg["lora_alpha"]), targets,
                    (exclude,) if isinstance(exclude, str) else tuple(exclude), bool(cfg.get("use_rslora", False)))


def syncs_adapter(config: Any) -> bool:
    """LoRA is on and each sync sends only the adapter (``rollout.lora_sync=adapter``)."""
    arr = config.actor_rollout_ref
    return arr.model.uses_lora and arr.rollout.lora_sync == "adapter"


def engine_lora_kwargs(config: Any) -> dict[str, int]:
    """The rollout backend's LoRA argument: ``{"lora_rank": r}`` when the engines serve the adapter,
    else nothing (a backend without LoRA need not know the argument)."""
    return {"lora_rank": lora_spec(config.actor_rollout_ref.model).rank} if syncs_adapter(config) else {}


def engine_max_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the smallest accepted value >= rank."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"actor_rollout_ref.model.lora_rank={rank} is above vLLM's largest max_lora_rank "
                     f"{VLLM_MAX_LORA_RANKS[-1]}")


def matches(name: str, entry: str) -> bool:
    """A module's full name matches a target entry: equal, or ending in ``.<entry>`` (peft's rule)."""
    return name == entry or name.endswith("." + entry)


def select_targets(linear_names: Sequence[str], target_modules: Sequence[str],
                   exclude_modules: Sequence[str] = ()) -> list[str]:
    """The full names (of ``linear_names``: the decoder's linear modules, the LM head left out) that
    get an adapter; ValueError naming the key when the targets match nothing or all are excluded."""
    if ALL_LINEAR in target_modules:
        chosen = list(linear_names)
    else:
        chosen = [n for n in linear_names if any(matches(n, t) for t in target_modules)]
    kinds = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linear_names}))
    if not chosen:
        raise ValueError(f"actor_rollout_ref.model.target_modules={list(target_modules)} matches no linear module of "
                         f"the model; its linear modules: {kinds} (or {ALL_LINEAR}; the LM head and the embeddings "
                         "never get an adapter)")
    kept = [n for n in chosen if not any(matches(n, e) for e in exclude_modules)]
    if not kept:
        raise ValueError(f"actor_rollout_ref.model.exclude_modules={list(exclude_modules)} excludes every module "
                         f"target_modules={list(target_modules)} selects ({len(chosen)} of: {kinds}): nothing would "
                         "be trained")
    return kept


def lora_key(key: str) -> tuple[str, str] | None:
    """``(module, part)`` of a LoRA-wrapped linear's state-dict key: part ``"lora_A"`` / ``"lora_B"`` or
    the base parameter's name (``"weight"``, ``"bias"``); None for any other key.
    ``x.q_proj.base_layer.weight`` -> ``("x.q_proj", "weight")``."""
    m = _LORA_KEY.match(key)
    if m is None:
        return None
    return m["module"], m["ab"] or m["param"]


def lora_value_problems(config: Any) -> list[str]:
    """The LoRA keys' values against each other (the config loader; torch-free, no file read)."""
    problems: list[str] = []
    arr = config.actor_rollout_ref
    model, key = arr.model, "actor_rollout_ref.model"
    if model.lora_rank < 0:
        problems.append(f"{key}.lora_rank={model.lora_rank} must be >= 0 (0: LoRA off)")
    elif model.lora_rank > VLLM_MAX_LORA_RANKS[-1]:
        problems.append(f"{key}.lora_rank={model.lora_rank} is above vLLM's largest max_lora_rank "
                        f"{VLLM_MAX_LORA_RANKS[-1]} (its ranks: {', '.join(map(str, VLLM_MAX_LORA_RANKS))}; an "
                        "engine serves rank r with the smallest of them >= r)")
    if model.uses_lora:
        if not model.lora_alpha > 0:
            problems.append(f"{key}.lora_alpha={model.lora_alpha} must be > 0 (the adapter's scale is alpha / rank)")
        if not model.target_modules:
            problems.append(f"{key}.target_modules is empty; name modules or use {ALL_LINEAR}")
        else:
            named = [t for t in model.target_modules if t != ALL_LINEAR]
            if named and ALL_LINEAR not in model.target_modules and all(
                    any(matches(t, e) for e in model.exclude_modules) for t in named):
                problems.append(f"{key}.exclude_modules={list(model.exclude_modules)} excludes every module of "
                                f"target_modules={list(model.target_modules)}: nothing would be trained")
    if arr.rollout.lora_sync not in LORA_SYNC_MODES:
        problems.append(f"actor_rollout_ref.rollout.lora_sync={arr.rollout.lora_sync!r} is not valid; choose one of "
                        f"{', '.join(LORA_SYNC_MODES)}")
    critic = config.critic.model
    if critic.lora_rank != 0 or critic.lora_adapter_path is not None:
        problems.append("critic.model.lora_rank / lora_adapter_path: LoRA on the critic is not supported (the critic "
                        "trains fully; set critic.model.lora_rank=0 and lora_adapter_path=null)")
    return problems
