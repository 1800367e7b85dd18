"""The generative judge's part of the reward stage, on the driver: render each (prompt, response) through
``reward.judge.prompt_template``, send the whole batch to the judge engines in ONE call (greedy, one
verdict per row), parse each verdict (rlpad.rewards.judge_rules), never raise on what the judge wrote.

The engines are vLLM rollout backends of their own (``reward.judge.model_path``, ``reward.judge.rollout``):
started by the worker stack (workers/launcher.py on Ray, ``reward.judge.rollout.num_replicas`` of them, a
batch split between them in whole slices; workers/local.py in this process) and reached through
``workers.judge_generate(prompts: Batch) -> Batch`` (the rollout layout: ``prompts`` (B, P) left-padded,
``responses`` (B, R), ``response_mask`` (B, R)).

Per batch, rows of three kinds score ``reward.judge.default_score`` and are flagged (B,) 0/1, logged as
fractions (rlpad.rewards.combine.part_metrics): ``reward/judge/unparsable`` (no verdict found),
``reward/judge/timeout`` (the call took longer than ``reward.judge.timeout_s``: the whole batch),
``reward/judge/overlong`` (the rendered prompt is longer than ``reward.judge.rollout.prompt_length``:
not sent).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.config.rewards import JudgeConfig
from rlpad.core.layout import left_pad
from rlpad.core.models import load_tokenizer, model_config, require_folder
from rlpad.rewards.conversation import response_texts
from rlpad.rewards.judge_rules import judge_problems, parse_verdict, render_template
from rlpad.rewards.rules import decode_responses
from rlpad.rewards.settings import JUDGE, PART_FLAGS

__all__ = ["FLAGS", "JudgeOutcome", "JudgeScorer", "check_judge_model", "prompt_text"]

FLAGS = PART_FLAGS[JUDGE]  # per-row flags, each logged as reward/judge/<flag> (a fraction)
KEY = "reward.judge.model_path"

JudgeGenerate = Callable[[Batch], Batch]  # left-padded judge prompts -> the rollout layout (workers.judge_generate)


def check_judge_model(path: str, trust_remote_code: bool = False) -> None:
    """ValueError unless ``path`` is a local folder holding a causal LM (``*ForCausalLM``)."""
    require_folder("judge model", path)
    archs = list(getattr(model_config(path, trust_remote_code), "architectures", None) or [])
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(f"{KEY}={path!r} is not a causal LM (architectures {archs or 'not set'}); the judge "
                         "generates its verdict: give a *ForCausalLM checkpoint")


def prompt_text(messages: Any) -> str:
    """The ``{prompt}`` placeholder's text: a chat prompt's message contents joined by a blank line (a
    plain string as it is)."""
    if isinstance(messages, str):
        return messages
    return "\n\n".join(str(m.get("content", "")) for m in messages)


class JudgeOutcome:
    """One batch's judging: ``scores`` (B,) float32, ``flags`` {name: (B,) float32 0/1}, the judge's
    ``texts`` (None where not asked) and the ``prompts`` rendered (the template filled)."""

    def __init__(self, scores: torch.Tensor, flags: dict[str, torch.Tensor], texts: list[str | None],
                 prompts: list[str]):
        self.scores, self.flags, self.texts, self.prompts = scores, flags, texts, prompts


class JudgeScorer:
    """Renders, asks, parses. Built on the driver before any worker starts: refuses a bad ``reward.judge``
    (ValueError, every problem named) and a folder that is not a causal LM, reading the config and the
    tokenizer only. ``generate`` (the engines) is attached once the workers run (:meth:`attach`)."""

    def __init__(self, config: JudgeConfig, policy_tokenizer: Any, *, trust_remote_code: bool = False,
                 generate: JudgeGenerate | None = None):
        judge = config
        problems = judge_problems(judge)
        if not judge.enable:
            problems.insert(0, "reward.judge.enable is false: no judge to build")
        if problems:
            raise ValueError("invalid config:\n  " + "\n  ".join(problems))
        check_judge_model(judge.model_path, trust_remote_code)
        self.config = config
        self.policy_tokenizer = policy_tokenizer
        self.tokenizer = load_tokenizer(judge.model_path)
        self.generate = generate
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlpad-judge")

    def attach(self, generate: JudgeGenerate) -> None:
        self.generate = generate

    def render(self, batch: Batch) -> list[str]:
        """Each row's judge prompt: the template with ``{prompt}`` (``raw_prompt``), ``{response}`` (the response's
        text: rlpad.rewards.conversation.response_texts, tool output included), ``{ground_truth}`` filled."""
        batch.require("raw_prompt", who="reward.judge")
        responses = response_texts(self.policy_tokenizer, batch)
        truths = batch["ground_truth"] if "ground_truth" in batch else [""] * len(responses)
        return [render_template(self.config.prompt_template, prompt=prompt_text(p), response=r, ground_truth=str(t))
                for p, r, t in zip(batch["raw_prompt"], responses, truths)]

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """The judge's ids of each rendered prompt: as a user turn of its chat template when
        ``apply_chat_template`` and it has one (generation prompt added), else the text as it is."""
        tok = self.tokenizer
        if self.config.apply_chat_template and getattr(tok, "chat_template", None):
            return [list(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=True)["input_ids"])
                    for t in texts]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    def prompt_batch(self, rows: Sequence[Sequence[int]]) -> Batch:
        """Token lists -> the left-padded prompt rows a rollout engine generates from (one verdict each)."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, mask = left_pad(rows, max(len(r) for r in rows), pad)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": positions},
                     {"uid": [f"judge{i}" for i in range(len(rows))]})

    def ask(self, rows: Sequence[Sequence[int]]) -> list[str] | None:
        """The judge's text for each row, from ONE call to the engines; None when the call took longer than
        ``timeout_s`` (it runs on in its thread; the next call queues behind it, its wait counted in its own
        timeout)."""
        if self.generate is None:
            raise RuntimeError("reward.judge.enable=true but no judge engine is attached (workers.judge_generate)")
        future = self._pool.submit(self.generate, self.prompt_batch(rows))
        try:
            out = future.result(timeout=self.config.timeout_s)
        except concurrent.futures.TimeoutError:
            return None
        return decode_responses(self.tokenizer, out["responses"], out["response_mask"])

    def judge(self, batch: Batch) -> JudgeOutcome:
        """The batch judged (the module docstring's rules)."""
        prompts = self.render(batch)
        ids = self.tokenize(prompts)
        n = len(prompts)
        flags = {name: torch.zeros(n, dtype=torch.float32) for name in FLAGS}
        scores = torch.full((n,), float(self.config.default_score), dtype=torch.float32)
        texts: list[str | None] = [None] * n
        asked = [i for i, row in enumerate(ids) if 0 < len(row) <= self.config.rollout.prompt_length]
        flags["overlong"][[i for i, row in enumerate(ids) if len(row) > self.config.rollout.prompt_length]] = 1.0
        flags["unparsable"][[i for i, row in enumerate(ids) if not row]] = 1.0  # nothing to ask
        answers = self.ask([ids[i] for i in asked]) if asked else []
        if answers is None:
            flags["timeout"][asked] = 1.0
            return JudgeOutcome(scores, flags, texts, prompts)
        for i, text in zip(asked, answers):
            verdict = parse_verdict(text, self.config)
            texts[i], scores[i] = text, verdict.score
            flags["unparsable"][i] = 0.0 if verdict.parsed else 1.0
        return JudgeOutcome(scores, flags, texts, prompts)

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(scores (B,), {flag: (B,) 0/1})``: the reward stage's call (rlpad.rewards.combine)."""
        out = self.judge(batch)
        return out.scores, out.flags
