"""The FSDP2 actor / reference worker: log-probs, the PPO/GRPO policy update, weight export.

One class serves both roles; the reference (``role="ref"``) has no optimizer. Usable in a plain
process (world 1) or as one rank of a Ray worker group (:mod:`workers.group`).

Batch keys (see docs/design.md): ``input_ids``, ``attention_mask`` (B, P+R), optional
``position_ids``, ``responses`` (B, R); ``update_actor`` also needs ``response_mask``,
``old_log_probs``, ``advantages`` and, with ``use_kl_loss``, ``ref_log_probs``; an optional
``rollout_is_weights`` (B, R) multiplies each token's policy-gradient term (rollout correction).

Exactly on-policy first mini-batch: ``compute_log_prob(batch, update_layout=True)`` computes the
old log-probs with the update's mini-/micro-batch split (see ``FSDPWorker._forward_all``), so the
first mini-batch of the following ``update_actor`` on the same shard sees every row through the
same packed forward: its ratio is exactly 1 and its ppo_kl exactly 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from rlpad.algos import agg_loss, compute_policy_loss, kl_penalty
from rlpad.batch import Batch
from rlpad.config import ActorRolloutRefConfig
from rlpad.core.forward import LogProbModel
from rlpad.core.models import empty_causal_lm, load_causal_lm, load_tokenizer
from rlpad.rollout.buckets import plan_buckets
from workers.batch_check import check_rollout_batch
from workers.fsdp import FSDPWorker, full_tensor, reports_seconds
from workers.offload import StateOffloader

__all__ = ["ActorWorker"]

ROLES = ("actor", "ref")
FORWARD_KEYS = ["input_ids", "attention_mask", "responses"]


class ActorWorker(FSDPWorker):
    """FSDP2 worker of the ``actor`` or ``ref`` role (one rank); see the module docstring."""

    def __init__(self, config: ActorRolloutRefConfig, role: str = "actor", **dist_kwargs: Any):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        super().__init__(config, role=role, **dist_kwargs)
        self.model = None  # the HF causal LM inside the FSDP root
        self._offloader: StateOffloader | None = None

    def init_model(self) -> None:
        """Join the process group, build the model (read by rank 0 only, see
        :meth:`FSDPWorker._shard_from_rank0`), shard it (FSDP2), build AdamW + warm-up (actor only)."""
        self._init_distributed()
        mcfg = self.config.model
        path = self._local_path(mcfg.path)
        attn = dict(attn_implementation=mcfg.attn_implementation, use_remove_padding=mcfg.use_remove_padding,
                    trust_remote_code=mcfg.trust_remote_code, share_prompts=mcfg.share_prompts)
        if self.reads_checkpoint:  # loaded on the CPU; sharding moves each rank's rows to its device
            model = load_causal_lm(path, dtype=mcfg.dtype, device="cpu", attn_device=self.device, **attn)
        else:
            model = empty_causal_lm(path, dtype=mcfg.dtype, attn_device=self.device, **attn)
        if self.role == "actor" and mcfg.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.role == "ref":
            model.requires_grad_(False)
        self.model = model
        self.root = self._shard_from_rank0(LogProbModel(model), model)
        if self.role == "actor":
            self._build_optimizer(self.config.actor.optim)

    # ------------------------------------------------------------------ log-probs

    @staticmethod
    def input_keys(method: str, config: ActorRolloutRefConfig) -> list[str]:
        """The batch keys ``method`` reads (the worker group ships only these)."""
        keys = FORWARD_KEYS + ["position_ids"]
        if method == "update_actor":
            keys += ["response_mask", "old_log_probs", "advantages"]
            keys += ["ref_log_probs"] if config.actor.use_kl_loss else []
        return keys

    def _check(self, batch: Batch, keys: list[str], finite: list[str], who: str) -> None:
        self._require_model()
        mcfg = self.config.model
        self._agree(lambda: check_rollout_batch(batch, keys, finite, who, self.model, mcfg.use_remove_padding,
                                                mcfg.share_prompts))  # fmt: skip

    def _forward_keys(self, batch: Batch) -> list[str]:
        return FORWARD_KEYS + (["position_ids"] if "position_ids" in batch else [])

    def _log_probs(self, piece: Batch, temperature: float, calculate_entropy: bool):
        mcfg = self.config.model
        return self.root(
            piece["input_ids"], piece["attention_mask"], piece.tensors.get("position_ids"),
            int(piece["responses"].shape[1]), use_remove_padding=mcfg.use_remove_padding,
            share_prompts=mcfg.share_prompts, temperature=temperature, calculate_entropy=calculate_entropy, logits_chunk_size=mcfg.logits_chunk_size,
            check=False,  # the whole batch was checked where it entered (_check)
        )  # fmt: skip

    def _temperature(self, batch: Batch) -> float:
        return float(batch.meta.get("temperature", self.config.rollout.temperature))

    @reports_seconds
    def compute_log_prob(self, batch: Batch, *, update_layout: bool = False) -> Batch:
        """``old_log_probs`` and ``entropy`` (B, R) of the response tokens, under the current weights.

        Micro-batches follow ``rollout.log_prob_*`` (verl's names), or with ``update_layout`` the
        first epoch of the coming ``update_actor`` on this same shard (``actor.ppo_mini_batch_size``,
        ``ppo_micro_batch_size_per_gpu`` / ``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``,
        ``shuffle``). Temperature from ``batch.meta``.
        """
        self._check(batch, FORWARD_KEYS, [], "compute_log_prob")
        t = self._temperature(batch)
        if update_layout:
            acfg = self.config.actor
            micro, budget = acfg.ppo_micro_batch_size_per_gpu, acfg.ppo_max_token_len_per_gpu if acfg.use_dynamic_bsz else None
            layout = (acfg.ppo_mini_batch_size * self.config.rollout.n, acfg.shuffle)
        else:
            rcfg = self.config.rollout
            micro = rcfg.log_prob_micro_batch_size_per_gpu
            budget = rcfg.log_prob_max_token_len_per_gpu if rcfg.log_prob_use_dynamic_bsz else None
            layout = None
        log_probs, entropy = self._forward_all(
            batch, self._forward_keys(batch), micro, budget, lambda piece: self._log_probs(piece, t, True),
            update_layout=layout,
        )  # fmt: skip
        return Batch({"old_log_probs": log_probs, "entropy": entropy}, meta={"temperature": t})

    @reports_seconds
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_probs`` (B, R); micro-batches follow ``ref.log_prob_*``."""
        self._check(batch, FORWARD_KEYS, [], "compute_ref_log_prob")
        rcfg = self.config.ref
        t = self._temperature(batch)
        (log_probs,) = self._forward_all(
            batch, self._forward_keys(batch), rcfg.log_prob_micro_batch_size_per_gpu,
            rcfg.log_prob_max_token_len_per_gpu if rcfg.log_prob_use_dynamic_bsz else None,
            lambda piece: self._log_probs(piece, t, False)[:1],
        )  # fmt: skip
        return Batch({"ref_log_probs": log_probs}, meta={"temperature": t})

    # ------------------------------------------------------------------ update

    def _policy_loss(self, piece: Batch, norms: dict[str, float], temperature: float):
        acfg = self.config.actor
        mask = piece["response_mask"]
        log_prob, entropy = self._log_probs(piece, temperature, acfg.entropy_coeff != 0)
        low = acfg.clip_ratio if acfg.clip_ratio_low is None else acfg.clip_ratio_low
        high = acfg.clip_ratio if acfg.clip_ratio_high is None else acfg.clip_ratio_high
        pg_loss, shares = compute_policy_loss(
            piece["old_log_probs"], log_prob, piece["advantages"], mask, low, high, acfg.clip_ratio_c,
            acfg.loss_agg_mode, **norms, rollout_is_weights=piece.tensors.get("rollout_is_weights"),
        )  # fmt: skip
        shares["pg_loss"] = pg_loss
        loss = pg_loss
        if acfg.entropy_coeff != 0:
            shares["entropy"] = agg_loss(entropy, mask, acfg.loss_agg_mode, **norms)
            loss = loss - acfg.entropy_coeff * shares["entropy"]
        if acfg.use_kl_loss:
            kld = kl_penalty(log_prob, piece["ref_log_probs"], acfg.kl_loss_type)
            shares["kl_loss"] = agg_loss(kld, mask, acfg.loss_agg_mode, **norms)
            loss = loss + acfg.kl_loss_coef * shares["kl_loss"]
        return loss, shares

    @reports_seconds
    def update_actor(self, batch: Batch, *, return_grads: bool = False) -> dict[str, Any]:
        """PPO/GRPO policy update on this rank's rows; returns metrics equal on every rank.

        ``ppo_epochs`` x mini-batches of ``ppo_mini_batch_size * rollout.n`` rows (all ranks
        together) x micro-batches (``ppo_micro_batch_size_per_gpu`` rows, or
        ``ppo_max_token_len_per_gpu`` tokens with ``use_dynamic_bsz``), one AdamW step per mini-batch,
        one LR-schedule step per call. ``return_grads``: add ``"grads"``, the full gradients of the
        last mini-batch (HF names) taken before clipping and the optimizer step.
        """
        if self.role != "actor":
            raise RuntimeError(f"update_actor called on a {self.role!r} worker")
        acfg = self.config.actor
        keys = FORWARD_KEYS + ["response_mask", "old_log_probs", "advantages"]
        keys += ["ref_log_probs"] if acfg.use_kl_loss else []
        keys += ["rollout_is_weights"] if "rollout_is_weights" in batch else []
        finite = ["old_log_probs", "advantages"] + (["ref_log_probs"] if acfg.use_kl_loss else [])
        finite += ["rollout_is_weights"] if "rollout_is_weights" in batch else []
        self._check(batch, keys, finite, "update_actor")
        t = self._temperature(batch)
        metrics = self._ppo_update(
            batch, keys=keys + (["position_ids"] if "position_ids" in batch else []),
            mini_rows=acfg.ppo_mini_batch_size * self.config.rollout.n, epochs=acfg.ppo_epochs,
            shuffle=acfg.shuffle, micro_rows=acfg.ppo_micro_batch_size_per_gpu,
            max_tokens=acfg.ppo_max_token_len_per_gpu if acfg.use_dynamic_bsz else None,
            grad_clip=acfg.grad_clip, loss_fn=lambda piece, norms: self._policy_loss(piece, norms, t),
            prefix="actor", return_grads=return_grads, first_keys=("ppo_kl", "log_ratio_abs_max"),
        )  # fmt: skip
        if return_grads:
            metrics["grads"] = {_hf_name(k): v for k, v in metrics["grads"].items()}
        return metrics

    # ------------------------------------------------------------------ colocated phases

    def offload_state(self) -> int:
        """Before generation in the colocated layout: parameters (+ gradients) and / or optimizer
        state to host memory, as ``actor.fsdp.param_offload`` / ``optimizer_offload`` say
        (:class:`workers.offload.StateOffloader`, bit-identical round trip); returns the bytes moved."""
        self._require_model()
        fsdp = self.config.actor.fsdp
        parts = ["params"] * fsdp.param_offload + ["optimizer"] * (fsdp.optimizer_offload and self.optimizer is not None)
        if parts and self._offloader is None:
            self._offloader = StateOffloader(self.root, self.optimizer)
        moved = sum(self._offloader.offload(part) for part in parts)
        self.empty_device_cache()  # the freed storages (and the update's activations) back to the device
        return moved

    def reload_state(self) -> None:
        """After generation: bring back what :meth:`offload_state` moved (nothing if it moved nothing)."""
        for part in ("params", "optimizer"):
            if self._offloader is not None and self._offloader.is_offloaded(part):
                self._offloader.reload(part)

    # ------------------------------------------------------------------ weights out

    def _hf_sources(self) -> list[tuple[str, str]]:
        """``(HF name, state-dict key)`` of every exported tensor; a tied head maps to the embedding."""
        self._require_model()
        keys = list(self.root.state_dict().keys())
        pairs = [(_hf_name(k), k) for k in keys]
        if "lm_head.weight" not in {n for n, _ in pairs} and getattr(self.model.config, "tie_word_embeddings", False):
            embed = [k for n, k in pairs if n.endswith("embed_tokens.weight")]
            if not embed:
                raise RuntimeError(f"{self.role}: tied embeddings but no embed_tokens.weight in the state dict")
            pairs.append(("lm_head.weight", embed[0]))
        return pairs

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(HF name, full tensor)`` of the model, ``lm_head.weight`` included when tied.

        A collective: every rank must iterate it to the end.
        """
        state = self.root.state_dict() if self.root is not None else None
        for name, key in self._hf_sources():
            yield name, full_tensor(state[key]).detach()

    def _bucket_plan(self, bucket_bytes: int) -> list[list[str]]:
        """HF names per weight-sync bucket (the same on every rank: from the state dict's metadata)."""
        sources = self._hf_sources()
        state = self.root.state_dict()
        sizes = [(name, state[key].numel() * state[key].element_size()) for name, key in sources]
        return plan_buckets(sizes, bucket_bytes)

    def iter_weight_buckets(self, bucket_bytes: int, keep: bool | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full tensors (HF names, on CPU) in buckets of whole units (rlpad.rollout.buckets).

        A collective: every rank gathers every tensor (FSDP2 all-gathers) and must iterate to the
        end; only the ranks that ``keep`` them (default: rank 0) fill the buckets, the others yield
        empty ones. At most one bucket is held at a time by this generator.
        """
        keep = self.rank == 0 if keep is None else keep
        plan = self._bucket_plan(bucket_bytes)
        state, sources = self.root.state_dict(), dict(self._hf_sources())
        for names in plan:
            bucket = []
            for name in names:
                full = full_tensor(state[sources[name]]).detach()
                if keep:
                    bucket.append((name, full.cpu()))
            yield bucket

    def push_weights(self, replicas: list[Any], bucket_bytes: int, max_in_flight: int = 2, *,
                     targets: list[list[int]] | None = None) -> dict[str, float] | None:
        """Send the full weights to the rollout replicas in buckets, without the driver; a collective.

        Every rank gathers each bucket; a rank with targets puts it once in the Ray object store
        (its node's) for its replicas (workers.rollout.push_weight_buckets). ``targets[rank]``:
        the indices of the replicas that rank feeds (the colocated layout: the replica on its own
        bundle); default: rank 0 feeds them all. Returns the stats on a feeding rank, else ``None``.
        """
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be an int > 0, got {bucket_bytes!r}")
        if not replicas or max_in_flight < 1:  # checked on every rank, before any collective
            raise ValueError(f"push_weights needs >= 1 replica and max_in_flight >= 1, got {len(replicas)}, "
                             f"{max_in_flight}")
        if targets is None:
            targets = [list(range(len(replicas)))] + [[]] * (self.world_size - 1)
        fed = sorted(i for t in targets for i in t)
        if len(targets) != self.world_size or fed != list(range(len(replicas))):
            raise ValueError(f"push_weights targets must give each of the {len(replicas)} replicas to exactly one of "
                             f"the {self.world_size} ranks, got {targets}")
        mine = [replicas[i] for i in targets[self.rank]]
        buckets = self.iter_weight_buckets(bucket_bytes, keep=bool(mine))
        if not mine:
            for _ in buckets:
                pass
            return None
        from workers.rollout import push_weight_buckets  # imports ray: only in a Ray worker

        partial = len(self._bucket_plan(bucket_bytes)) > 1
        return push_weight_buckets(buckets, mine, max_in_flight=max_in_flight, partial=partial)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
        """Full weights by HF name, on CPU, for the rollout sync (``None`` off rank 0 if ``rank0_only``)."""
        keep = self.rank == 0 or not rank0_only
        out = {}
        for name, tensor in self.iter_hf_tensors():
            if keep:
                out[name] = tensor.cpu()
        return out if keep else None

    def save_hf(self, path: str) -> None:
        """Write a ``save_pretrained`` directory (config, safetensors, tokenizer) from rank 0."""
        state = self.full_state_dict(rank0_only=True)
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            self.model.save_pretrained(path, state_dict=state)
            mcfg = self.config.model
            try:
                load_tokenizer(self._local_path(mcfg.tokenizer_path or mcfg.path)).save_pretrained(path)
            except (OSError, ValueError):
                pass  # no tokenizer next to the weights: the weights alone are still loadable
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


def _hf_name(fsdp_name: str) -> str:
    return fsdp_name[len("model."):] if fsdp_name.startswith("model.") else fsdp_name
