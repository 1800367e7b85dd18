"""The tiny vision-language models' image processor, built locally: Qwen2-VL's (its PIL path: no
torchvision) at tiny pixel bounds, beside the character tokenizer with Qwen's vision special tokens
(``rlpad.embedded.tiny.build_tokenizer(vision=True)``); :func:`save_vl_folder` writes a model with both
as a folder that transformers and rlpad load (:func:`rlpad.multimodal.processor.load_vl_processor`).

A 56x56 image is a (1, 4, 4) patch grid (14-pixel patches; two frames per temporal patch: a still image
is repeated), 16 patch rows of 3 * 2 * 14 * 14 = 1176 values, and 16 / 2^2 = 4 image-pad tokens in the
prompt. The pixel bounds keep every image between 28x28 and 56x56 pixels (resized, aspect kept).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import PreTrainedModel

from rlpad.embedded.shapes import VL_VISION

__all__ = ["MAX_PIXELS", "MIN_PIXELS", "build_image_processor", "save_vl_folder"]

_FACTOR = VL_VISION["patch_size"] * VL_VISION["spatial_merge_size"]  # 28: the side of one image token
MIN_PIXELS = _FACTOR * _FACTOR  # one image token at least
MAX_PIXELS = 2 * _FACTOR * 2 * _FACTOR  # 56 x 56: four image tokens at most


def build_image_processor(save_dir: str | os.PathLike | None = None, **overrides: Any) -> Any:
    """Qwen2-VL's image processor (PIL backend) at the tiny models' patching and pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kwargs: dict[str, Any] = dict(patch_size=VL_VISION["patch_size"], merge_size=VL_VISION["spatial_merge_size"],
                                  temporal_patch_size=VL_VISION["temporal_patch_size"],
                                  size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    processor = Qwen2VLImageProcessorPil(**(kwargs | overrides))
    if save_dir is not None:
        processor.save_pretrained(str(save_dir))
    return processor


def save_vl_folder(model: PreTrainedModel, tokenizer: Any, out: str | os.PathLike) -> str:
    """``model`` (a tiny VL model), its ``tokenizer`` (``build_tokenizer(vision=True)``) and
    :func:`build_image_processor` saved into the folder ``out``; returns its path."""
    out = os.fspath(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    build_image_processor(out)
    return out
