"""A Qwen2(.5)-VL prompt with images -> token ids with image-pad runs + the pixel patches (verl's
``multi_modal_inputs``), without torchvision.

transformers' ``Qwen2VLProcessor`` cannot be built here (its video processor needs torchvision), so
this module does its job in three steps, each checked:

1. each ``<image>`` placeholder of a message's text becomes an image part (verl's rule), and the
   tokenizer's chat template renders the parts (Qwen's: ``<|vision_start|><|image_pad|><|vision_end|>``);
   the rendered ids must hold exactly one image-pad token per image;
2. the image processor (its PIL backend, ``Qwen2VLImageProcessorPil``) gives each image's patches and
   grid ``(t, h, w)``; the patches must number ``sum(t*h*w)`` and each grid must merge evenly;
3. each image-pad token is expanded to ``t*h*w / merge^2`` copies (the tokens the vision tower's merged
   features fill).

``multi_modal_inputs`` of a row: ``{"pixel_values": (patches, channels*temporal*patch^2) float32,
"image_grid_thw": (images, 3) int64}``; ``{}`` for a text-only row.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlpad.multimodal.images import IMAGE_PLACEHOLDER

__all__ = ["MM_PROCESSOR_KEYS", "VLProcessor", "expand_image_pads", "image_parts", "load_vl_processor"]

# data.mm_processor_kwargs understood here: Qwen's pixel bounds of a resized image (verl users set these).
MM_PROCESSOR_KEYS = ("min_pixels", "max_pixels")
_SPECIAL = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
            "image_pad": "<|image_pad|>", "video_pad": "<|video_pad|>"}


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each ``<image>`` of a text content turned into an ``{"type": "image"}`` part
    (the text around it into ``{"type": "text"}`` parts); a message without one keeps its string."""
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(dict(m))
            continue
        parts = [{"type": "image"} if s == IMAGE_PLACEHOLDER else {"type": "text", "text": s}
                 for s in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", content) if s]
        out.append({**m, "content": parts})
    return out


def expand_image_pads(ids: Sequence[int], image_token_id: int, tokens_per_image: Sequence[int]) -> list[int]:
    """``ids`` with the i-th image-pad token repeated ``tokens_per_image[i]`` times; ValueError unless
    ``ids`` holds exactly one image-pad token per image, none adjacent to another."""
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(tokens_per_image):
        raise ValueError(f"the rendered prompt holds {len(at)} image-pad token(s) for {len(tokens_per_image)} image(s)")
    out, start = [], 0
    for i, n in zip(at, tokens_per_image):
        out += list(ids[start:i]) + [image_token_id] * int(n)
        start = i + 1
    return out + list(ids[start:])


@dataclass
class VLProcessor:
    """A VL model's tokenizer and image processor, and the ids of its vision special tokens."""

    tokenizer: Any
    image_processor: Any
    image_token_id: int
    special_ids: dict[str, int]  # vision_start, vision_end, image_pad, video_pad -> id
    merge_size: int
    call_kwargs: dict[str, Any]  # passed to every image-processor call (data.mm_processor_kwargs)

    @property
    def vision_token_ids(self) -> list[int]:
        """The vision special tokens: part of prompts, never sampled (the rollout masks them)."""
        return sorted(set(self.special_ids.values()))

    def images_inputs(self, images: Sequence[Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """``({"pixel_values", "image_grid_thw"}, image-pad tokens per image)`` of PIL images, checked:
        the patches number ``sum(t*h*w)`` and every grid's ``h*w`` is a multiple of ``merge^2``."""
        out = self.image_processor(images=list(images), return_tensors="pt", **self.call_kwargs)
        pixels = out["pixel_values"].to(torch.float32)
        grids = torch.as_tensor(out["image_grid_thw"], dtype=torch.long).reshape(-1, 3)
        if grids.shape[0] != len(images):
            raise ValueError(f"the image processor returned {grids.shape[0]} grids for {len(images)} images")
        patches = grids.prod(-1)
        if int(patches.sum()) != pixels.shape[0]:
            raise ValueError(f"the image processor returned {pixels.shape[0]} patches, its grids {grids.tolist()} "
                             f"give {int(patches.sum())}")
        unit = self.merge_size ** 2
        if bool((patches % unit).any()):
            raise ValueError(f"image grids {grids.tolist()} do not merge by {self.merge_size}x{self.merge_size}")
        return {"pixel_values": pixels, "image_grid_thw": grids}, (patches // unit).tolist()

    def render_ids(self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat-templated ids (generation prompt added) of ``messages``, ``<image>`` as image parts."""
        text = self.tokenizer.apply_chat_template(image_parts(messages), tools=tools, add_generation_prompt=True,
                                                  tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, messages: Sequence[Mapping[str, Any]], images: Sequence[Any],
               tools: list[dict[str, Any]] | None = None) -> tuple[list[int], dict[str, torch.Tensor]]:
        """``(ids with the image-pad runs expanded, multi_modal_inputs)`` of one prompt; ``{}`` without images.
        ValueError when the rendered prompt does not hold one image-pad token per image (a chat template
        that drops image parts, or the token typed into the text)."""
        ids = self.render_ids(messages, tools)
        if not images:
            if self.image_token_id in ids:
                raise ValueError("the prompt holds an image-pad token but the row gives no image")
            return ids, {}
        mm, tokens = self.images_inputs(images)
        try:
            return expand_image_pads(ids, self.image_token_id, tokens), mm
        except ValueError as e:
            raise ValueError(f"{e}: the chat template must render an image part as {_SPECIAL['image_pad']} once") from None


def _image_processor_of_folder(path: str) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        raise ValueError(f"model {path!r} is a vision-language model but its folder has no image processor "
                         "(preprocessor_config.json); save the processor with the model")
    return Qwen2VLImageProcessorPil.from_pretrained(path)


def load_vl_processor(path: str, tokenizer: Any, mm_processor_kwargs: Mapping[str, Any] | None = None) -> VLProcessor | None:
    """The :class:`VLProcessor` of the model at ``path`` (a folder, or a registered source's path such as
    ``tiny:qwen2_5_vl``) with ``tokenizer``; None for a text-only model. ``mm_processor_kwargs``
    (``data.mm_processor_kwargs``): ``min_pixels`` / ``max_pixels`` override the saved bounds."""
    from rlpad.core.models import model_config, model_source
    from rlpad.core.vision import is_vl_config

    config = model_config(path)
    if not is_vl_config(config):
        return None
    kwargs = dict(mm_processor_kwargs or {})
    unknown = sorted(set(kwargs) - set(MM_PROCESSOR_KEYS))
    if unknown:
        raise ValueError(f"data.mm_processor_kwargs: unknown key(s) {unknown}; rlpad's image processor takes "
                         f"{list(MM_PROCESSOR_KEYS)}")
    found = model_source(path)
    image_processor = (found[0].image_processor(found[1]) if found is not None and found[0].image_processor
                       else _image_processor_of_folder(path))
    if image_processor is None:
        raise ValueError(f"model {path!r} is a vision-language model but its source gives no image processor")
    call: dict[str, Any] = {}
    if kwargs:
        size = image_processor.size  # Qwen's pixel bounds: shortest_edge = min_pixels, longest_edge = max_pixels
        call["size"] = {"shortest_edge": int(kwargs.get("min_pixels", size.shortest_edge)),
                        "longest_edge": int(kwargs.get("max_pixels", size.longest_edge))}
    ids = {}
    for key, token in _SPECIAL.items():
        ids[key] = tokenizer.convert_tokens_to_ids(token)
        if ids[key] is None or ids[key] == tokenizer.unk_token_id:
            raise ValueError(f"model {path!r} is a vision-language model but its tokenizer has no {token} token")
    if ids["image_pad"] != config.image_token_id:
        raise ValueError(f"the tokenizer's {_SPECIAL['image_pad']} is id {ids['image_pad']}, the model's "
                         f"image_token_id is {config.image_token_id}")
    if image_processor.merge_size != config.vision_config.spatial_merge_size:
        raise ValueError(f"the image processor merges {image_processor.merge_size}x{image_processor.merge_size} "
                         f"patches, the model's vision tower {config.vision_config.spatial_merge_size}")
    return VLProcessor(tokenizer, image_processor, ids["image_pad"], ids, image_processor.merge_size, call)
