"""A VL batch's images, shaped for generation: the rows' ``multi_modal_inputs`` (one mapping per row,
``{}`` for a text-only row) as the keyword arguments transformers' Qwen2(.5)-VL ``generate`` takes, and
the check that each row's image-pad tokens match its grids (the HF rollout, the warm start's greedy check)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["generate_image_inputs"]


def generate_image_inputs(input_ids: torch.Tensor, rows: Sequence[Mapping[str, Any]], config: Any,
                          device: torch.device) -> dict[str, torch.Tensor]:
    """``pixel_values`` (the rows' patches in row order), ``image_grid_thw`` and ``mm_token_type_ids``
    (1 on image-pad tokens: transformers 5.x computes the multimodal rotary positions from it; without
    it Qwen2.5-VL falls back to text positions) for ``generate`` on the left-padded ``input_ids``; {} when
    no row has an image. ValueError when a row's image-pad tokens do not match its grids."""
    with_images = [mm for mm in rows if mm]
    if not with_images:
        return {}
    image_pad = input_ids == config.image_token_id
    merge = config.vision_config.spatial_merge_size ** 2
    for b, mm in enumerate(rows):
        want = int(torch.as_tensor(mm["image_grid_thw"]).prod(-1).sum()) // merge if mm else 0
        if int(image_pad[b].sum()) != want:
            raise ValueError(f"rollout row {b}: {int(image_pad[b].sum())} image-pad tokens, its images fill {want}")
    return {"pixel_values": torch.cat([torch.as_tensor(mm["pixel_values"]) for mm in with_images]).to(device),
            "image_grid_thw": torch.cat([torch.as_tensor(mm["image_grid_thw"]).reshape(-1, 3)
                                         for mm in with_images]).to(device),
            "mm_token_type_ids": image_pad.long().to(device)}
