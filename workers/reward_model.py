"""The FSDP2 reward-model worker: one score per sequence at its last valid token (rlpad.core.reward_model).

Like the critic (:mod:`workers.critic`): FSDP2 over the group's ranks (rank 0 reads the weights, the
others receive their shards), the batch split over the ranks with its token work balanced
(:meth:`workers.group.WorkerGroup.split`), micro-batches by row count or token budget
(``reward.reward_model.micro_batch_size_per_gpu`` / ``use_dynamic_bsz`` +
``forward_max_token_len_per_gpu``), each one packed forward. No optimizer: it only scores.

Its batch is ``input_ids``, ``attention_mask`` (+ ``position_ids``), (B, S) with one run of ones per
row: the conversations as the reward model's template renders them (the driver's
:mod:`rlpad.rewards.model_scorer`), in the rollout layout (+ ``responses``, which says where each prompt
ends) when every row splits at its prompt's end, else whole rows left-padded.

Sequence parallelism (``reward.reward_model.ulysses_sequence_parallel_size`` sp): as the actor's
(:mod:`workers.fsdp`): ``world / sp`` data-parallel groups, each rank running 1/sp of every packed row,
a token budget counting the whole row (``forward_max_token_len_per_gpu x sp``); the rank holding a
row's last token scores it and the group sums the (B,) scores. Shared prompts
(``reward.reward_model.share_prompts``, resolved by :func:`rlpad.rewards.settings.reward_model_section`):
a batch in the rollout layout (one with ``responses``) packs each prompt group's prompt once, its
responses after it, with whole groups per rank and per micro-batch where counts allow (as the actor's);
a batch of whole rows never shares.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from rlpad.batch import Batch
from rlpad.batching.micro_batches import micro_batches
from rlpad.config.rewards import RewardModelScoringConfig
from rlpad.core.host_plan import HostBatch
from rlpad.core.reward_model import check_reward_inputs, compute_scores, load_reward_model
from rlpad.core.shared_prompt import min_saved_for
from rlpad.parallel import sp_size
from rlpad.core.vision import MM_KEY, is_vl
from workers.contract import Contract, DeclaredBatch
from workers.fsdp import HOST_COPY, FSDPWorker, reports_seconds

__all__ = ["RM_INPUTS", "RewardModelWorker", "ScoreModel"]

# ``responses``: only its width is read (where each row's response starts), for shared prompts;
# ``multi_modal_inputs``: the rows' images, read by a reward model with a VL backbone (a text one scores the text).
RM_INPUTS = Contract(required=("input_ids", "attention_mask"), optional=("position_ids", "responses", MM_KEY))


class ScoreModel(nn.Module):
    """A module whose forward is :func:`rlpad.core.reward_model.compute_scores` on the wrapped reward
    model: FSDP's root, so its own parameters (embeddings, final norm, score head) are gathered
    around the whole scoring."""

    def __init__(self, reward_model: nn.Module):
        super().__init__()
        self.reward_model = reward_model

    def forward(self, input_ids, attention_mask, position_ids=None, **kwargs: Any):
        """``kwargs``: :func:`rlpad.core.reward_model.compute_scores`'s (remove-padding, shared prompts, sp, host)."""
        return compute_scores(self.reward_model, input_ids, attention_mask, position_ids, check=False, **kwargs)


def _scoring_method(method):
    """Declares :data:`RM_INPUTS` (what the worker group ships) and checks the batch on every rank together."""

    @functools.wraps(method)
    def run(self: RewardModelWorker, batch: Batch, *args: Any, **kwargs: Any) -> Any:
        self._require_model()
        cfg = self.config

        def check() -> None:
            batch.require(*RM_INPUTS.required, who=method.__name__)
            check_reward_inputs(self.model, batch["input_ids"], batch["attention_mask"],
                                batch.tensors.get("position_ids"), use_remove_padding=cfg.use_remove_padding,
                                response_length=self._response_length(batch), share_prompts=self._shares(batch),
                                sp=self.sp)

        self._agree(check)
        declared = frozenset(RM_INPUTS.keys)
        view = DeclaredBatch({k: v for k, v in batch.tensors.items() if k in declared},
                             {k: v for k, v in batch.non_tensors.items() if k in declared}, dict(batch.meta),
                             declared=declared, who=method.__name__)  # fmt: skip
        return method(self, view, *args, **kwargs)

    run.contract = lambda _config: RM_INPUTS  # type: ignore[attr-defined]
    return run


class RewardModelWorker(FSDPWorker):
    """FSDP2 worker of the ``reward_model`` role (one rank); ``config``: ``reward.reward_model``."""

    role = "reward_model"

    def __init__(self, config: RewardModelScoringConfig, role: str = "reward_model", trust_remote_code: bool = False,
                 share_min_saved: float | None = None, **dist_kwargs: Any):
        """``config.share_prompts`` resolved (a bool: :func:`rlpad.rewards.settings.reward_model_section`);
        ``share_min_saved``: the actor's ``model.share_prompts_min_saved_fraction`` (None: the device's default)."""
        super().__init__(config, role=role, **dist_kwargs)
        self.trust_remote_code = trust_remote_code
        self.share_min_saved = min_saved_for(share_min_saved, self.device)

    @staticmethod
    def sequence_parallel_size(config: Any, role: str) -> int:
        return sp_size(config, "reward_model")

    @staticmethod
    def _response_length(batch: Batch) -> int | None:
        return int(batch["responses"].shape[1]) if "responses" in batch else None

    def _shares(self, batch: Batch) -> bool:
        """Shared prompts for this batch: asked for, and the batch is the policy's own rows."""
        return bool(self.config.share_prompts) and "responses" in batch

    def init_model(self) -> None:
        """Join the process group, load the reward model (rank 0) and shard it over the group."""
        self._init_distributed()
        c = self.config
        kwargs = dict(dtype=c.dtype, attn_implementation=c.attn_implementation, use_remove_padding=c.use_remove_padding,
                      trust_remote_code=self.trust_remote_code)
        path = self._local_path(c.model_path)
        # rank 0 reads the weights; the others build on the meta device and are filled from rank 0
        rm = load_reward_model(path, device="cpu", attn_device=self.device, empty=not self.reads_checkpoint, **kwargs)
        self._check_heads(rm.config)
        rm.requires_grad_(False)
        root = ScoreModel(rm)
        self.root = self._shard_from_rank0(root, getattr(rm, rm.base_model_prefix))
        self.model = rm

    def _pieces(self, batch: Batch, micro_rows: int | None, max_tokens: int | None):
        budget = max_tokens * self.sp_size if max_tokens is not None else None  # the row is split over sp ranks
        parts = micro_batches(batch, micro_rows, budget, share_prompts=self._shares(batch), agree=self._all_max)
        pieces = ((self._on_device(batch.index(p or [0])), bool(p)) for p in parts)
        return pieces, [p for p in parts if p]

    def _on_device(self, piece: Batch) -> Batch:
        """``piece`` on this rank's device, its host copy in ``meta[HOST_COPY]`` (no response mask: a
        reward model skips no token)."""
        t = piece.tensors
        host = HostBatch.of(t["input_ids"], t["attention_mask"], t.get("position_ids"))
        out = piece.to(self.device)
        out.meta[HOST_COPY] = host
        return out

    @reports_seconds
    @_scoring_method
    def compute_rm_scores(self, batch: Batch) -> Batch:
        """``rm_scores`` (B,) float32: each row's score at its last valid token."""
        c = self.config
        micro = (None, c.forward_max_token_len_per_gpu) if c.use_dynamic_bsz else (c.micro_batch_size_per_gpu, None)
        share, response_length = self._shares(batch), self._response_length(batch)
        (scores,) = self._forward_all(batch, *micro, lambda p: (self.root(
            p["input_ids"], p["attention_mask"], p.tensors.get("position_ids"),
            use_remove_padding=c.use_remove_padding, response_length=response_length, share_prompts=share,
            share_min_saved=self.share_min_saved, sp=self.sp, host=p.meta.get(HOST_COPY),
            multi_modal_inputs=p.non_tensors.get(MM_KEY) if is_vl(self.model) else None),))
        return Batch({"rm_scores": scores})
