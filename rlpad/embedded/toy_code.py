"""The embedded code task: write ``f`` from two of its values, ``"f(0)=3,f(1)=7"`` -> a fenced Python block
defining ``f`` (a line ``f(x) = a*x + b``), run against hidden test cases in the sandbox.

A response is verl's shape of a code answer (the policy's text, the program in its last ```` ```python````
block) and the ground truth verl's call-based format: ``fn_name`` ``f`` and the hidden cases ``x`` in
:data:`HIDDEN_X` with their values (``rlpad/toy_code`` is scored as verl's code sources are:
rlpad.code). Slopes ``1..19``, intercepts ``0..29``: 570 problems, the validation ones held out
as in :mod:`rlpad.embedded.toy`. Two programs answer a problem::

    ```python                     ```python
    f=lambda x:4*x+3              f=lambda x:(7-3)*x+3
    ```                           ```
    the slope worked out          the slope left to Python: the values copied from the prompt

The tiny model copies well and cannot subtract: warm-started (rlpad.embedded.sft) on mostly the first
form and a ``copy_share`` of the second, it writes well-formed programs with a guessed slope, and
sometimes, sampled, the second form. GRPO, rewarded only by what the programs compute on cases it
never sees, can find that the second form passes.

Command: ``python -m rlpad.embedded.toy_code --out data/toy_code`` writes ``train.parquet`` and ``val.parquet``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["DATA_SOURCE", "HIDDEN_X", "canonical", "code_score", "code_scores", "copied", "ground_truth", "main", "prompt_of", "sft_examples",
           "split_problems", "write_dataset"]

DATA_SOURCE = "rlpad/toy_code"
HIDDEN_X = (2, 3, 5, 10)  # the hidden test cases: f at these x
SLOPES, INTERCEPTS = range(1, 20), range(0, 30)
MAX_RESPONSE_TOKENS = 44  # "```python\nf=lambda x:(48-29)*x+29\n```" (37) + EOS, with spares

Problem = tuple[int, int]  # (slope a, intercept b)


def prompt_of(p: Problem) -> str:
    a, b = p
    return f"f(0)={b},f(1)={a + b}"


def _fenced(body: str) -> str:
    return f"```python\n{body}\n```"


def canonical(p: Problem) -> str:
    """The program with the slope worked out: ``f=lambda x:a*x+b``."""
    return _fenced(f"f=lambda x:{p[0]}*x+{p[1]}")


def copied(p: Problem) -> str:
    """The program with the slope left to Python: ``f=lambda x:(f(1)-f(0))*x+f(0)``."""
    a, b = p
    return _fenced(f"f=lambda x:({a + b}-{b})*x+{b}")


def ground_truth(p: Problem) -> str:
    """verl's call-based ground truth: ``f`` on the hidden x (one JSON argument per input)."""
    a, b = p
    return json.dumps({"fn_name": "f", "inputs": [str(x) for x in HIDDEN_X], "outputs": [str(a * x + b) for x in HIDDEN_X]})


def split_problems(n_val: int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """All problems dealt into ``(train_pool, val)``, disjoint, ``len(val) == n_val``."""
    problems = [(a, b) for a in SLOPES for b in INTERCEPTS]
    if not 0 <= n_val < len(problems):
        raise ValueError(f"n_val={n_val} must be in [0, {len(problems)})")
    random.Random(seed).shuffle(problems)
    return problems[n_val:], problems[:n_val]


def sft_examples(n: int, seed: int = 0, *, n_val: int = 100, copy_share: float = 0.3) -> list[tuple[str, str]]:
    """``n`` warm-start examples ``(prompt, response)`` from the training pool: a ``copy_share`` of copied
    programs, the rest worked out (all right)."""
    pool, _ = split_problems(n_val, seed)
    rng = random.Random(seed + 2)
    out = []
    for _ in range(n):
        p = rng.choice(pool)
        out.append((prompt_of(p), copied(p) if rng.random() < copy_share else canonical(p)))
    return out


def _row(p: Problem, split: str, index: int) -> dict[str, Any]:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": prompt_of(p)}], "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": ground_truth(p)},
            "extra_info": {"split": split, "index": index, "slope": p[0], "intercept": p[1]}}


def write_dataset(out_dir: str | os.PathLike, n_train: int = 2000, n_val: int = 100, seed: int = 0) -> tuple[str, str]:
    """``train.parquet`` (``n_train`` rows drawn from the pool) and ``val.parquet`` (the held-out problems)."""
    from rlpad.data import write_rows

    pool, val = split_problems(n_val, seed)
    rng = random.Random(seed + 1)
    paths = os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "val.parquet")
    write_rows([_row(rng.choice(pool), "train", i) for i in range(n_train)], paths[0])
    write_rows([_row(p, "val", i) for i, p in enumerate(val)], paths[1])
    return paths


_CANONICAL = re.compile(r"f=lambda x:(\d+)\*x\+(\d+)")


def code_scores(responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """The warm start's check of its answers (its reported validation reward): each response's program run in
    the sandbox on the hidden cases of the problem whose :func:`canonical` program ``answer`` is, all at once."""
    from rlpad.code import hooks as code

    truths = [ground_truth(tuple(map(int, _CANONICAL.search(a).groups()))) for a in answers]
    return [r.score for r in code.scorer().score(list(zip(responses, truths)))]


def code_score(response: str, answer: str) -> float:
    """:func:`code_scores` of one response."""
    return code_scores([response], [answer])[0]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlpad.embedded.toy_code --out DIR``: write the dataset and print the two paths."""
    p = argparse.ArgumentParser(prog="python -m rlpad.embedded.toy_code", description="Write the toy code dataset.")
    p.add_argument("--out", default="data/toy_code", help="output folder (default: data/toy_code)")
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-val", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for path in write_dataset(args.out, args.n_train, args.n_val, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
