"""The embedded default's toy task: small-number addition, ``"12+7="`` -> ``"19"`` then EOS.

Operands are ``0..max_operand`` (default 20, so 441 distinct problems). Validation problems are
held out: :func:`split_pairs` deals the shuffled problems into a validation set and a disjoint
training pool, and the training set and the supervised warm-start draw only from the pool, so
validation reward measures generalisation to unseen sums.

Rewards (both in [0, 1]):

- :func:`toy_score` (the default for ``data_source == "rlpad/toy_add"``): 1.0 if the whole
  response is exactly the answer, else 0.0. Generation stops at EOS, so this means "the answer
  then EOS" (a response cut by the length limit carries extra characters and scores 0).
- :func:`toy_partial_score` (``reward.fn: rlpad.embedded.toy:toy_partial_score``): 1.0 exact; 0.5 for
  the right answer followed by more text; 0.1 for a wrong bare integer; 0.0 otherwise.

Command: ``python -m rlpad.embedded.toy --out data/toy`` writes ``train.parquet`` and ``val.parquet``.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DATA_SOURCE", "main", "make_toy_rows", "sft_examples", "split_pairs", "toy_partial_score", "toy_score",
    "write_toy_dataset",
]

DATA_SOURCE = "rlpad/toy_add"

Pair = tuple[int, int]


def split_pairs(n_val: int, seed: int = 0, max_operand: int = 20) -> tuple[list[Pair], list[Pair]]:
    """All ``(a, b)`` problems dealt into ``(train_pool, val)`` with ``len(val) == n_val``, disjoint."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 <= n_val < len(pairs):
        raise ValueError(f"n_val={n_val} must be in [0, {len(pairs)}) for operands 0..{max_operand}")
    random.Random(seed).shuffle(pairs)
    return pairs[n_val:], pairs[:n_val]


def _row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def make_toy_rows(
    n: int,
    seed: int = 0,
    *,
    max_operand: int = 20,
    split: str = "train",
    pairs: Sequence[Pair] | None = None,
) -> list[dict[str, Any]]:
    """``n`` rows in verl's schema, problems drawn uniformly (with replacement) from ``pairs``
    (default: all problems with operands ``0..max_operand``)."""
    if pairs is None:
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not pairs:
        raise ValueError("no problems to draw rows from")
    rng = random.Random(seed)
    return [_row(*rng.choice(pairs), split=split, index=i) for i in range(n)]


def write_toy_dataset(
    out_dir: str | os.PathLike,
    n_train: int = 2000,
    n_val: int = 100,
    seed: int = 0,
    *,
    max_operand: int = 20,
    fmt: str = "parquet",
) -> tuple[str, str]:
    """Write ``train.<fmt>`` (``n_train`` rows from the training pool) and ``val.<fmt>`` (``n_val``
    distinct held-out problems) under ``out_dir``; returns their paths."""
    from rlpad.data import write_rows

    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"fmt={fmt!r} must be 'parquet' or 'jsonl'")
    pool, val_pairs = split_pairs(n_val, seed, max_operand)
    train_rows = make_toy_rows(n_train, seed + 1, split="train", pairs=pool)
    val_rows = [_row(a, b, "val", i) for i, (a, b) in enumerate(val_pairs)]
    paths = os.path.join(out_dir, f"train.{fmt}"), os.path.join(out_dir, f"val.{fmt}")
    write_rows(train_rows, paths[0])
    write_rows(val_rows, paths[1])
    return paths


def sft_examples(n: int, seed: int = 0, *, n_val: int = 100, max_operand: int = 20) -> list[tuple[str, str]]:
    """``n`` ``(prompt, answer)`` pairs such as ``("12+7=", "19")`` for the supervised warm-start,
    from the training pool of ``split_pairs(n_val, seed, max_operand)`` (no validation problem).
    The prompt is the user message; apply the chat template and append EOS to the answer."""
    pool, _ = split_pairs(n_val, seed, max_operand)
    rng = random.Random(seed + 2)
    return [(f"{a}+{b}=", str(a + b)) for a, b in (rng.choice(pool) for _ in range(n))]


def toy_score(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the response is exactly the answer (nothing before or after), else 0.0."""
    return float(solution_str == str(ground_truth).strip())


def toy_partial_score(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 exact; 0.5 right answer then more text; 0.1 a wrong bare integer; else 0.0."""
    truth = str(ground_truth).strip()
    if solution_str == truth:
        return 1.0
    if solution_str.startswith(truth) and not solution_str[len(truth)].isdigit():
        return 0.5
    return 0.1 if solution_str.isdigit() else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlpad.embedded.toy --out DIR``: write the toy dataset and print the two paths."""
    p = argparse.ArgumentParser(prog="python -m rlpad.embedded.toy", description="Write the toy addition dataset.")
    p.add_argument("--out", default="data/toy", help="output folder (default: data/toy)")
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-val", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    args = p.parse_args(argv)
    for path in write_toy_dataset(args.out, args.n_train, args.n_val, args.seed, max_operand=args.max_operand,
                                  fmt=args.format):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
