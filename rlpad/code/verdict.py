"""Whether a case's output is right: verl 0.9.1's prime_code comparisons, done by the driver outside the
sandbox on what the program produced (its stdout text, or its return value decoded).

stdin cases: the program's stdout lines (``str.splitlines``) against the expected text, trying in turn:

1. the lines joined by ``\\n``, stripped, equal the expected text stripped (also with every line stripped);
2. the lines are exactly ``[expected]``;
3. the lines equal the expected text's non-empty lines (``split("\\n")``), each stripped;
4. the same with the program's empty lines dropped;
5. numbers: unless every pair of (non-empty) lines is an integer (``str.isdigit``), both sides read as
   floats, one per line, equal in count and ``numpy.allclose`` (rtol 1e-5, atol 1e-8).

call-based cases: the return value (a tuple read as a list) equals the expected value, or its first
element when that is a non-empty list, or (a list of tuples) equals that first element with each
tuple read as a list.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["call_passes", "stdin_passes"]


def _int_like(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.isdigit())


def _numbers_close(lines: list[str], expected: list[str]) -> bool:
    try:
        if all(_int_like(a) and _int_like(b) for a, b in zip(lines, expected, strict=True)):
            return False  # integers were compared as text already
        got, want = [float(x) for x in lines], [float(x) for x in expected]
        return len(got) == len(want) and bool(np.allclose(got, want))
    except (ValueError, TypeError, OverflowError):  # lengths differ, or a line is not a number
        return False


def stdin_passes(stdout: str, expected: str) -> bool:
    """verl's verdict on a stdin case (module docstring)."""
    lines = stdout.splitlines()
    want = expected.strip()
    if "\n".join(lines).strip() == want or "\n".join(line.strip() for line in lines).strip() == want:
        return True
    if lines == [expected]:
        return True
    expected_lines = [x.strip() for x in expected.split("\n") if x]
    if lines == expected_lines:
        return True
    non_empty = [line for line in lines if line]
    return non_empty == expected_lines or _numbers_close(non_empty, expected_lines)


def call_passes(value: Any, expected: Any) -> bool:
    """verl's verdict on a call-based case (module docstring)."""
    if isinstance(value, tuple):
        value = list(value)
    if value == expected:
        return True
    if isinstance(expected, list) and expected and value == expected[0]:
        return True
    try:
        if isinstance(value[0], tuple):
            return [list(x) for x in value] == expected[0]
    except (IndexError, KeyError, TypeError):
        pass
    return False
