"""DAPO's dynamic sampling (``algorithm.filter_groups``) and overlong reward shaping
(``reward_model.overlong_buffer``), on the driver, between the rollout and the old log-probs.

One step with ``filter_groups.enable``::

    prompts (data.gen_batch_size) -> generate -> score (raw reward) -> drop zero-spread groups -+
      ^ the loader's next batch, while fewer than data.train_batch_size groups are kept  <------+
    kept groups, in generation order, cut to data.train_batch_size -> overlong shaping -> ...

A group (the ``rollout.n`` responses of one prompt, one ``uid``) is kept when its ``metric``
(:data:`rlpad.config.choices.FILTER_METRICS`) is not the same for all its responses (max > min; a group of
one is kept, as verl does, which is why the filter refuses ``rollout.n = 1``). The metric is read from the raw reward, before any shaping: a penalty
applied first would give an all-wrong group a spread of lengths (NeMo-RL #2478). ``acc`` is the
reward function's ``acc`` when it returns a dict holding one, else its score; ``score`` the score;
``seq_reward`` / ``seq_final_reward`` the sum of the token-level scores (the KL penalty of
``use_kl_in_reward`` and the overlong penalty come after the filter, so both equal the score here).
Fresh prompts come from the training loader, so a step consumes whole loader batches and a
checkpoint's loader position resumes exactly; groups past the cut are dropped, as in verl.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlpad.batch import Batch
from rlpad.config.schema import Config
from rlpad.rewards.rules import place_scores

__all__ = ["collect_batch", "filter_metric", "group_spread", "overlong_penalty", "shape_rewards"]

SEQ_SCORE, ACC = "seq_score", "acc"  # the raw per-response reward and accuracy the scoring step adds (B,)


def filter_metric(batch: Batch, name: str) -> torch.Tensor:
    """The per-response value of ``filter_groups.metric`` (N,), before any shaping."""
    if name == "acc":
        return batch[ACC]
    if name == "score":
        return batch[SEQ_SCORE]
    return batch["token_level_scores"].sum(dim=-1)  # seq_reward, seq_final_reward


def group_spread(values: torch.Tensor, uids: Any) -> tuple[torch.Tensor, int, int]:
    """``(keep (N,) bool, groups kept, groups)``: a row is kept when its group's values are not all equal
    (or the group has one row). Groups are the rows sharing a ``uid``."""
    uids = np.asarray(uids)
    values = values.detach().double().cpu()
    keep = torch.zeros(len(values), dtype=torch.bool)
    names, inverse = np.unique(uids, return_inverse=True)
    kept = 0
    for g in range(len(names)):
        rows = torch.as_tensor(np.nonzero(inverse == g)[0])
        v = values[rows]
        if len(rows) == 1 or bool(v.max() > v.min()):
            keep[rows] = True
            kept += 1
    return keep, kept, len(names)


def collect_batch(config: Config, prompts: Batch | None, next_prompts: Callable[[], Batch],
                  generate_scored: Callable[[Batch, int], Batch]) -> tuple[Batch, dict[str, float]]:
    """The step's scored rollout batch and its ``filter_groups/*`` metrics.

    ``generate_scored(prompts, j)`` generates and scores generation batch j of the step (``SEQ_SCORE``,
    ``ACC``, ``token_level_scores`` set; ``prompts`` None: a batch generated ahead, filtering off). Without ``filter_groups.enable``: the one batch, with the
    share of zero-spread groups. With it: generation batches until ``data.train_batch_size`` groups
    with spread are kept (ValueError past ``max_num_gen_batches``), cut to that many groups.
    """
    fg, want, n = config.algorithm.filter_groups, config.data.train_batch_size, config.actor_rollout_ref.rollout.n
    parts: list[Batch] = []
    kept = total = gen_batches = prompts_used = 0
    while True:
        rollout = generate_scored(prompts, gen_batches)
        gen_batches, prompts_used = gen_batches + 1, prompts_used + len(rollout) // n
        keep, k, groups = group_spread(filter_metric(rollout, fg.metric), rollout["uid"])
        kept, total = kept + k, total + groups
        if not fg.enable:
            return rollout, {"filter_groups/zero_spread_frac": (groups - k) / max(groups, 1)}
        parts.append(rollout.index(torch.nonzero(keep).flatten()))
        if kept >= want:
            break
        if 0 < fg.max_num_gen_batches <= gen_batches:
            raise ValueError(
                f"algorithm.filter_groups: {kept} of {total} groups had a nonzero spread of {fg.metric} after "
                f"{gen_batches} generation batches of data.gen_batch_size={len(rollout) // n} prompts "
                f"(algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); data.train_batch_size="
                f"{want} needs {want}. Raise max_num_gen_batches (<= 0: no cap) or data.gen_batch_size, or check "
                "the reward")
        prompts = next_prompts()
    batch = Batch.concat(parts).index(slice(0, want * n))
    return batch, {"filter_groups/groups_kept": float(kept), "filter_groups/groups_dropped": float(total - kept),
                   "filter_groups/zero_spread_frac": (total - kept) / total,
                   "filter_groups/gen_batches": float(gen_batches), "filter_groups/prompts_consumed": float(prompts_used)}


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """verl's overlong penalty per response (N,): ``min(0, -(L - (max_response_length - buffer_len)) /
    buffer_len * penalty_factor)`` for response lengths L (N,): 0 up to the buffer, then linear, reaching
    ``-penalty_factor`` at the limit."""
    exceed = lengths.double() - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def shape_rewards(batch: Batch, config: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """The trained sequence rewards (N,) and the ``overlong/*`` metrics; with
    ``reward_model.overlong_buffer.enable`` the penalty is added to the raw score and to
    ``token_level_scores`` on its last valid response token (an environment's per-turn rewards stay where they
    are). A response's length counts every token of its response part (``attention_mask``), tool output included."""
    ob, seq = config.reward_model.overlong_buffer, batch[SEQ_SCORE]
    if not ob.enable:
        return seq, {}
    lengths = batch["attention_mask"][:, -batch["responses"].shape[1]:].sum(dim=-1)
    penalty = overlong_penalty(lengths, config.data.max_response_length, ob.len, ob.penalty_factor).float()
    shaped = seq + penalty
    batch["token_level_scores"] = batch["token_level_scores"] + place_scores(penalty, batch["response_mask"])
    return shaped, {"overlong/penalized": float((penalty < 0).sum()), "overlong/penalty_mean": float(penalty.mean())}
