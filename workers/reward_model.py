"""The FSDP2 reward-model worker: one score per sequence at its last valid token (rlpad.core.reward_model).

Like the critic (:mod:`workers.critic`): FSDP2 over the group's ranks (rank 0 reads the weights, the
others receive their shards), the batch split over the ranks with its token work balanced
(:meth:`workers.group.WorkerGroup.split`), micro-batches by row count or token budget
(``reward.reward_model.micro_batch_size_per_gpu`` / ``use_dynamic_bsz`` +
``forward_max_token_len_per_gpu``), each one packed forward. No optimizer: it only scores.

Its batch is ``input_ids``, ``attention_mask`` (+ ``position_ids``), (B, S) with one run of ones per
row: the rollout's rows, or whole conversations re-rendered for the reward model's tokenizer by the
driver (:mod:`rlpad.rewards.model_scorer`). No sequence parallelism and no shared prompts yet.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from rlpad.batch import Batch
from rlpad.batching.micro_batches import micro_batches
from rlpad.config.rewards import RewardModelScoringConfig
from rlpad.core.reward_model import check_reward_inputs, compute_scores, load_reward_model
from workers.contract import Contract, DeclaredBatch
from workers.fsdp import FSDPWorker, reports_seconds

__all__ = ["RM_INPUTS", "RewardModelWorker", "ScoreModel"]

RM_INPUTS = Contract(required=("input_ids", "attention_mask"), optional=("position_ids",))


class ScoreModel(nn.Module):
    """A module whose forward is :func:`rlpad.core.reward_model.compute_scores` on the wrapped reward
    model: FSDP's root, so its own parameters (embeddings, final norm, score head) are gathered
    around the whole scoring."""

    def __init__(self, reward_model: nn.Module):
        super().__init__()
        self.reward_model = reward_model

    def forward(self, input_ids, attention_mask, position_ids=None, *, use_remove_padding: bool = True):
        return compute_scores(self.reward_model, input_ids, attention_mask, position_ids,
                              use_remove_padding=use_remove_padding, check=False)


def _scoring_method(method):
    """Declares :data:`RM_INPUTS` (what the worker group ships) and checks the batch on every rank together."""

    @functools.wraps(method)
    def run(self: RewardModelWorker, batch: Batch, *args: Any, **kwargs: Any) -> Any:
        self._require_model()
        cfg = self.config

        def check() -> None:
            batch.require(*RM_INPUTS.required, who=method.__name__)
            check_reward_inputs(self.model, batch["input_ids"], batch["attention_mask"],
                                batch.tensors.get("position_ids"), use_remove_padding=cfg.use_remove_padding)

        self._agree(check)
        declared = frozenset(RM_INPUTS.keys)
        view = DeclaredBatch({k: v for k, v in batch.tensors.items() if k in declared}, {}, dict(batch.meta),
                             declared=declared, who=method.__name__)
        return method(self, view, *args, **kwargs)

    run.contract = lambda _config: RM_INPUTS  # type: ignore[attr-defined]
    return run


class RewardModelWorker(FSDPWorker):
    """FSDP2 worker of the ``reward_model`` role (one rank); ``config``: ``reward.reward_model``."""

    role = "reward_model"

    def __init__(self, config: RewardModelScoringConfig, role: str = "reward_model", trust_remote_code: bool = False,
                 **dist_kwargs: Any):
        super().__init__(config, role=role, **dist_kwargs)
        self.trust_remote_code = trust_remote_code

    @staticmethod
    def sequence_parallel_size(config: Any, role: str) -> int:
        return 1  # not yet: the packed row is not split for the reward model

    def init_model(self) -> None:
        """Join the process group, load the reward model (rank 0) and shard it over the group."""
        self._init_distributed()
        c = self.config
        kwargs = dict(dtype=c.dtype, attn_implementation=c.attn_implementation, use_remove_padding=c.use_remove_padding,
                      trust_remote_code=self.trust_remote_code)
        path = self._local_path(c.model_path)
        # rank 0 reads the weights; the others build on the meta device and are filled from rank 0
        rm = load_reward_model(path, device="cpu", attn_device=self.device, empty=not self.reads_checkpoint, **kwargs)
        rm.requires_grad_(False)
        root = ScoreModel(rm)
        self.root = self._shard_from_rank0(root, getattr(rm, rm.base_model_prefix))
        self.model = rm

    def _pieces(self, batch: Batch, micro_rows: int | None, max_tokens: int | None):
        parts = micro_batches(batch, micro_rows, max_tokens, agree=self._all_max)
        pieces = ((batch.index(p or [0]).to(self.device), bool(p)) for p in parts)
        return pieces, [p for p in parts if p]

    @reports_seconds
    @_scoring_method
    def compute_rm_scores(self, batch: Batch) -> Batch:
        """``rm_scores`` (B,) float32: each row's score at its last valid token."""
        c = self.config
        micro = (None, c.forward_max_token_len_per_gpu) if c.use_dynamic_bsz else (c.micro_batch_size_per_gpu, None)
        (scores,) = self._forward_all(batch, *micro, lambda p: (self.root(
            p["input_ids"], p["attention_mask"], p.tensors.get("position_ids"),
            use_remove_padding=c.use_remove_padding),))
        return Batch({"rm_scores": scores})
