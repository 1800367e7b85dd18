"""Multimodal rotary positions (Qwen2-VL / Qwen2.5-VL "mrope"): the one rule, per sequence.

Each token gets three positions (temporal, height, width). A text token has all three equal to a
running counter; an image of ``(t, h, w)`` patches is ``t * (h / m) * (w / m)`` image-pad tokens in
the text (``m`` the spatial merge size), token ``(i, j, k)`` at ``start + (i, j, k)``; the counter
then continues from the image's largest position + 1::

    tokens     a  b  <v> [img 2x3]            </v> c   response ...
    t          0  1  2   3 3 3 3 3 3          5    6   7 8 ...
    h          0  1  2   3 3 3 4 4 4          5    6   7 8 ...
    w          0  1  2   3 4 5 3 4 5          5    6   7 8 ...

Computed from a sequence's VALID tokens only (``attention_mask``), so left padding never shifts
them and a response continues from its prompt's largest position + 1 (never from the padded
length). :func:`mrope_positions` gives ``(3, B, S)`` for a padded batch (0 on padding); the packed
and shared-prompt rows gather the same values slot by slot (:func:`lm_positions`). The language model
then gets ``(4, rows, T)``: row 0 the plain text position (restarting per sequence in a packed row),
rows 1-3 these (transformers' Qwen2(.5)-VL text model splits a 4-row input that way).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["mrope_positions", "row_mrope", "lm_positions"]


def row_mrope(ids: torch.Tensor, grids: torch.Tensor | None, *, image_token_id: int, merge: int,
              row: int = 0) -> torch.Tensor:
    """``(3, L)`` int64 positions of one sequence's valid tokens ``ids (L,)`` whose images have
    grids ``grids (n, 3)`` (t, h, w in patches), in order. Each run of image-pad tokens holds whole
    images; ValueError (naming ``row``) when the image-pad tokens and the grids disagree."""
    ids = ids.reshape(-1).cpu()
    grids = torch.zeros(0, 3, dtype=torch.long) if grids is None else grids.reshape(-1, 3).long().cpu()
    is_image = ids == image_token_id
    if not bool(is_image.any()):
        if len(grids):
            raise ValueError(f"row {row}: {len(grids)} image(s) but no image-pad token (id {image_token_id}) in its valid tokens")
        return torch.arange(ids.numel()).expand(3, -1).clone()
    # runs of equal is_image: [start, end)
    change = torch.nonzero(is_image[1:] != is_image[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), ids.numel()]
    parts: list[torch.Tensor] = []
    cursor, image = 0, 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if not bool(is_image[start]):
            parts.append(torch.arange(cursor, cursor + length).expand(3, -1))
            cursor += length
            continue
        while length > 0:
            if image >= len(grids):
                raise ValueError(f"row {row}: more image-pad tokens than its {len(grids)} image(s) give")
            t, h, w = (int(x) for x in grids[image])
            if h % merge or w % merge:
                raise ValueError(f"row {row}: image {image} grid {(t, h, w)} is not a multiple of the merge size {merge}")
            gh, gw = h // merge, w // merge
            count = t * gh * gw
            if count > length:
                raise ValueError(f"row {row}: image {image} needs {count} image-pad tokens, its run has {length}")
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
            parts.append(grid.reshape(3, -1) + cursor)
            cursor += max(t, gh, gw)  # the image's largest position + 1
            length -= count
            image += 1
    if image != len(grids):
        raise ValueError(f"row {row}: {len(grids)} image(s) but image-pad tokens for {image}")
    return torch.cat(parts, 1)


def mrope_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    image_grid_thw: Sequence[torch.Tensor | None], *, image_token_id: int, merge: int) -> torch.Tensor:
    """``(3, B, S)`` int64 positions of a rollout batch ``input_ids (B, S)``: each row from its valid
    tokens only (:func:`row_mrope`), 0 on padding. ``image_grid_thw[b]``: row b's grids ``(n_b, 3)``
    (None or empty: a text-only row). Host tensors (a device batch is read once)."""
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    if len(image_grid_thw) != ids.shape[0]:
        raise ValueError(f"image_grid_thw has {len(image_grid_thw)} rows, the batch {ids.shape[0]}")
    out = torch.zeros(3, *ids.shape, dtype=torch.long)
    for b in range(ids.shape[0]):
        out[:, b, mask[b]] = row_mrope(ids[b][mask[b]], image_grid_thw[b], image_token_id=image_token_id,
                                       merge=merge, row=b)  # fmt: skip
    return out


def lm_positions(text: torch.Tensor, mrope: torch.Tensor) -> torch.Tensor:
    """The language model's ``(4, rows, T)`` position ids: ``text (rows, T)`` (the plain position,
    restarting per sequence of a packed row) over ``mrope (3, rows, T)``."""
    return torch.cat([text.reshape(1, *mrope.shape[1:]).to(mrope.dtype), mrope])
