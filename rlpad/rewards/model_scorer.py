"""The reward-model part of the reward stage, on the driver: what the reward-model workers
(workers/reward_model.py) score for a rollout batch.

One rule whatever the reward model's tokenizer (rlpad.rewards.conversation): each conversation, the
prompt's chat messages (``raw_prompt``) and the response's text as the assistant turn, rendered with the
reward model's chat template and tokenised by its tokenizer, as verl renders it; split at the prompt's
end into the rollout layout (left-padded prompts, right-padded responses, ``responses`` telling the
workers where each prompt ends, so shared prompts work) when every row splits; cut at the reward model's
limit, counted.
"""

from __future__ import annotations

from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.core.models import load_tokenizer, model_config, require_folder
from rlpad.core.reward_model import check_reward_config
from rlpad.rewards.conversation import assistant_close, render_conversations, rows_batch

__all__ = ["RewardModelInputs"]

KEY = "reward.reward_model.model_path"


class RewardModelInputs:
    """What the reward model reads for a rollout batch. Built in the driver before any worker starts:
    reads the folder's config and tokenizer only (no weights), and raises ValueError for a folder
    that is not a one-output classification model, or a tokenizer with no chat template to render the
    conversations with. ``max_tokens``: the token budget of one forward (``use_dynamic_bsz``), if any; the
    limit of a row is the smaller of it and the model's ``max_position_embeddings``. Called with a rollout
    batch, returns ``(inputs, {"truncated": (B,) 0/1})``: a Batch of ``input_ids``, ``attention_mask``
    (+ ``position_ids`` and ``responses`` in the rollout layout)."""

    def __init__(self, path: str, policy_tokenizer: Any, *, trust_remote_code: bool = False,
                 max_tokens: int | None = None):
        require_folder("reward model", path)
        config = model_config(path, trust_remote_code)
        check_reward_config(config, path, KEY)
        self.tokenizer = load_tokenizer(path)
        self.policy_tokenizer = policy_tokenizer
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{KEY}={path!r}: its tokenizer has no chat template to render the conversations with "
                             "(the reward model reads each as its template writes it: docs/rewards.md); save a "
                             "chat_template with the reward model's tokenizer")
        self.close_with_eos = assistant_close(self.tokenizer) == ""
        limits = [n for n in (getattr(config, "max_position_embeddings", None), max_tokens) if n]
        self.limit = min(limits) if limits else None

    def __call__(self, batch: Batch) -> tuple[Batch, dict[str, torch.Tensor]]:
        rows = render_conversations(batch, self.policy_tokenizer, self.tokenizer, close_with_eos=self.close_with_eos,
                                    limit=self.limit)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return rows_batch(rows, pad), {"truncated": rows.truncated}
