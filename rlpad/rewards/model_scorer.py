"""The reward-model part of the reward stage, on the driver: what the reward-model workers
(workers/reward_model.py) score for a rollout batch.

The reward model (:mod:`rlpad.core.reward_model`) reads the rollout's own rows (policy tokens,
left-padded prompt + right-padded response, remove-padding) when it tokenises as the policy does:
same vocabulary, same chat template. Otherwise each response is decoded with the policy's
tokenizer, appended to its prompt's chat messages (``raw_prompt``) as the assistant turn,
rendered with the reward model's chat template, tokenised with its tokenizer, left-padded and
scored the same way. Shared prompts (``reward.reward_model.share_prompts``) need the policy's own
rows: their ``responses`` tell the workers where each prompt ends; a re-rendered batch has none.
"""

from __future__ import annotations

from typing import Any


from rlpad.batch import Batch
from rlpad.core.layout import left_pad
from rlpad.core.models import load_tokenizer, model_config, require_folder
from rlpad.core.reward_model import check_reward_config
from rlpad.rewards.rules import decode_responses

__all__ = ["RewardModelInputs", "render_for_reward_model", "same_tokenization"]

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


class RewardModelInputs:
    """What the reward model reads for a rollout batch. Built in the driver before any worker starts:
    reads the folder's config and tokenizer only (no weights), and raises ValueError for a folder
    that is not a one-output classification model, or a tokenizer that differs from the policy's
    and has no chat template to re-render with, or ``share_prompts`` true (the key's explicit value)
    for a tokenizer that re-renders. Called with a rollout batch, returns a Batch of ``input_ids``,
    ``attention_mask`` (+ ``position_ids`` and ``responses`` for the rollout's own rows)."""

    def __init__(self, path: str, policy_tokenizer: Any, *, trust_remote_code: bool = False,
                 share_prompts: bool | None = None):
        require_folder("reward model", path)
        check_reward_config(model_config(path, trust_remote_code), path, KEY)
        self.tokenizer = load_tokenizer(path)
        self.policy_tokenizer = policy_tokenizer
        self.retokenize = not same_tokenization(policy_tokenizer, self.tokenizer)
        if self.retokenize and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{KEY}={path!r}: its tokenizer differs from the policy's "
                             "(actor_rollout_ref.model.tokenizer_path) and has no chat template to re-render the "
                             "responses with; save a chat_template with the reward model's tokenizer")
        if self.retokenize and share_prompts:
            raise ValueError(f"reward.reward_model.share_prompts=true needs the policy's own tokens, but "
                             f"{KEY}={path!r} tokenises differently and re-renders each conversation; set "
                             "reward.reward_model.share_prompts=false (or null)")

    def __call__(self, batch: Batch) -> Batch:
        if not self.retokenize:
            return batch.select(*[k for k in ("input_ids", "attention_mask", "position_ids", "responses") if k in batch])
        rows = render_for_reward_model(batch, self.policy_tokenizer, self.tokenizer)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, mask = left_pad(rows, max(len(r) for r in rows), pad)
        return Batch({"input_ids": ids, "attention_mask": mask})
