"""A reward function for tests that returns what verl's math scorers return: the score and the answer it
extracted (``{"score": ..., "pred": ...}``), so validation can vote (maj@k). The answer is the whole
response, stripped; right when it is the ground truth."""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, Any]:
    pred = solution_str.strip()
    return {"score": float(pred == str(ground_truth).strip()), "pred": pred}
