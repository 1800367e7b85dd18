"""The PPO update loop of the FSDP workers: epochs x mini-batches x micro-batches, global normalisers.

A mixin of :class:`workers.fsdp.FSDPWorker` (it uses the worker's ``root`` model, ``optimizer``,
``scheduler``, ``seed``, ``update_steps``, data-parallel rank and size, its micro-batch plan
``_pieces`` and the collectives of :class:`workers.collectives.RankCollectives`). See
:mod:`workers.fsdp` for why every piece's loss share is scaled by the world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlpad.algorithms.losses import batch_normalizers
from rlpad.batch import Batch
from rlpad.parallel import data_parallel_groups
from workers.collectives import full_tensor

__all__ = ["LossFn", "PPOUpdates"]

LossFn = Callable[[Batch, dict[str, float]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class PPOUpdates:
    """:meth:`_ppo_update` and its parts: the epoch's row order, the mini-batch check, the metric
    reduction, the clipped optimizer step."""

    def _epoch_order(self, n: int, epoch: int, shuffle: bool) -> torch.Tensor:
        """This rank's row order in ``epoch`` of the coming update (a permutation when ``shuffle``; the
        same on every rank of a sequence-parallel group)."""
        if not shuffle:
            return torch.arange(n)
        key = ((self.seed * 1_000_003 + self.update_steps) * 1009 + epoch) * 131 + self.dp_rank
        return torch.randperm(n, generator=torch.Generator().manual_seed(key))

    def _check_mini(self, batch: Batch, mini_rows: int, prefix: str) -> int:
        """Per-rank mini-batch rows; ValueError on every rank if the batch does not split into them.
        The mini-batch splits over the data-parallel groups (world / sequence-parallel size)."""
        dp = self.dp_size
        local_mini = mini_rows // dp if mini_rows >= 1 else 0
        groups = data_parallel_groups(dp, self.sp_size)

        def check() -> None:
            if mini_rows < 1 or mini_rows % dp:
                raise ValueError(f"{prefix}: a mini-batch of {mini_rows} rows does not split over {groups}")
            if len(batch) == 0 or len(batch) % local_mini:
                raise ValueError(
                    f"{prefix}: this rank holds {len(batch)} rows, not a multiple of the per-rank mini-batch "
                    f"{local_mini} (ppo_mini_batch_size * rollout.n / {groups})"
                )

        self._agree(check)
        return local_mini

    # ------------------------------------------------------------------ training loop

    def _ppo_update(
        self, batch: Batch, *, mini_rows: int, epochs: int, shuffle: bool,
        micro_rows: int | None, max_tokens: int | None, grad_clip: float, loss_fn: LossFn, prefix: str,
        return_grads: bool = False, first_keys: tuple[str, ...] = (),
    ) -> dict[str, Any]:  # fmt: skip
        """Epochs x mini-batches x micro-batches with global normalisers; mean metrics over mini-batches.

        ``mini_rows`` counts rows of the GLOBAL mini-batch (all ranks). ``loss_fn(piece, norms)``
        returns the piece's SHARE of the mini-batch loss and metric shares (summed over pieces and ranks);
        a metric named ``*_max`` is a maximum instead (max over pieces, ranks and mini-batches).
        ``first_keys``: also report those metrics of the first mini-batch of the first epoch, the one
        the policy has not moved for yet, as ``{prefix}/first_mini_batch/{key}``.
        """
        self._require_model()
        local_mini = self._check_mini(batch, mini_rows, prefix)
        self.root.train()
        lr = self.optimizer.param_groups[0]["lr"]  # the LR of this call's steps
        history: dict[str, list[float]] = {}
        grads: dict[str, torch.Tensor] = {}
        first: dict[str, float] = {}
        for epoch in range(epochs):
            order = self._epoch_order(len(batch), epoch, shuffle)
            for start in range(0, len(batch), local_mini):
                mini = batch.index(order[start : start + local_mini])
                norms = self._group_sum(list(batch_normalizers(mini["response_mask"]).values()))
                norms = {"global_tokens": max(float(norms[0]), 1.0), "global_seqs": max(float(norms[1]), 1.0)}
                pieces, _ = self._pieces(mini, micro_rows, max_tokens)
                sums: dict[str, torch.Tensor] = {}
                for piece, is_real in pieces:
                    loss, shares = loss_fn(piece, norms)
                    (loss * (self.world_size if is_real else 0.0)).backward()
                    if is_real:
                        for k, v in shares.items():
                            v = v.detach().double().cpu()
                            if k.endswith("_max"):
                                sums[k] = torch.maximum(sums[k], v) if k in sums else v
                            else:
                                sums[k] = sums.get(k, 0.0) + v
                stats = self._reduce_stats(sums, prefix)
                if return_grads:
                    grads = self._full_grads()
                stats[f"{prefix}/grad_norm"] = self._optimizer_step(grad_clip)
                if epoch == 0 and start == 0:
                    first = {f"{prefix}/first_mini_batch/{k}": stats[f"{prefix}/{k}"] for k in first_keys
                             if f"{prefix}/{k}" in stats}
                for k, v in stats.items():
                    history.setdefault(k, []).append(v)
        self.scheduler.step()
        self.update_steps += 1
        metrics: dict[str, Any] = {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in history.items()}
        metrics.update(first)
        metrics[f"{prefix}/lr"] = lr
        if return_grads:
            metrics["grads"] = grads
        return metrics

    def _reduce_stats(self, sums: dict[str, torch.Tensor], prefix: str) -> dict[str, float]:
        """Per-rank metric shares -> totals over the ranks, once per data-parallel group (``*_max``
        metrics: the max)."""
        out: dict[str, float] = {}
        for names, reduce in (([k for k in sorted(sums) if not k.endswith("_max")], self._group_sum),
                              ([k for k in sorted(sums) if k.endswith("_max")], self._all_max_float)):
            if names:
                totals = reduce(torch.stack([torch.as_tensor(sums[k]) for k in names]))
                out.update({f"{prefix}/{k}": float(v) for k, v in zip(names, totals)})
        return out

    def _optimizer_step(self, grad_clip: float) -> float:
        """Clip to ``grad_clip`` (if > 0) and step; skip the step on a non-finite norm. Returns the norm."""
        params = [p for p in self.root.parameters() if p.grad is not None]
        norm = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params]))
        if torch.isfinite(norm):
            if grad_clip and grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _full_grads(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) gradients by parameter name; a collective: every rank must call it."""
        return {
            name: full_tensor(p.grad).detach().float().cpu().clone()
            for name, p in self.root.named_parameters() if p.grad is not None
        }  # fmt: skip
