"""On-policy distillation on the workers (docs/distillation.md): the teacher's and the student's worker
sections and the batch keys the teacher adds (its scoring and the actor's distillation term: workers/actor.py).

The teacher is an :class:`workers.actor.ActorWorker` of role ``teacher``: a frozen model (the teacher's
path and ``teacher_model.dtype``, the actor's model keys otherwise: attention, remove-padding, shared prompts,
logits chunks) scoring the student's batch at ``teacher_model.temperature`` (1.0, as verl) on the packed
row like the reference, micro-batched by ``ref.log_prob_*``,
sequence-parallel as the reference. Both the teacher's and the student's worker get a
:class:`DistilledSection`: the ``actor_rollout_ref`` section plus the run's ``distillation`` section and
the tokenizer's id count (the KL of ``forward_kl_topk`` is over those ids).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlpad.algorithms.distillation_rules import teacher_path
from rlpad.config.choices import TOPK_MODES
from rlpad.config.distillation import DistillationConfig
from rlpad.config.schema import ActorRolloutRefConfig, Config

__all__ = ["TEACHER_KEYS", "DistilledSection", "own_pool", "student_section", "teacher_group_kwargs", "teacher_keys",
           "teacher_section", "tokenizer_ids"]


@dataclass
class DistilledSection(ActorRolloutRefConfig):
    """``actor_rollout_ref`` with the run's ``distillation`` section and the tokenizer's id count."""

    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    vocab_size: int | None = None


TEACHER_KEYS = {"sampled": ("teacher_log_probs",), "topk": ("teacher_topk_ids", "teacher_topk_log_probs")}


def teacher_keys(section: Any) -> tuple[str, ...]:
    """The batch keys the teacher adds (and the actor's update reads): () without distillation."""
    d = getattr(section, "distillation", None)
    if d is None or not d.enabled:
        return ()
    return TEACHER_KEYS["topk" if d.distillation_loss.loss_mode in TOPK_MODES else "sampled"]


def _section(config: Config, arr: ActorRolloutRefConfig, vocab_size: int) -> DistilledSection:
    fields = {f.name: getattr(arr, f.name) for f in dataclasses.fields(ActorRolloutRefConfig)}
    return DistilledSection(**fields, distillation=config.distillation, vocab_size=vocab_size)


def tokenizer_ids(config: Config) -> int:
    """The student's tokenizer's id count (teacher and student share it; rlpad.train checked that)."""
    from rlpad.core.models import load_tokenizer

    model = config.actor_rollout_ref.model
    return len(load_tokenizer(model.tokenizer_path or model.path))


def own_pool(config: Config) -> tuple[int, int] | None:
    """``(nnodes, ranks per node)`` of the teacher's own pool, or None: colocated with the actor's
    (``distillation.n_gpus_per_node`` 0; ``distillation.nnodes`` 0: ``trainer.nnodes``)."""
    d = config.distillation
    if not d.enabled or d.n_gpus_per_node == 0:
        return None
    return d.nnodes or config.trainer.nnodes, d.n_gpus_per_node


def teacher_group_kwargs(config: Config, actor_group: dict[str, Any], *, gpus: int) -> dict[str, Any]:
    """The teacher's :class:`workers.group.WorkerGroup` placement: ``actor_group`` (the actor's kwargs: its
    nodes and, colocated, its placement groups and bundle shares) or, with :func:`own_pool`, a pool of its
    own (``nnodes x n_gpus_per_node`` ranks, ``gpus`` each, placement groups the group reserves)."""
    pool = own_pool(config)
    if pool is None:
        return actor_group
    shared = {k: actor_group[k] for k in ("resolve_path", "seed") if k in actor_group}
    return dict(nnodes=pool[0], ranks_per_node=pool[1], num_gpus_per_worker=gpus, **shared)


def student_section(config: Config, vocab_size: int) -> ActorRolloutRefConfig:
    """The actor's worker section: ``actor_rollout_ref`` itself without distillation."""
    arr = config.actor_rollout_ref
    return _section(config, arr, vocab_size) if config.distillation.enabled else arr


def teacher_section(config: Config, vocab_size: int) -> DistilledSection:
    """The teacher's worker section: the actor's model keys with the teacher's path and dtype (``teacher_model.dtype``,
    null: the actor's), the student's tokenizer."""
    arr = config.actor_rollout_ref
    teacher = config.distillation.teacher_models.teacher_model
    model = dataclasses.replace(arr.model, path=teacher_path(config), dtype=teacher.dtype or arr.model.dtype,
                                tokenizer_path=arr.model.tokenizer_path or arr.model.path)
    return _section(config, dataclasses.replace(arr, model=model), vocab_size)
