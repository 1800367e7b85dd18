"""Reading the images of a prompt row, verl's format: the column ``data.image_key`` holds a list with one
entry per ``<image>`` placeholder, each raw bytes, a path, or a mapping with ``bytes`` or ``path``
(what a parquet column of images holds, e.g. ``{"bytes": b"...", "path": None}``). Every image is
decoded (and converted to RGB) when the dataset is built, so an unreadable one fails before any compute,
named by its file, row and index.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["IMAGE_PLACEHOLDER", "count_placeholders", "load_image", "row_images", "row_videos"]

IMAGE_PLACEHOLDER = "<image>"  # verl's placeholder in a message's text: one per image, in order


def count_placeholders(messages: Sequence[Mapping[str, Any]]) -> int:
    """``<image>`` placeholders in the messages' string contents."""
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence | np.ndarray) and not isinstance(value, str | bytes | bytearray | Mapping)


def load_image(value: Any, where: str, base_dir: str | None = None) -> Image.Image:
    """One image cell (bytes, a path, or ``{"bytes" | "path": ...}``) decoded to an RGB PIL image; a
    relative path is read from ``base_dir`` (the data file's folder) when given. ValueError naming
    ``where`` for anything else or an image that does not decode."""
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
        if data is None and not path:
            raise ValueError(f"{where}: an image mapping needs 'bytes' or 'path', it has {sorted(value)}")
        value = data if data is not None else path
    if isinstance(value, str | os.PathLike):
        path = os.fspath(value)
        if base_dir is not None and not os.path.isabs(path):
            path = os.path.join(base_dir, path)
        if not os.path.isfile(path):
            raise ValueError(f"{where}: image file not found: {path!r}")
        source: Any = path
    elif isinstance(value, bytes | bytearray | memoryview):
        source = io.BytesIO(bytes(value))
    else:
        raise ValueError(f"{where}: an image must be bytes, a path or a {{'bytes'|'path'}} mapping, "
                         f"got {type(value).__name__}")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except Exception as e:  # PIL raises several types for undecodable data
        raise ValueError(f"{where}: unreadable image ({type(e).__name__}: {e})") from None


def row_images(row: Mapping[str, Any], key: str, where: str, base_dir: str | None = None) -> list[Image.Image]:
    """The decoded images of a row's column ``key`` ([] when the row has no such column or it is null)."""
    cell = row.get(key)
    if cell is None:
        return []
    if not _is_list(cell):
        cell = [cell]  # one image given bare
    return [load_image(v, f"{where}: column {key!r} image {i}", base_dir) for i, v in enumerate(cell)]


def row_videos(row: Mapping[str, Any], key: str) -> int:
    """How many videos a row's column ``key`` holds (0 for none or null)."""
    cell = row.get(key)
    if cell is None:
        return 0
    return len(cell) if _is_list(cell) else 1
