"""The default reward: verl 0.9.1's ``default_compute_score`` for the data sources it names.

A run that reads verl's data sets gets verl's numbers, so a verl user comparing curves compares the
same thing (tests/test_verl_parity.py checks every case against verl's own scorers, recorded in
tests/fixtures/verl_parity.json and re-run live where verl is installed). Written here from the
rules, not imported: verl is no dependency.

* ``openai/gsm8k``: the strict GSM8K reader. The last ``#### <number>`` in the response's last
  300 characters (a number: ``-``? then digits, ``.`` and ``,``), commas and ``$`` dropped, compared
  as TEXT with the ground truth: 1.0 or 0.0 (``#### $18`` and ``#### 18.00`` score 0 against 18).
* ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``: Hendrycks'
  MATH string equivalence on the last ``\\boxed{}`` (nothing boxed: 0.0): 1.0 or 0.0.
* ``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``: DAPO's scorer on the last 300
  characters: the last ``Answer: ...`` line (Minerva normalisation), else the last ``\\boxed{}`` of
  the last 100 characters compared verbatim; ``{"score": 1.0 | -1.0, "acc": 1.0 | 0.0, "pred": str}``.
* ``codecontests``, ``apps``, ``codeforces``, ``taco``: verl's prime_code (continuous): the program of the
  last ```` ```python```` block run on the test cases in rlpad's sandbox (rlpad.code, docs/code.md).
* The other names verl lists (``numina_*``: its prime_math grader; geometry3k; search-R1) have no equal
  here: they are refused, naming the data source.
* rlpad's own toy tasks (``rlpad/toy_*``): their scorers (verl does not name them); ``rlpad/toy_code``
  is scored as the code sources are.

rlpad's lenient verifier (numbers by value, math-verify) is :func:`rlpad.rewards.rules.compute_score`,
chosen with ``reward.fn: rlpad.rewards.rules:compute_score``.
"""

from __future__ import annotations

import re
from typing import Any

from rlpad.code.hooks import compute_score as code_score
from rlpad.code.sources import CODE_SOURCES, SCORED_SOURCES, TOY_CODE_SOURCE
from rlpad.rewards.toys import TOY_SCORERS

__all__ = ["VERL_UNSUPPORTED", "compute_score", "dapo_score", "gsm8k_strict_score", "math_equiv_score",
           "minerva_normalize", "scores_source", "strip_math_answer"]

GSM8K = ("openai/gsm8k",)
MATH = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO = ("math_dapo", "math", "math_dapo_reasoning")  # and every name starting with "aime"
# the names verl 0.9.1 routes to scorers rlpad has no equal of -> what verl uses there
VERL_UNSUPPORTED = {
    **{f"numina_{n}": "prime_math" for n in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12",
                                               "olympiads")},
    "hiyouga/geometry3k": "geo3k (mathruler)",
    **{f"searchR1_{n}": "search_r1_like_qa_em" for n in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa",
                                                          "musique", "bamboogle")},
}

_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_TAIL = 300  # verl reads only the end of a response (GSM8K and DAPO)


class _Malformed(Exception):
    """Where verl's normaliser raises: the raw strings are compared instead."""


# ----------------------------------------------------------------------------- openai/gsm8k


def gsm8k_strict_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 if the last ``#### <number>`` of the last 300 characters, ``,`` and ``$`` dropped, is the ground
    truth's text; else 0.0."""
    found = _GSM8K_ANSWER.findall(solution_str[-_TAIL:])
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "").replace("$", "") == ground_truth else 0.0


# ----------------------------------------------------------------------------- MATH (Hendrycks)


def _last_braced(text: str, start: int) -> str | None:
    """``text[start:]`` up to the ``}`` where the brace depth first returns to 0; None if it never does."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def _math_boxed_content(text: str) -> str | None:
    """The MATH reader's answer: after the last ``\\boxed `` (space form) up to a ``$``, or the inside of the
    last ``\\boxed{...}``; None if nothing is boxed or the braces never close; ``_Malformed`` for a
    ``\\fbox`` (verl finds it but cannot unwrap it: 0)."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    boxed = _last_braced(text, start)
    if boxed is None:
        return None
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise _Malformed(boxed)
    return boxed[len("\\boxed{"):-1]


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``; a bare trailing ``\\frac`` is malformed."""
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if not part:
            raise _Malformed(s)
        if part[0] == "{":
            out += part
        elif len(part) < 2:
            return s
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _fix_slash(s: str) -> str:
    """``a/b`` of two integers written canonically -> ``\\frac{a}{b}``."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _fix_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``; a bare trailing ``\\sqrt`` is malformed."""
    head, *parts = s.split("\\sqrt")
    out = head
    for part in parts:
        if not part:
            raise _Malformed(s)
        out += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return out


def strip_math_answer(s: str) -> str:
    """Hendrycks' MATH normal form: line breaks, ``\\!``, ``\\left``/``\\right``, degrees, ``\\$``, a right
    unit (``\\text{ ...}``), ``\\%`` and spaces dropped; ``tfrac``/``dfrac`` -> ``frac``; a leading ``.``
    gets a 0; a short ``k = `` prefix dropped; ``\\sqrt``/``\\frac`` braced; ``0.5`` and ``a/b`` -> fractions.
    ``_Malformed`` where that form is undefined (two right units, a bare ``\\sqrt`` or ``\\frac``)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:
        unit_split = s.split("\\text{ ")
        if len(unit_split) != 2:
            raise _Malformed(s)
        s = unit_split[0]
    s = s.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def _math_equiv(answer: str, truth: Any) -> bool:
    try:
        return strip_math_answer(answer) == strip_math_answer(truth)
    except (_Malformed, AttributeError, TypeError):
        return answer == truth


def math_equiv_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 if the last boxed answer is MATH-equivalent to the ground truth (:func:`strip_math_answer` of
    both equal, or the raw strings where that form is undefined); 0.0 otherwise or with nothing boxed."""
    try:
        answer = _math_boxed_content(solution_str)
    except _Malformed:
        return 0.0
    return 1.0 if answer is not None and _math_equiv(answer, ground_truth) else 0.0


# ----------------------------------------------------------------------------- DAPO (math_dapo, math, aime*)

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_INVALID = "[INVALID]"
# (text, replacement) applied in order, then each unit / filler word removed (Minerva's normalisation)
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
         "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
         "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
         "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
         ",\\!", "{,}", '"', "\\dots")


def minerva_normalize(answer: str) -> str:
    """An ``Answer:`` value in Minerva's normal form: the part after the last ``=``, the replacements and
    removals above, the first ``$...$`` kept, ``\\text{}``/``\\textbf{}``/``\\overline{}``/``\\boxed{}``
    unwrapped, ``\\fracab``/``\\sqrta`` braced, ``$`` dropped, commas of a plain integer dropped."""
    s = answer.split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for word in _DROP:
        s = s.replace(word, "")
    s = re.sub(r"(.*?)\$(.*?)\$(.*)", r"$\2$", s)
    for macro in ("text", "textbf", "overline"):
        s = re.sub(r"\\" + macro + r"\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _dapo_boxed(text: str) -> str | None:
    """The inside of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    boxed = None if start < 0 else _last_braced(text, start)
    return None if boxed is None else boxed[len("\\boxed{"):-1]


def dapo_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    """DAPO's reward on the last 300 characters: the last ``Answer:`` line, Minerva-normalised, against the
    normalised ground truth; without one, the last ``\\boxed{}`` of the last 100 characters against the
    ground truth verbatim. ``{"score": 1.0 | -1.0, "acc": 1.0 | 0.0, "pred": the answer read}``."""
    tail = solution_str[-_TAIL:]
    lines = _ANSWER_LINE.findall(tail)
    pred = minerva_normalize(lines[-1] if lines else _INVALID)
    correct = pred == minerva_normalize(ground_truth)
    if pred == _INVALID:
        boxed = _dapo_boxed(tail[-100:])
        if boxed is not None:
            pred, correct = boxed, boxed == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}


# ----------------------------------------------------------------------------- dispatch


def scores_source(data_source: str) -> bool:
    """:func:`compute_score` has a reward for ``data_source`` (else it raises, naming it)."""
    return (data_source in GSM8K or data_source in MATH or data_source in DAPO or str(data_source).startswith("aime")
            or data_source in TOY_SCORERS or data_source in SCORED_SOURCES)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    """verl 0.9.1's ``default_compute_score`` for the names it scores here (module docstring); rlpad's toy
    tasks by their scorers; ValueError naming the data source otherwise."""
    if data_source in GSM8K:
        return gsm8k_strict_score(solution_str, ground_truth)
    if data_source in MATH:
        return math_equiv_score(solution_str, ground_truth)
    if data_source in DAPO or str(data_source).startswith("aime"):
        return dapo_score(solution_str, ground_truth)
    if data_source in TOY_SCORERS:
        return TOY_SCORERS[data_source](solution_str, ground_truth, extra_info)
    if data_source in SCORED_SOURCES:
        return code_score(solution_str, ground_truth)
    if data_source in VERL_UNSUPPORTED:
        raise ValueError(f"data_source {data_source!r}: verl scores it with its {VERL_UNSUPPORTED[data_source]}, which "
                         "rlpad has no equal of; set reward.fn=package.module:function")
    raise ValueError(f"no default reward for data_source {data_source!r} (verl's names: "
                     f"{', '.join(GSM8K + MATH + DAPO + CODE_SOURCES)}, aime*; rlpad's toys: "
                     f"{', '.join((*TOY_SCORERS, TOY_CODE_SOURCE))}); set "
                     "reward.fn=rlpad.rewards.rules:compute_score (rlpad's lenient verifier) or "
                     "package.module:function")
