"""The embedded Python-tool task: two-digit multiplication, ``"34*58="`` -> ``"1972"``, solved by writing
a program for the sandboxed Python tool (``rlpad.rollout.python_tool:py``) and copying what it prints.

The tiny model cannot multiply; it can learn to write the call and copy (four digits at most: the
tiny model did not learn to copy the six of three-digit products in its warm start). The trace
(bracket tool-call format)::

    34*58=  [py(print(34*58))]  1972  1972<eos>
    prompt  generated           tool  generated

The tool's ``1972`` is context (response_mask 0). The warm start (rlpad.embedded.sft) sees a
``tool_share`` of such traces and direct answers (wrong products, what the model would guess), so GRPO
has something to learn: call the tool and copy. Operands ``10..max_operand``; validation problems held
out. Reward (``data_source == "rlpad/toy_python"``): :func:`rlpad.embedded.toy_tools.tools_score`, 1.0 if
the model's own text after its last call is exactly the product.
"""

from __future__ import annotations

import os
import random
from typing import Any

from rlpad.embedded.toy_tools import LOW, Segment, split_pairs  # the same operand pairs, dealt alike

__all__ = ["DATA_SOURCE", "LOW", "sft_examples", "split_pairs", "trace", "write_dataset"]

DATA_SOURCE = "rlpad/toy_python"


def trace(a: int, b: int) -> list[Segment]:
    """The answer segments of a tool trace: the program, what it prints (not trained), the product."""
    return [(f"[py(print({a}*{b}))]", True), (str(a * b), False), (str(a * b), True)]


def sft_examples(n: int, seed: int = 0, *, n_val: int = 100, tool_share: float = 0.3) -> list[tuple[str, list[Segment]]]:
    """``n`` warm-start examples ``(prompt, answer segments)``: a ``tool_share`` of tool traces, the rest
    direct answers off the product (what the model would guess)."""
    pool, _ = split_pairs(n_val, seed)
    rng = random.Random(seed + 2)
    out = []
    for _ in range(n):
        a, b = rng.choice(pool)
        if rng.random() < tool_share:
            out.append((f"{a}*{b}=", trace(a, b)))
        else:
            out.append((f"{a}*{b}=", [(str(a * b + rng.choice([-100, -10, -1, 1, 10, 100])), True)]))
    return out


def _row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index, "a": a, "b": b}}


def write_dataset(out_dir: str | os.PathLike, n_train: int = 2000, n_val: int = 100, seed: int = 0) -> tuple[str, str]:
    """``train.parquet`` (``n_train`` rows from the pool) and ``val.parquet`` (the held-out problems)."""
    from rlpad.data import write_rows

    pool, val = split_pairs(n_val, seed)
    rng = random.Random(seed + 1)
    paths = os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "val.parquet")
    write_rows([_row(*rng.choice(pool), "train", i) for i in range(n_train)], paths[0])
    write_rows([_row(a, b, "val", i) for i, (a, b) in enumerate(val)], paths[1])
    return paths
