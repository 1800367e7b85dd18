"""What the model-based reward parts read of a rollout row: one rule for the reward model, whatever its
tokenizer, and the generative judge.

The response's text (:func:`response_texts`): every valid token of the row's response columns
(``attention_mask``: in a multi-turn row the policy's turns AND the tool output between them, in order,
as the policy's context held them), decoded with the policy's tokenizer, special tokens skipped. The
judge's ``{response}`` is that text. (The rule function reads the policy's own tokens only,
``response_mask``: rlpad.rewards.rules.decode_responses.)

The reward model's tokens (:func:`render_conversations`): the conversation as the reward model's chat
template renders it, verl's rendering: the prompt's messages (``raw_prompt``), then the response's text
as the assistant turn, closed as the template closes an assistant turn (ChatML: a finished ``3<|im_end|>``
reads ``3<|im_end|>\\n``; a truncated response gets the close too), tokenised by the reward model's
tokenizer. A template that writes nothing after an assistant turn (one that only joins the contents)
gets the tokenizer's EOS there instead, so the response still ends as the policy ended it. Each row is
split where its prompt ends (the template's rendering of the prompt with the generation prompt, when the
whole conversation's rendering starts with it): the prompt's tokens, then the rest's, tokenised apart,
as the policy's own rows are; a row whose rendering does not start so is one piece.

A row longer than the reward model's limit (its ``max_position_embeddings``; with ``use_dynamic_bsz`` the
token budget of one forward) loses its first tokens, the prompt's first, and is counted
(``reward/reward_model/truncated``): its score is still read at its last token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.core.layout import left_pad

__all__ = ["RenderedRows", "assistant_close", "render_conversations", "response_texts", "rows_batch"]

_MARK = "\x00rlpad-response\x00"  # a content no template changes, to find what follows an assistant turn


def response_texts(tokenizer: Any, batch: Batch) -> list[str]:
    """Each row's response text (the module docstring's rule): its valid response tokens, tool output
    included, decoded by ``tokenizer`` (the policy's) with special tokens skipped."""
    batch.require("responses", "attention_mask", who="reward model / judge (the response's text)")
    responses = batch["responses"].cpu()
    valid = batch["attention_mask"][:, -responses.shape[1]:].bool().cpu()
    return tokenizer.batch_decode([r[m].tolist() for r, m in zip(responses, valid)], skip_special_tokens=True)


def assistant_close(tokenizer: Any) -> str:
    """What ``tokenizer``'s chat template writes after an assistant turn's content (ChatML: ``<|im_end|>\\n``;
    "" for a template that only joins the contents)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}],
                                         tokenize=False, add_generation_prompt=False)
    at = text.rfind(_MARK)
    return text[at + len(_MARK):] if at >= 0 else ""


@dataclass
class RenderedRows:
    """The reward model's tokens of a batch: per row its ``prompts`` part and its ``responses`` part (None
    where the row did not split: ``prompts`` is then the whole row), and ``truncated`` (B,) 0/1."""

    prompts: list[list[int]]
    responses: list[list[int] | None]
    truncated: torch.Tensor


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]] if texts else []


def render_conversations(batch: Batch, policy_tokenizer: Any, tokenizer: Any, *, close_with_eos: bool,
                         limit: int | None) -> RenderedRows:
    """Each row of a rollout batch as the reward model reads it (the module docstring's rule): ``tokenizer``
    is the reward model's; ``close_with_eos``: its template writes no close (:func:`assistant_close` is "");
    ``limit``: the most tokens a row may keep (None: no limit)."""
    batch.require("raw_prompt", who="reward model (the conversation)")
    texts = response_texts(policy_tokenizer, batch)
    prompts: dict[str, str] = {}  # one rendering per distinct prompt (a GRPO group shares one)
    heads, tails = [], []
    for messages, text in zip(batch["raw_prompt"], texts):
        chat = [dict(m) for m in messages]
        key = json.dumps(chat, sort_keys=True, default=str)
        if key not in prompts:
            prompts[key] = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": text}], tokenize=False,
                                              add_generation_prompt=False)
        split = whole.startswith(prompts[key])
        heads.append(prompts[key] if split else whole)
        tails.append(whole[len(prompts[key]):] if split else None)
    head_ids = _encode(tokenizer, heads)
    tail_ids = iter(_encode(tokenizer, [t for t in tails if t is not None]))
    eos = [tokenizer.eos_token_id] if close_with_eos and tokenizer.eos_token_id is not None else []
    out = RenderedRows([], [], torch.zeros(len(texts), dtype=torch.float32))
    for i, (head, tail) in enumerate(zip(head_ids, tails)):
        response = None if tail is None else next(tail_ids) + eos
        if response is None:
            head = head + eos
        over = len(head) + len(response or []) - limit if limit is not None else 0
        if over > 0:  # drop the first tokens: the prompt's, then the response's
            out.truncated[i] = 1.0
            cut = min(over, len(head))
            head = head[cut:]
            response = response[over - cut:] if response is not None else None
        out.prompts.append(head)
        out.responses.append(response)
    return out


def rows_batch(rows: RenderedRows, pad: int) -> Batch:
    """The reward model's batch: the rollout layout (``input_ids`` = left-padded prompts | right-padded
    responses, ``attention_mask``, ``position_ids``, ``responses``: what shared prompts read) when every row
    split, else the whole rows left-padded (``input_ids``, ``attention_mask``)."""
    if any(r is None for r in rows.responses):
        whole = [p + (r or []) for p, r in zip(rows.prompts, rows.responses)]
        ids, mask = left_pad(whole, max(len(r) for r in whole), pad)
        return Batch({"input_ids": ids, "attention_mask": mask})
    p_ids, p_mask = left_pad(rows.prompts, max(1, max(len(p) for p in rows.prompts)), pad)
    r_ids, r_mask = left_pad([r[::-1] for r in rows.responses], max(1, max(len(r) for r in rows.responses)), pad)
    r_ids, r_mask = r_ids.flip(1), r_mask.flip(1)  # right-padded
    mask = torch.cat([p_mask, r_mask], 1)
    return Batch({"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": mask,
                  "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "responses": r_ids})
