"""Synthetic vision-language rollout batches, shaped as the processor and the rollout build them.

Each prompt is text with images in it: ``text <vision_start> image_pad x (t*h*w / merge^2)
<vision_end> text ...``; its ``multi_modal_inputs`` are random pixel patches at the shape the
processor gives, ``(sum t*h*w, 3 * temporal_patch * patch^2)``, and the grids. Prompts are
left-padded, responses (text tokens) right-padded, ``n`` rows per prompt share its images. Used by
the VL tests and ``rlpad bench logprob --vl``.
"""

from __future__ import annotations

from collections.abc import Sequence

import math

import torch

from rlpad.batch import Batch
from rlpad.core.layout import position_ids_from_mask
from rlpad.core.vision import MM_KEY
from rlpad.embedded.shapes import VL_TOKEN_IDS, VL_VISION

__all__ = ["PATCH_DIM", "vl_ppo_batch", "vl_rollout_batch"]

PATCH_DIM = 3 * VL_VISION["temporal_patch_size"] * VL_VISION["patch_size"] ** 2  # 1176, the processor's
TEXT_IDS = (3, 80)  # the character tokenizer's ids [lo, hi): never a special or vision token


def vl_rollout_batch(
    image_grids: Sequence[Sequence[tuple[int, int, int]]],
    response_length: int,
    *,
    n: int = 1,
    seed: int = 0,
    max_text: int = 6,
    extra_left_pad: int = 1,
    merge: int = VL_VISION["spatial_merge_size"],
    patch_dim: int = PATCH_DIM,
    token_ids: dict[str, int] = VL_TOKEN_IDS,
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """``(tensors, multi_modal_inputs)`` of ``len(image_grids) * n`` rows: prompt g holds the images
    ``image_grids[g]`` ((t, h, w) in patches; none: a text-only prompt) between random text runs of
    1..``max_text`` tokens; each of its n rows gets a random response of 1..R tokens (row 0: R).
    Prompts are left-padded to the longest + ``extra_left_pad``. ``tensors``: ``input_ids``,
    ``attention_mask``, ``position_ids`` (the text rule), ``responses``, ``response_mask``."""
    gen = torch.Generator().manual_seed(seed)

    def text(k: int) -> list[int]:
        return torch.randint(*TEXT_IDS, (k,), generator=gen).tolist()

    prompts, mm = [], []
    for grids in image_grids:
        ids = text(int(torch.randint(1, max_text + 1, (1,), generator=gen)))
        for t, h, w in grids:
            ids += [token_ids["vision_start"], *[token_ids["image_pad"]] * (t * h * w // merge**2), token_ids["vision_end"]]
            ids += text(int(torch.randint(1, max_text + 1, (1,), generator=gen)))
        prompts.append(ids)
        patches = sum(t * h * w for t, h, w in grids)
        mm.append({"pixel_values": torch.randn(patches, patch_dim, generator=gen),
                   "image_grid_thw": torch.tensor(list(grids), dtype=torch.long).reshape(-1, 3)} if grids else {})
    prompt_cols = max(len(p) for p in prompts) + extra_left_pad
    rows = len(prompts) * n
    input_ids = torch.zeros(rows, prompt_cols + response_length, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    multi_modal_inputs = []
    for g, ids in enumerate(prompts):
        for j in range(n):
            r = g * n + j
            length = response_length if r == 0 else int(torch.randint(1, response_length + 1, (1,), generator=gen))
            input_ids[r, prompt_cols - len(ids):prompt_cols] = torch.tensor(ids)
            input_ids[r, prompt_cols:prompt_cols + length] = torch.tensor(text(length))
            mask[r, prompt_cols - len(ids):prompt_cols + length] = 1
            multi_modal_inputs.append(mm[g])
    responses = input_ids[:, prompt_cols:]
    tensors = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                   responses=responses, response_mask=mask[:, prompt_cols:].clone())
    return tensors, multi_modal_inputs


def vl_ppo_batch(image_grids: Sequence[Sequence[tuple[int, int, int]]], response_length: int, *, n: int = 1,
                 seed: int = 0, vocab_size: int = 128, **kwargs) -> Batch:
    """A :class:`Batch` of :func:`vl_rollout_batch` rows with every key the workers read: the tensors,
    ``multi_modal_inputs``, ``advantages`` / ``returns`` / ``values`` ~ N(0, 1) and ``old_log_probs`` /
    ``ref_log_probs`` near a random model's (log(1/V) + N(0, 0.2)); zeros off the response mask."""
    tensors, mm = vl_rollout_batch(image_grids, response_length, n=n, seed=seed, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = tensors["response_mask"].float()
    rows = mask.shape[0]

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(rows, response_length, generator=gen) * scale * mask

    base = -math.log(vocab_size) * mask
    tensors.update(advantages=noise(1.0), returns=noise(1.0), values=noise(1.0),
                   old_log_probs=base + noise(0.2), ref_log_probs=base + noise(0.2))  # fmt: skip
    return Batch(tensors, {MM_KEY: mm})
