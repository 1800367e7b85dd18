"""The reward-model part of the reward stage, in the driver process: rollout batch -> one score per response.

The reward model (:mod:`rlpad.core.reward_model`) reads the rollout's own rows (policy tokens,
left-padded prompt + right-padded response, remove-padding) when it tokenises as the policy does:
same vocabulary, same chat template. Otherwise each response is decoded with the policy's
tokenizer, appended to its prompt's chat messages (``raw_prompt``) as the assistant turn,
rendered with the reward model's chat template, tokenised with its tokenizer, left-padded and
scored the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.core.layout import left_pad
from rlpad.core.models import load_tokenizer
from rlpad.core.reward_model import compute_scores, load_reward_model
from rlpad.rewards.rules import decode_responses

__all__ = ["RewardModelScorer", "render_for_reward_model", "same_tokenization"]

KEY = "reward.reward_model.model_path"


def same_tokenization(policy: Any, reward: Any) -> bool:
    """The two tokenizers turn the same conversation into the same ids: equal vocabularies (token ->
    id) and equal chat templates."""
    return policy.get_vocab() == reward.get_vocab() and getattr(policy, "chat_template", None) == getattr(
        reward, "chat_template", None)


def render_for_reward_model(batch: Batch, policy_tokenizer: Any, reward_tokenizer: Any) -> list[list[int]]:
    """Each row's conversation (its ``raw_prompt`` messages + the decoded response as the assistant
    turn) rendered with the reward model's chat template and tokenised by its tokenizer."""
    batch.require("raw_prompt", "responses", "response_mask", who="reward model (re-tokenisation)")
    texts = decode_responses(policy_tokenizer, batch["responses"], batch["response_mask"])
    rows = []
    for messages, text in zip(batch["raw_prompt"], texts):
        chat = [dict(m) for m in messages] + [{"role": "assistant", "content": text}]
        rendered = reward_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        rows.append(reward_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return rows


class RewardModelScorer:
    """Loads the reward model at ``path`` and its tokenizer; called with a rollout batch, returns its
    scores (B,) float32 on the CPU. ValueError at construction (before any compute) for a folder that
    is not a one-output classification model, or a tokenizer that differs from the policy's and has
    no chat template to re-render with."""

    def __init__(self, path: str, policy_tokenizer: Any, *, dtype: str = "float32", device: str = "cpu",
                 use_remove_padding: bool = True, trust_remote_code: bool = False):
        self.model = load_reward_model(path, dtype=dtype, device=device, use_remove_padding=use_remove_padding,
                                       trust_remote_code=trust_remote_code, key=KEY)
        self.tokenizer = load_tokenizer(path)
        self.policy_tokenizer = policy_tokenizer
        self.use_remove_padding = use_remove_padding
        self.retokenize = not same_tokenization(policy_tokenizer, self.tokenizer)
        if self.retokenize and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{KEY}={path!r}: its tokenizer differs from the policy's "
                             "(actor_rollout_ref.model.tokenizer_path) and has no chat template to re-render the "
                             "responses with; save a chat_template with the reward model's tokenizer")

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(input_ids, attention_mask, position_ids)`` the reward model scores."""
        if not self.retokenize:
            return batch["input_ids"], batch["attention_mask"], batch["position_ids"] if "position_ids" in batch else None
        rows = render_for_reward_model(batch, self.policy_tokenizer, self.tokenizer)
        ids, mask = left_pad(rows, max(len(r) for r in rows), self.tokenizer.pad_token_id or 0)
        return ids, mask, None

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids, mask, pos = (t.to(device) if t is not None else None for t in self.inputs(batch))
        return compute_scores(self.model, ids, mask, pos, use_remove_padding=self.use_remove_padding).cpu()
