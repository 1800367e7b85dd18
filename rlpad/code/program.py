"""What a code response and its ground truth hold: the program (verl's extraction) and the test cases
(verl's data sets' format), checked before anything runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["FENCE", "CaseSet", "extract_program", "has_code_block", "parse_cases"]

FENCE = "```python"


def extract_program(response: str) -> str:
    """verl's rule: the text after the last ```` ```python```` up to the next ```` ``` ```` (or the end); a response
    without that fence is taken whole up to its first ```` ``` ```` (a bare program is run as it is)."""
    return response.split(FENCE)[-1].split("```")[0]


def has_code_block(response: str) -> bool:
    return FENCE in response


@dataclass(frozen=True)
class CaseSet:
    """A problem's test cases. ``fn_name`` None: stdin cases (``inputs`` / ``outputs`` are texts); else
    call-based: ``inputs`` are argument lists, ``outputs`` the expected return values (verl's parsing
    applied: one JSON value per input line, integer dict keys restored)."""

    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    fn_name: str | None
    digest: str  # sha256 of the ground truth as given: one case set, one key

    def __len__(self) -> int:
        return len(self.inputs)


def _int_keys(value: Any) -> Any:
    """verl's undoing of JSON's string keys: ``{int(k): v}`` when every key converts, else unchanged."""
    try:
        return {int(k): v for k, v in value.items()}
    except (ValueError, TypeError):
        return value


def _call_args(raw: Any) -> list[Any]:
    args = [json.loads(line) for line in raw.split("\n")] if isinstance(raw, str) else list(raw)
    if args and isinstance(args[0], dict):  # verl keeps only the first argument then (a singleton list)
        converted = _int_keys(args[0])
        if converted is not args[0]:
            args = [converted]
    return args


def _call_output(raw: Any) -> Any:
    out = json.loads(raw) if isinstance(raw, str) else raw
    if isinstance(out, dict):
        converted = _int_keys(out)
        out = [converted] if converted is not out else out
    if isinstance(out, list) and out and isinstance(out[0], dict):
        converted = _int_keys(out[0])
        out = [converted] if converted is not out[0] else out
    return out


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # verl joins a list of lines
    raise ValueError(f"{what} must be a string or a list of strings, got {type(value).__name__}")


def parse_cases(ground_truth: Any) -> CaseSet:
    """The test cases of a ground truth in verl's format: a dict or its JSON text with ``inputs`` and
    ``outputs`` (equal-length lists) and optionally ``fn_name`` (call-based). ValueError saying what is wrong."""
    raw = ground_truth
    try:
        gt = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    except json.JSONDecodeError as e:
        raise ValueError(f"code ground_truth is not JSON ({e}); verl's format: "
                         '{"inputs": [...], "outputs": [...], "fn_name": optional}') from None
    if not isinstance(gt, dict) or not isinstance(gt.get("inputs"), list) or not isinstance(gt.get("outputs"), list):
        raise ValueError("code ground_truth needs 'inputs' and 'outputs' lists (verl's format: "
                         f'{{"inputs": [...], "outputs": [...], "fn_name": optional}}), got {str(raw)[:120]!r}')
    inputs, outputs, fn_name = gt["inputs"], gt["outputs"], gt.get("fn_name")
    if len(inputs) != len(outputs):
        raise ValueError(f"code ground_truth has {len(inputs)} inputs and {len(outputs)} outputs")
    if not inputs:
        raise ValueError("code ground_truth has no test cases (verl would score every program 1.0)")
    if fn_name is not None and not isinstance(fn_name, str):
        raise ValueError(f"code ground_truth fn_name must be a string, got {fn_name!r}")
    try:
        if fn_name is None:
            ins = tuple(_text(v, "a stdin case's input") for v in inputs)
            outs = tuple(_text(v, "a stdin case's output") for v in outputs)
        else:
            ins = tuple(_call_args(v) for v in inputs)
            outs = tuple(_call_output(v) for v in outputs)
    except (json.JSONDecodeError, AttributeError, TypeError) as e:
        raise ValueError(f"code ground_truth (fn_name {fn_name!r}): a case is not JSON lines / JSON ({e})") from None
    blob = raw if isinstance(raw, str) else json.dumps(raw, sort_keys=True, default=repr)
    return CaseSet(ins, outs, fn_name, hashlib.sha256(str(blob).encode("utf-8", "surrogatepass")).hexdigest())
