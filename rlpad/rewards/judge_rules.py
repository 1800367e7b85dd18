"""The generative judge's rules, torch-free (the config checks import them): its prompt template, how a
verdict becomes a score, the checks of ``reward.judge.*`` and the engine settings it runs with.

The parsing rule, stated once (docs/rewards.md quotes it):

- the verdict is the first group of the LAST match of ``reward.judge.score_pattern`` in the judge's text
  (the whole match when the pattern has no group);
- with ``reward.judge.verdicts`` the verdict is looked up there (case-insensitive, stripped): its value is
  the score; a verdict not listed is unparsable;
- otherwise the verdict is a number ``v``: ``v`` in ``[score_min, score_max]`` scores
  ``(v - score_min) / (score_max - score_min)`` (so in [0, 1]); a number outside the range is unparsable;
- no match, or an unparsable verdict: ``reward.judge.default_score``, and the row counts in
  ``reward/judge/unparsable``. Never an exception.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass

from rlpad.config.choices import DTYPES
from rlpad.config.rewards import JudgeConfig
from rlpad.config.schema import DataConfig, RolloutConfig, ValidationSamplingConfig

__all__ = ["PLACEHOLDERS", "RESPONSE", "Verdict", "engine_settings", "judge_problems", "parse_verdict",
           "render_template", "template_problems"]

RESPONSE = "response"  # the placeholder every judge template must hold
# placeholder -> what it is filled with (rlpad.rewards.judge.JudgeScorer.render)
PLACEHOLDERS = {
    "prompt": "the prompt's chat messages' contents, joined by a blank line",
    RESPONSE: "the response's text: its valid tokens (tool output included), decoded with the policy's tokenizer, "
              "special tokens skipped (rlpad.rewards.conversation)",
    "ground_truth": "the row's reward_model.ground_truth, as text",
}
KEY = "reward.judge.prompt_template"


@dataclass(frozen=True)
class Verdict:
    """One parsed judge answer: ``score`` (default_score when not ``parsed``) and the verdict text found."""

    score: float
    parsed: bool
    found: str | None = None


def template_problems(template: str, key: str = KEY) -> list[str]:
    """Every problem of a judge template, one line each: not a str, malformed braces, a placeholder
    that is not one of :data:`PLACEHOLDERS` (or has an attribute, index, conversion or format spec),
    no ``{response}``."""
    if not isinstance(template, str):
        return [f"{key} must be a string, got {type(template).__name__}"]
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        return [f"{key}: malformed braces ({e}); write a literal brace as {{{{ or }}}}"]
    problems, names = [], set()
    for name, conv, spec in fields:
        if name not in PLACEHOLDERS:
            problems.append(f"{key}: unknown placeholder {{{name}}}; the placeholders are "
                            f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} (a literal brace: {{{{ or }}}})")
        elif conv or spec:
            problems.append(f"{key}: placeholder {{{name}}} takes no conversion or format spec")
        names.add(name)
    if RESPONSE not in names:
        problems.append(f"{key} has no {{{RESPONSE}}} placeholder: the judge would never see the response")
    return problems


def render_template(template: str, **values: str) -> str:
    """``template`` with its placeholders filled (a template :func:`template_problems` passed)."""
    return template.format(**values)


def parse_verdict(text: str, judge: JudgeConfig) -> Verdict:
    """The module docstring's rule applied to one judge answer."""
    matches = list(re.finditer(judge.score_pattern, text))
    if not matches:
        return Verdict(judge.default_score, False)
    last = matches[-1]
    found = last.group(1) if last.re.groups else last.group(0)
    if found is None:  # an optional group that did not take part
        return Verdict(judge.default_score, False)
    if judge.verdicts:
        table = {k.strip().lower(): float(v) for k, v in judge.verdicts.items()}
        key = found.strip().lower()
        return Verdict(table[key], True, found) if key in table else Verdict(judge.default_score, False, found)
    try:
        value = float(found)
    except ValueError:
        return Verdict(judge.default_score, False, found)
    if not (math.isfinite(value) and judge.score_min <= value <= judge.score_max):
        return Verdict(judge.default_score, False, found)
    return Verdict((value - judge.score_min) / (judge.score_max - judge.score_min), True, found)


def judge_problems(judge: JudgeConfig) -> list[str]:
    """Every problem of ``reward.judge``, one line each naming its dotted key (nothing when disabled)."""
    if not judge.enable:
        return []
    k, problems = "reward.judge", []
    if not judge.model_path:
        problems.append(f"{k}.enable=true needs {k}.model_path (a local folder: a causal LM and its tokenizer)")
    problems += template_problems(judge.prompt_template)
    try:
        groups = re.compile(judge.score_pattern).groups
    except (re.error, TypeError) as e:
        problems.append(f"{k}.score_pattern={judge.score_pattern!r} is not a valid regular expression: {e}")
        groups = 0
    if groups > 1:
        problems.append(f"{k}.score_pattern={judge.score_pattern!r} has {groups} groups; the verdict is group 1: make "
                        "the others non-capturing (?:...)")
    for key, value in judge.verdicts.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{k}.verdicts.{key}={value!r} must be a finite number")
    if not judge.verdicts and not judge.score_min < judge.score_max:
        problems.append(f"{k}.score_min={judge.score_min} must be < {k}.score_max={judge.score_max}")
    if not math.isfinite(judge.default_score):
        problems.append(f"{k}.default_score={judge.default_score} must be finite")
    if not judge.timeout_s > 0:
        problems.append(f"{k}.timeout_s={judge.timeout_s} must be > 0")
    r = judge.rollout
    for key in ("prompt_length", "response_length", "num_replicas", "tensor_model_parallel_size"):
        if isinstance(getattr(r, key), bool) or not isinstance(getattr(r, key), int) or getattr(r, key) < 1:
            problems.append(f"{k}.rollout.{key}={getattr(r, key)!r} must be an int >= 1")
    if r.dtype not in DTYPES:
        problems.append(f"{k}.rollout.dtype={r.dtype!r} is not valid; choose one of {', '.join(DTYPES)}")
    if not 0 < r.gpu_memory_utilization <= 1:
        problems.append(f"{k}.rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]")
    if not r.cpu_kv_cache_gb > 0:
        problems.append(f"{k}.rollout.cpu_kv_cache_gb={r.cpu_kv_cache_gb} must be > 0")
    return problems


def engine_settings(judge: JudgeConfig, seed: int = 0) -> tuple[RolloutConfig, DataConfig]:
    """The rollout and data sections a judge engine is built with (rlpad.rollout.vllm.VLLMRollout): greedy
    (its validation sampling, n=1), ``response_length`` new tokens, prompts up to ``prompt_length``."""
    r = judge.rollout
    rollout = RolloutConfig(
        name="vllm", n=1, temperature=0.0, seed=seed, dtype=r.dtype, gpu_memory_utilization=r.gpu_memory_utilization,
        tensor_model_parallel_size=r.tensor_model_parallel_size, cpu_kv_cache_gb=r.cpu_kv_cache_gb,
        num_replicas=r.num_replicas, val_kwargs=ValidationSamplingConfig(do_sample=False, n=1))
    return rollout, DataConfig(max_prompt_length=r.prompt_length, max_response_length=r.response_length)
