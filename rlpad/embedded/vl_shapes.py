"""The embedded vision-language task: questions about coloured squares on synthetic 56x56 images.

Each image is a light background split into four 28x28 quadrants (one image token each after the
2x2 merge); some quadrants hold a square (8-14 px, anywhere inside its quadrant) of red, green or blue.
Five kinds of prompt, answered by one character then EOS:

- ``<image>colour?``: the colour of the image's only square (r, g or b);
- ``<image>red?``: whether one of its 1-3 squares is red (y or n);
- ``<image>how many?``: how many squares (1-4);
- ``<image><image>how many?``: how many squares in the two images together (2-4);
- ``a+b=`` (text only, a, b in 0..4): the sum (a row without images in the same batch).

The questions are about what the images hold, not where: a rotary position moves attention scores,
not the values a token passes on, and a 2-layer model did not learn "which quadrant" from the
warm start's few hundred steps (measured: 0.2, chance, after 500 steps) while it learns colours.

Everything is generated from a seed (no download); the problems are dealt into a training pool and a
held-out validation set by their seeds, so the warm start never sees a validation image. The reward
(:func:`shapes_score`) is 1.0 for exactly the answer, else 0.0.

Command: ``python -m rlpad.embedded.vl_shapes --out data/vl_shapes`` writes ``train.parquet`` and
``val.parquet`` (images as PNG bytes in the ``images`` column, verl's format).
"""

from __future__ import annotations

import argparse
import io
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["DATA_SOURCE", "KINDS", "VERSION", "SIZE", "Problem", "images_of", "main", "make_problems", "png", "problem_row", "render",
           "shapes_score", "split_problems", "write_dataset"]

DATA_SOURCE = "rlpad/vl_shapes"
VERSION = "vl_shapes-2"  # bump when the problems change: it names the cached dataset and enters the warm start's key
SIZE = 56  # pixels per side: 2x2 image tokens of 28x28 pixels
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220)}
BACKGROUND = (236, 236, 230)
SIDE = (18, 26)  # a square's side in pixels (a quadrant is 28)
# (prompt kind, its share of the problems)
KINDS = (("colour", 0.3), ("red", 0.25), ("count", 0.2), ("count2", 0.1), ("sum", 0.15))
N_TRAIN, N_VAL = 4000, 200


@dataclass(frozen=True)
class Problem:
    """One question: its prompt text (with ``<image>`` placeholders), answer, and images as
    ``{quadrant (0-3): colour name}`` scenes (each rendered from ``seed``)."""

    kind: str
    text: str
    answer: str
    scenes: tuple[tuple[tuple[int, str], ...], ...]
    seed: int


def render(scene: Sequence[tuple[int, str]], seed: int) -> Image.Image:
    """The 56x56 image of ``scene`` (quadrant -> colour): each square's size and place drawn from ``seed``."""
    rng = random.Random(seed)
    pixels = np.empty((SIZE, SIZE, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    half = SIZE // 2
    for quadrant, colour in scene:
        side = rng.randint(*SIDE)
        top = (quadrant // 2) * half + rng.randint(0, half - side)
        left = (quadrant % 2) * half + rng.randint(0, half - side)
        pixels[top:top + side, left:left + side] = COLOURS[colour]
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    """``image`` as PNG bytes (what the dataset's image cells hold)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _scene(rng: random.Random, *, red: bool, count: int | None = None) -> tuple[tuple[int, str], ...]:
    count = count if count is not None else rng.randint(1, 3)
    count = max(count, int(red))
    quadrants = rng.sample(range(4), count)
    colours = ["red"] * red + [rng.choice(("green", "blue")) for _ in range(count - red)]
    return tuple(sorted(zip(quadrants, colours)))


def _problem(seed: int) -> Problem:
    rng = random.Random(seed)
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    if kind == "colour":
        colour = rng.choice(sorted(COLOURS))
        return Problem(kind, "<image>colour?", colour[0], (((rng.randrange(4), colour),),), seed)
    if kind == "red":
        red = rng.random() < 0.5
        return Problem(kind, "<image>red?", "y" if red else "n", (_scene(rng, red=red),), seed)
    if kind == "count":
        scene = _scene(rng, red=rng.random() < 0.5, count=rng.randint(1, 4))
        return Problem(kind, "<image>how many?", str(len(scene)), (scene,), seed)
    if kind == "count2":
        scenes = tuple(_scene(rng, red=rng.random() < 0.5, count=rng.randint(1, 2)) for _ in range(2))
        return Problem(kind, "<image><image>how many?", str(sum(map(len, scenes))), scenes, seed)
    a, b = rng.randint(0, 4), rng.randint(0, 4)
    return Problem(kind, f"{a}+{b}=", str(a + b), (), seed)


def make_problems(seeds: Sequence[int]) -> list[Problem]:
    """The problems of ``seeds`` (each one deterministic in its seed)."""
    return [_problem(s) for s in seeds]


def split_problems(n_val: int = N_VAL, seed: int = 0, n_train: int = N_TRAIN) -> tuple[list[Problem], list[Problem]]:
    """``(train pool, validation)``: disjoint problem seeds, dealt from ``seed``."""
    seeds = random.Random(seed).sample(range(10 ** 7), n_train + n_val)
    return make_problems(seeds[n_val:]), make_problems(seeds[:n_val])


def images_of(problem: Problem) -> list[Image.Image]:
    """The problem's images, rendered."""
    return [render(scene, problem.seed * 8 + i) for i, scene in enumerate(problem.scenes)]


def problem_row(problem: Problem, split: str, index: int) -> dict[str, Any]:
    """The problem as a dataset row in verl's format (images as ``{"bytes": PNG, "path": None}``)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.text}],
        "images": [{"bytes": png(im), "path": None} for im in images_of(problem)],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"split": split, "index": index, "kind": problem.kind},
    }


def write_dataset(out_dir: str, *, n_val: int = N_VAL, seed: int = 0) -> tuple[str, str]:
    """``train.parquet`` and ``val.parquet`` under ``out_dir``; returns their paths."""
    from rlpad.data import write_rows

    train, val = split_problems(n_val, seed)
    paths = []
    for split, problems in (("train", train), ("val", val)):
        path = os.path.join(out_dir, f"{split}.parquet")
        write_rows([problem_row(p, split, i) for i, p in enumerate(problems)], path)
        paths.append(path)
    return paths[0], paths[1]


def shapes_score(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the response is exactly the answer (generation stops at EOS), else 0.0."""
    return float(solution_str == str(ground_truth).strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlpad.embedded.vl_shapes", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/vl_shapes")
    parser.add_argument("--n-val", type=int, default=N_VAL)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(*write_dataset(args.out, n_val=args.n_val, seed=args.seed), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
