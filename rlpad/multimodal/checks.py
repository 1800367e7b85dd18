"""A vision-language recipe's checks against its model, before any compute (one line each): the image keys
on a text-only model, images without their pixels in the batch, a rollout backend that cannot take images."""

from __future__ import annotations

from typing import Any

__all__ = ["vl_config_problems"]

# keys that mean something only for a vision-language model: (dotted key, is it set?)
_VL_ONLY = (("actor_rollout_ref.rollout.limit_images", lambda c: c.actor_rollout_ref.rollout.limit_images is not None),
            ("actor_rollout_ref.actor.freeze_vision_tower", lambda c: getattr(c.actor_rollout_ref.actor, "freeze_vision_tower", False)),
            ("data.mm_processor_kwargs", lambda c: bool(c.data.mm_processor_kwargs)))


def vl_config_problems(config: Any, is_vl: bool, rollout_images: str | None) -> list[str]:
    """What is wrong with ``config`` for its model (a vision-language one when ``is_vl``), one line each;
    ``rollout_images``: why the recipe's rollout backend cannot take images (its ``image_support()``), or None."""
    arr, path = config.actor_rollout_ref, config.actor_rollout_ref.model.path
    if not is_vl:
        return [f"{key} is set but model {path!r} is text-only (a vision-language key)"
                for key, is_set in _VL_ONLY if is_set(config)]
    problems = []
    if not config.data.return_multi_modal_inputs:
        problems.append(f"data.return_multi_modal_inputs=false, but model {path!r} is a vision-language model: "
                        "its scoring workers read each row's pixels from the batch (multi_modal_inputs)")
    limit = arr.rollout.limit_images
    if limit is not None and limit < 0:
        problems.append(f"actor_rollout_ref.rollout.limit_images={limit} must be >= 0 or null")
    if rollout_images is not None:
        problems.append(f"actor_rollout_ref.rollout.name={arr.rollout.name}: {rollout_images}, and model {path!r} is a "
                        "vision-language model; use actor_rollout_ref.rollout.name=hf")
    return problems
