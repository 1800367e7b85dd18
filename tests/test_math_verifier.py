"""The math verifier (rlpad/rewards/math_verifier.py through rlpad.rewards.rules.math_verify_score): real math-verify on
boxed answers, LaTeX fractions, intervals and symbolic forms the normaliser cannot read; a pathological
answer is cut off by the timeout; without math-verify the normaliser decides."""

import subprocess
import sys
import time

import pytest

from rlpad.rewards.math_verifier import available, verify_answer
from rlpad.rewards.rules import boxed_score, compute_score, math_verify_score

pytestmark = pytest.mark.skipif(not available(), reason="math-verify is not installed (pip install math-verify)")

CASES = [  # (response, ground truth, right?, the normaliser gets it right too?)
    ("so the answer is \\boxed{42}.", "42", True, True),
    ("\\boxed{41}", "42", False, True),
    ("The probability is $\\boxed{\\dfrac{3}{4}}$", "0.75", True, True),
    ("\\boxed{\\frac{6}{8}}", "\\frac{3}{4}", True, True),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", True, False),
    ("\\boxed{\\left(0, 1\\right]}", "(0,1]", True, False),
    ("\\boxed{[0, 1)}", "(0,1]", False, True),
    ("\\boxed{x \\in (-\\infty, 2) \\cup (3, \\infty)}", "(-\\infty,2)\\cup(3,\\infty)", True, False),
    ("\\boxed{2\\pi}", "2 \\pi", True, False),
    ("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs... #### 18", True, True),  # a GSM8K-style solution as truth
]


@pytest.mark.parametrize("response,truth,right,normaliser_right", CASES)
def test_math_verify_decides_where_the_normaliser_cannot(response, truth, right, normaliser_right):
    assert math_verify_score(response, truth) == float(right)
    assert compute_score("HuggingFaceH4/MATH-500", response, truth) == float(right)  # the registry's scorer
    assert compute_score("math_dapo", response, truth) == float(right)
    # negative control: the normaliser alone is wrong on the symbolic ones
    assert (boxed_score(response, truth) == float(right)) == normaliser_right


def test_a_pathological_answer_is_cut_off_by_the_timeout():
    """9^(9^(9^9)) makes sympy compute a power in C for minutes; the check returns after its timeout,
    the normaliser scores it, and the next call (a fresh child) works."""
    verify_answer("\\boxed{1}", "1")  # the child is up before the clock starts
    start = time.perf_counter()
    assert verify_answer("\\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=1.0) is None
    assert math_verify_score("\\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=1.0) == 0.0
    assert time.perf_counter() - start < 30
    assert verify_answer("\\boxed{\\frac{1}{2}}", "0.5") is True


def test_without_math_verify_the_normaliser_decides():
    """In a process where math_verify cannot be imported, the math sources fall back to the normaliser:
    a fraction still matches, the symbolic answer does not."""
    code = ("import sys; sys.modules['math_verify'] = None\n"
            "import importlib.util as u; u.find_spec = lambda name, *a, _f=u.find_spec: None if name == 'math_verify' "
            "else _f(name, *a)\n"
            "from rlpad.rewards.rules import compute_score\n"
            "print(compute_score('math', '\\\\boxed{\\\\frac{6}{8}}', '0.75'),"
            " compute_score('math', '\\\\boxed{\\\\frac{\\\\sqrt{2}}{2}}', '\\\\sqrt{2}/2'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1.0", "0.0"]
