"""Record verl's own validation metrics on rlpad's parity cases (tests/test_validation_metrics.py).

Run with an interpreter that has verl installed (its own venv; rlpad is not imported here)::

    /path/to/verl-venv/bin/python scripts/verl_val_parity.py --out tests/fixtures/verl_val_metrics.json

The cases are defined here, once: validation outputs of three data sources shaped like what verl's
reward loop hands its trainer (a function returning a number: ``acc`` = the score; verl's DAPO scorer:
``score`` / ``acc`` / ``pred``; a function returning ``score`` and ``pred`` without ``acc``), at
N = 1, 4, 16 responses per prompt, answers drawn from few values so that majority votes tie, rows
with no ``pred``, and one case at another bootstrap seed. Per case: the inputs, verl 0.9.1's
``process_validation_metrics`` and the metric names its trainer logs (``RayPPOTrainer._val_metrics_update``,
taken from verl's source file and run as it is: importing ray_trainer needs packages the CPU install
lacks).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import sys
from pathlib import Path

import numpy as np

SOURCES = {"openai/gsm8k": 5, "math_dapo": 4, "qa/custom": 3}  # data source -> prompts
ANSWERS = ("12", "13", "14")  # few distinct answers: votes tie often


def row_info(source: str, rng: random.Random, prompt: int, k: int) -> tuple[float, dict]:
    """(reward, extra info) of one response, with every key every row has (None where a source has none)."""
    if source == "openai/gsm8k":  # a function returning a number: verl's reward loop adds acc = score
        score = float(rng.random() < 0.4)
        return score, {"acc": score, "score": None, "pred": None}
    if source == "math_dapo":  # verl's DAPO scorer: +-1, acc a bool, the extracted answer
        pred = rng.choice(ANSWERS)
        right = pred == "13"
        return (1.0 if right else -1.0), {"acc": right, "score": 1.0 if right else -1.0, "pred": pred}
    score = round(rng.random(), 3)  # a graded score and an answer, no acc; prompt 1 misses one answer
    pred = None if (prompt == 1 and k == 0) else rng.choice(ANSWERS[:2])
    return score, {"acc": None, "score": score, "pred": pred}


def validation_case(name: str, n: int, seed: int = 42, data_seed: int = 0) -> dict:
    """Rows prompt-major (each prompt's n responses together), the sources' prompts interleaved."""
    rng = random.Random(data_seed * 1000 + n)
    prompts = [(s, p) for s, count in SOURCES.items() for p in range(count)]
    rng.shuffle(prompts)
    sources, uids, variables = [], [], {"reward": [], "acc": [], "score": [], "pred": []}
    for source, p in prompts:
        for k in range(n):
            reward, info = row_info(source, rng, p, k)
            sources.append(source)
            uids.append(f"{source}-{p}")
            variables["reward"].append(reward)
            for key, value in info.items():
                variables[key].append(value)
    return {"name": name, "n": n, "seed": seed, "data_sources": sources, "uids": uids, "variables": variables}


def tie_case() -> dict:
    """Hand-made votes at N = 4: 2-2 splits with different values, all answers distinct, one answer."""
    rows = [("A", 1.0), ("A", 1.0), ("B", 0.0), ("B", 0.0),  # a 2-2 split: the answer drawn first wins
            ("B", 0.0), ("A", 1.0), ("B", 0.0), ("A", 1.0),
            ("A", 1.0), ("B", 0.0), ("C", 0.0), ("D", 0.5),  # all distinct when C and D are drawn
            ("A", 0.25), ("A", 0.75), ("A", 0.5), ("A", 1.0)]  # one answer, values differ: the first drawn counts
    sources = ["ties"] * len(rows)
    uids = [f"p{i // 4}" for i in range(len(rows))]
    return {"name": "ties", "n": 4, "seed": 42, "data_sources": sources, "uids": uids,
            "variables": {"reward": [v for _, v in rows], "pred": [a for a, _ in rows]}}


def cases() -> list[dict]:
    return [validation_case("n1", 1), validation_case("n4", 4), validation_case("n16", 16), tie_case(),
            validation_case("n4-seed7", 4, seed=7, data_seed=1)]


def verl_metric_namer():
    """verl's ``RayPPOTrainer._val_metrics_update``, compiled from its source file as a plain function."""
    from verl.trainer.ppo import metric_utils

    path = Path(importlib.util.find_spec("verl").submodule_search_locations[0]) / "trainer" / "ppo" / "ray_trainer.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RayPPOTrainer")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_val_metrics_update")
    scope = {"np": np, "process_validation_metrics": metric_utils.process_validation_metrics}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["_val_metrics_update"]


def plain(tree):
    if isinstance(tree, dict):
        return {k: plain(v) for k, v in tree.items()}
    return float(tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    args = parser.parse_args()
    import verl
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    name_metrics = verl_metric_namer()
    out = {"verl": verl.__version__, "cases": []}
    for case in cases():
        args_ = (np.array(case["data_sources"], dtype=object), case["uids"], case["variables"])
        per_source = process_validation_metrics(*args_, seed=case["seed"])
        case["per_source"] = plain(per_source)
        if case["seed"] == 42:  # the trainer calls it with the default seed
            case["keys"] = {k: float(v) for k, v in name_metrics(None, *args_, []).items()}
        out["cases"].append(case)
    text = json.dumps(out, indent=1, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
