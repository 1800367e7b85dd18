"""The image side of a prompt dataset (rlpad/data.py): each row's images checked and encoded when the
dataset is built, their pixels made again when a batch is collated.

At build time a row's images are decoded (an unreadable one fails there), counted against its
``<image>`` placeholders and ``rollout.limit_images``, and encoded once (:meth:`VLProcessor.encode`):
the row keeps its token ids, its image cells and its grids, not its pixels (a real dataset's pixels
would not fit in memory). :meth:`PromptImages.inputs` decodes and processes a batch's rows again and
checks the grids against the stored ones. Every refusal is one line naming the file, row and key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlpad.multimodal.images import count_placeholders, load_image, row_images, row_videos
from rlpad.multimodal.processor import VLProcessor

__all__ = ["EncodedPrompt", "PromptImages", "keeps_vision_tokens"]


@dataclass(frozen=True)
class EncodedPrompt:
    """One row's prompt: its token ids (image-pad runs expanded), image cells and grids (None: no image)."""

    ids: list[int]
    cells: tuple[Any, ...] = ()
    grids: torch.Tensor | None = None


def keeps_vision_tokens(ids: Sequence[int], kept: Sequence[int], vision_ids: Sequence[int]) -> bool:
    """Whether a truncated prompt ``kept`` still holds every vision token of ``ids`` (no image run cut)."""
    vision = set(vision_ids)
    return sum(t in vision for t in kept) == sum(t in vision for t in ids)


class PromptImages:
    """The image columns of a dataset: ``data.image_key`` / ``data.video_key``, checked and encoded with
    ``processor`` (None: a text-only model, which refuses any row with images)."""

    def __init__(self, processor: VLProcessor | None, *, image_key: str, video_key: str,
                 limit_images: int | None, model_path: str) -> None:
        self.processor, self.image_key, self.video_key = processor, image_key, video_key
        self.limit_images, self.model_path = limit_images, model_path

    def encode(self, row: Mapping[str, Any], messages: list[dict[str, Any]], where: str, base_dir: str | None,
               tools: list[dict[str, Any]] | None, text_ids: Any) -> EncodedPrompt:
        """The row's prompt encoded; ``text_ids()`` encodes a row without images the text way."""
        if row_videos(row, self.video_key):
            raise ValueError(f"{where}: column {self.video_key!r} (data.video_key) holds a video; rlpad does not "
                             "build video inputs (images only)")
        images = row_images(row, self.image_key, where, base_dir)
        wanted = count_placeholders(messages)
        if (images or wanted) and self.processor is None:
            raise ValueError(f"{where}: the row has {'images' if images else '<image> placeholders'} but model "
                             f"{self.model_path!r} is text-only (a vision-language recipe needs a Qwen2-VL / "
                             "Qwen2.5-VL model)")
        if wanted != len(images):
            raise ValueError(f"{where}: {wanted} <image> placeholder(s) in the prompt but {len(images)} image(s) "
                             f"in column {self.image_key!r} (data.image_key)")
        if self.limit_images is not None and len(images) > self.limit_images:
            raise ValueError(f"{where}: {len(images)} images, more than actor_rollout_ref.rollout.limit_images="
                             f"{self.limit_images}")
        if self.processor is None:
            return EncodedPrompt(text_ids())
        try:
            ids, mm = self.processor.encode(messages, images, tools)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if not images:
            return EncodedPrompt(ids)
        cells = tuple(row[self.image_key]) if not isinstance(row[self.image_key], bytes | str | Mapping) \
            else (row[self.image_key],)
        return EncodedPrompt(ids, cells, mm["image_grid_thw"])

    def inputs(self, prompts: Sequence[EncodedPrompt], base_dir: Sequence[str | None]) -> list[dict[str, torch.Tensor]]:
        """``multi_modal_inputs`` of collated rows (``{}`` for a text-only row), their grids checked
        against the dataset's."""
        assert self.processor is not None
        out: list[dict[str, torch.Tensor]] = []
        for prompt, folder in zip(prompts, base_dir):
            if prompt.grids is None:
                out.append({})
                continue
            images = [load_image(c, f"image {i}", folder) for i, c in enumerate(prompt.cells)]
            mm, _ = self.processor.images_inputs(images)
            if not torch.equal(mm["image_grid_thw"], prompt.grids):
                raise RuntimeError(f"the image processor gave grids {mm['image_grid_thw'].tolist()} for a prompt "
                                   f"encoded with {prompt.grids.tolist()}")
            out.append(mm)
        return out
