"""The embedded multi-turn task: two-digit addition with a calculator tool, ``"34+58="`` -> ``"92"``.

The tiny model cannot add two-digit numbers reliably by itself; it can learn to copy. The trace
it may write (bracket tool-call format, rlpad.rollout.tools)::

    34+58=  [calc(34+58)]  92  92<eos>
    prompt  generated      tool generated

The tool's ``92`` is context (response_mask 0); the model copies it into its answer. The
warm start (rlpad.embedded.sft) sees a mix of such traces (``tool_share`` of them, the tool's
output outside the loss) and direct answers (mostly wrong sums), so GRPO has something to learn:
call the tool and copy its result. Operands ``10..max_operand`` (default 99); validation
problems held out as in :mod:`rlpad.embedded.toy`.

Reward (:func:`tools_score`, ``data_source == "rlpad/toy_tools"``): 1.0 if the model's own text
after its last tool call (all of it without one) is exactly the sum, else 0.0.
"""

from __future__ import annotations

import os
import random
import re
from typing import Any

__all__ = ["DATA_SOURCE", "calc", "sft_examples", "split_pairs", "tools_score", "write_dataset"]

DATA_SOURCE = "rlpad/toy_tools"
LOW = 10
Segment = tuple[str, bool]  # (text, in the loss)


def calc(expression: str) -> str:
    """The calculator tool: integers joined by ``+ - *``, evaluated; ValueError for anything else.

    Args:
        expression: integers joined by + - * (e.g. 34+58)
    """
    if not re.fullmatch(r"\s*\d{1,6}(\s*[-+*]\s*\d{1,6}){0,4}\s*", expression):
        raise ValueError(f"not an arithmetic expression: {expression[:40]}")
    total, sign, term = 0, 1, None
    for tok in re.findall(r"\d+|[-+*]", expression):  # left to right, * before + and -
        if tok.isdigit():
            term = int(tok) if term is None else term * int(tok)
        elif tok == "*":
            continue
        else:
            total, sign, term = total + sign * term, (1 if tok == "+" else -1), None
    return str(total + sign * term)


def split_pairs(n_val: int, seed: int = 0, max_operand: int = 99) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All ``(a, b)`` with operands in ``[10, max_operand]`` dealt into ``(train_pool, val)``, disjoint."""
    pairs = [(a, b) for a in range(LOW, max_operand + 1) for b in range(LOW, max_operand + 1)]
    if not 0 <= n_val < len(pairs):
        raise ValueError(f"n_val={n_val} must be in [0, {len(pairs)}) for operands {LOW}..{max_operand}")
    random.Random(seed).shuffle(pairs)
    return pairs[n_val:], pairs[:n_val]


def trace(a: int, b: int, use_tool: bool) -> list[Segment]:
    """The answer segments of one warm-start example: the call, the tool's output (not trained), the sum."""
    if not use_tool:
        return [(str(a + b), True)]
    return [(f"[calc({a}+{b})]", True), (calc(f"{a}+{b}"), False), (str(a + b), True)]


def sft_examples(n: int, seed: int = 0, *, n_val: int = 100, max_operand: int = 99,
                 tool_share: float = 0.2) -> list[tuple[str, list[Segment]]]:
    """``n`` warm-start examples ``(prompt, answer segments)`` from the training pool; a ``tool_share``
    of them call the tool, the rest answer directly (with a wrong sum: what the model would guess)."""
    pool, _ = split_pairs(n_val, seed, max_operand)
    rng = random.Random(seed + 2)
    out = []
    for _ in range(n):
        a, b = rng.choice(pool)
        if rng.random() < tool_share:
            out.append((f"{a}+{b}=", trace(a, b, True)))
        else:
            wrong = a + b + rng.choice([-11, -10, -2, -1, 1, 2, 10, 11])
            out.append((f"{a}+{b}=", [(str(wrong), True)]))
    return out


def _row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index, "a": a, "b": b}}


def write_dataset(out_dir: str | os.PathLike, n_train: int = 2000, n_val: int = 100, seed: int = 0,
                  max_operand: int = 99) -> tuple[str, str]:
    """``train.parquet`` (``n_train`` rows drawn from the pool) and ``val.parquet`` (the held-out problems)."""
    from rlpad.data import write_rows

    pool, val = split_pairs(n_val, seed, max_operand)
    rng = random.Random(seed + 1)
    paths = os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "val.parquet")
    write_rows([_row(*rng.choice(pool), "train", i) for i in range(n_train)], paths[0])
    write_rows([_row(a, b, "val", i) for i, (a, b) in enumerate(val)], paths[1])
    return paths


def tools_score(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the text after the last tool call (the whole text without one) is exactly the answer."""
    answer = solution_str.rpartition(")]")[2]
    return float(answer == str(ground_truth).strip())
