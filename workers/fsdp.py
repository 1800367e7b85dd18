"""FSDP2 plumbing shared by the actor/reference and critic workers.

One worker = one rank of a torch.distributed group. It works in a plain process (world 1, or
launched by torchrun: its GPU is ``LOCAL_RANK``, :func:`cuda_device_index`) and as a Ray actor (see :mod:`workers.group`); this module never imports Ray.

Loss scaling: a mini-batch's loss is normalised by counts of the WHOLE mini-batch (tokens or
sequences, all-reduced over the ranks before the micro-batch loop), so every micro-batch on every
rank contributes its exact share and the shares sum to the mini-batch loss. FSDP2 AVERAGES
gradients over the ranks in its reduce-scatter, so each share is multiplied by the world size
before ``backward``: the reduced gradient is then the gradient of the mini-batch loss, whatever
the micro-batch count, token budget or world size.

Sequence parallelism (``ulysses_sequence_parallel_size`` sp, :mod:`rlpad.parallel`): the world is
``world / sp`` data-parallel groups of sp consecutive ranks. The rows of a batch are split over
the groups; the ranks of one group get the same rows, run 1/sp of each packed row
(:mod:`rlpad.core.sequence_parallel`) and all compute the same loss from the gathered log-probs,
each token's gradient reaching only the rank that scored it, so the ranks' gradients of a group
sum to its loss's. Counts (normalisers, metric shares) are summed once per group
(:meth:`FSDPWorker._group_sum`), mini-batches and shuffles are per group, a token budget counts
the whole row (``max_tokens x sp`` per micro-batch), and the world-size factor stays the world.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rlpad.batch import Batch, worker_seconds
from rlpad.config.schema import ModelConfig
from workers.optim import build_lr_scheduler, build_optimizer
from rlpad.batching.micro_batches import micro_batches
from rlpad.core.host_plan import HostBatch
from rlpad.core.sequence_parallel import SequenceParallel, kv_repeats
from rlpad.core.shared_prompt import min_saved_for
from rlpad.core.vision import MM_KEY
import rlpad.embedded.tiny  # noqa: F401  registers the tiny:<arch> model paths with rlpad.core.models
from rlpad.parallel import dp_size, sp_size
from rlpad.batching.balance import restore_order
from workers.collectives import RankCollectives
from workers.ppo_update import PPOUpdates
from workers.fsdp_checkpoint import CheckpointMixin
from workers.net import free_port, pin_interface
from workers.sharded_init import fill_from_rank0

__all__ = ["HOST_COPY", "FSDPWorker", "cuda_device_index", "free_port",  # free_port: from workers.net
           "reports_seconds"]

# A micro-batch's ``meta`` key for its host copy (:class:`rlpad.core.host_plan.HostBatch`), taken from the
# CPU tensors before they move to the device: the forward builds its index plans from it and never
# reads the device (on CUDA that read would be a host sync per micro-batch).
HOST_COPY = "host_copy"



def reports_seconds(method: Callable[..., Any]) -> Callable[..., Any]:
    """Time a worker method inside the worker and attach the seconds to its Batch or metrics dict
    (``rlpad.batch.WORKER_SECONDS``): the trainer's overhead is its wall time minus these."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = method(*args, **kwargs)
        return worker_seconds(result, time.perf_counter() - start)

    return wrapper


def cuda_device_index(env: Mapping[str, str], device_count: int, current: int) -> int:
    """The CUDA device a rank runs on: ``LOCAL_RANK`` where the launcher gives it (torchrun: one
    process per GPU of its node, all seeing every GPU), else ``current`` (a Ray actor sees only its
    own GPU). ValueError for a LOCAL_RANK that is not an int or names no visible device."""
    local = env.get("LOCAL_RANK", "")
    if local == "":
        return current
    try:
        index = int(local)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local!r} is not an int") from None
    if not 0 <= index < device_count:
        raise ValueError(f"LOCAL_RANK={index} names no device: this process sees {device_count} CUDA device(s)")
    return index


class FSDPWorker(CheckpointMixin, RankCollectives, PPOUpdates):
    """Base of the FSDP2 workers: process group, sharding, micro-batching, optimizer step, checkpoints."""

    role = "worker"

    def __init__(
        self,
        config: Any,
        *,
        role: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        seed: int = 1,
        timeout_s: float = 1800.0,
        resolve_path: Callable[[str], str] | None = None,
        device: str | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, {world_size})")
        self.config = config
        self.role = role or self.role
        self.rank, self.world_size = rank, world_size
        self.master_addr, self.master_port = master_addr, master_port
        self.seed, self.timeout_s = seed, timeout_s
        self.resolve_path = resolve_path  # driver path -> readable path on this node (workers.staging)
        self.socket_ifname: str | None = None
        self.paths_read: dict[str, str] = {}  # config path -> the path this rank read
        if device not in (None, "auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
        cuda = torch.cuda.is_available() if device in (None, "auto") else device == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"{self.role}: device=cuda but torch sees no CUDA device")
        self.device = torch.device("cpu")
        if cuda:  # set before any CUDA work: NCCL and every allocation use the current device
            index = cuda_device_index(os.environ, torch.cuda.device_count(), torch.cuda.current_device())
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        self.root: nn.Module | None = None  # the FSDP2 module (model + head) the worker runs
        self.model: nn.Module | None = None  # the HF model inside ``root``: batches are checked against it
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.update_steps = 0  # completed update calls (= LR scheduler steps)
        self.sp_size = self.sequence_parallel_size(config, self.role)
        self.dp_size = dp_size(world_size, self.sp_size, self.role)  # data-parallel groups
        self.dp_rank = rank // self.sp_size  # this rank's group
        self.sp: SequenceParallel | None = None  # its sequence-parallel group (set up by _init_distributed)

    @staticmethod
    def sequence_parallel_size(config: Any, role: str) -> int:
        """Ranks per sequence-parallel group of ``role`` under ``config`` (rlpad.parallel.sp_size)."""
        return sp_size(config, role)

    # ------------------------------------------------------------------ set-up

    def set_rendezvous(self, master_addr: str, master_port: int) -> None:
        """Where rank 0 listens (its node IP and a free port there); call before ``init_model``."""
        self.master_addr, self.master_port = master_addr, int(master_port)

    def empty_device_cache(self) -> None:
        """Give the blocks PyTorch's CUDA caching allocator holds back to the device (before another
        process on this GPU needs them: the colocated layout's engine); nothing on CPU."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def rank_info(self) -> dict[str, Any]:
        """What this rank used to join its group (rendezvous, socket interface, host, pid) and its seed."""
        return {"role": self.role, "rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                "seed": self.seed, "master_addr": self.master_addr, "master_port": self.master_port,
                "socket_ifname": self.socket_ifname, "paths_read": dict(self.paths_read)}

    def _local_path(self, path: str) -> str:
        local = self.resolve_path(path) if self.resolve_path is not None else path
        self.paths_read[path] = local
        return local

    def _init_distributed(self) -> None:
        if dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
                raise RuntimeError(
                    f"{self.role}: a process group (rank {dist.get_rank()}/{dist.get_world_size()}) already exists, "
                    f"this worker is rank {self.rank}/{self.world_size}"
                )
        else:
            if self.master_port is None:
                if self.world_size > 1:
                    raise ValueError(f"{self.role}: master_port is required when world_size > 1")
                self.master_port = free_port(self.master_addr)
            cuda = self.device.type == "cuda"
            self.socket_ifname = pin_interface(self.master_addr, cuda)
            dist.init_process_group(
                "cpu:gloo,cuda:nccl" if cuda else "gloo",
                init_method=f"tcp://{self.master_addr}:{self.master_port}",
                rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=self.timeout_s),
            )  # fmt: skip
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        if self.sp_size > 1:  # every rank creates every group, in the same order
            for g in range(self.dp_size):
                group = dist.new_group(list(range(g * self.sp_size, (g + 1) * self.sp_size)))
                if g == self.dp_rank:
                    self.sp = SequenceParallel(group)

    def _check_heads(self, config: Any) -> None:
        """ValueError unless the model's query heads split over the sequence-parallel ranks."""
        if self.sp_size > 1:
            q = config.num_attention_heads
            kv_repeats(q, getattr(config, "num_key_value_heads", None) or q, self.sp_size)

    @property
    def reads_checkpoint(self) -> bool:
        """Only rank 0 reads the weights; the other ranks build on the meta device and receive shards."""
        return self.rank == 0 or self.world_size == 1

    def _shard(self, root: nn.Module, inner: nn.Module) -> nn.Module:
        """``fully_shard`` each decoder layer of ``inner``, then ``root`` (embeddings, norm, heads)."""
        # rlpad.core.forward returns views of its outputs; nothing modifies them in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        layer_types = set(getattr(inner, "_no_split_modules", None) or [])
        for module in inner.modules():
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=self.mesh)
        fully_shard(root, mesh=self.mesh)
        return root

    def _shard_from_rank0(self, root: nn.Module, inner: nn.Module) -> nn.Module:
        """Shard ``root`` (loaded on rank 0, on the meta device elsewhere); every rank receives its
        rows from rank 0 (:func:`workers.sharded_init.fill_from_rank0`)."""
        if self.world_size == 1:
            return self._shard(root, inner)
        full = {name: p.detach() for name, p in root.named_parameters()} if self.reads_checkpoint else None
        self._shard(root, inner)
        if not self.reads_checkpoint:
            root.to_empty(device=self.device)
        fill_from_rank0(root, full, rank=self.rank, world_size=self.world_size, device=self.device)
        return root

    def _build_optimizer(self, optim_cfg: Any) -> None:
        # the trainable parameters only (with LoRA: the adapters; the frozen base gets no AdamW state)
        self.optimizer = build_optimizer([p for p in self.root.parameters() if p.requires_grad], optim_cfg)
        self.scheduler = build_lr_scheduler(self.optimizer, optim_cfg)

    def _require_model(self) -> None:
        if self.root is None:
            raise RuntimeError(f"{self.role}: call init_model() first")

    # ------------------------------------------------------------------ micro-batching

    def _pieces(self, batch: Batch, micro_rows: int | None, max_tokens: int | None):
        """``(pieces, real)``: a generator of ``(piece on device, is_real)`` per micro-batch
        (:func:`rlpad.batching.micro_batches.micro_batches`, the count agreed over the ranks; an empty one
        becomes a dummy copy of row 0), and the index lists of the real micro-batches."""
        budget = max_tokens * self.sp_size if max_tokens is not None else None  # the row is split over sp ranks
        parts = micro_batches(batch, micro_rows, budget, share_prompts=self.config.model.share_prompts,
                              agree=self._all_max)
        pieces = ((self._on_device(batch.index(p or [0])), bool(p)) for p in parts)
        return pieces, [p for p in parts if p]

    def _scoring_args(self, piece: Batch, mcfg: ModelConfig) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of the scoring core (:func:`rlpad.core.forward.compute_log_probs`,
        :func:`rlpad.core.value.compute_values`) for a micro-batch on this rank, model config ``mcfg``:
        checked where the batch entered (@batch_method), tool output context and not scored
        (``response_mask``), the index plans from the piece's host copy, a VL batch's images (``multi_modal_inputs``)."""
        args = (piece["input_ids"], piece["attention_mask"], piece.tensors.get("position_ids"),
                int(piece["responses"].shape[1]))
        return args, dict(
            use_remove_padding=mcfg.use_remove_padding, share_prompts=mcfg.share_prompts,
            share_min_saved=min_saved_for(mcfg.share_prompts_min_saved_fraction, self.device), check=False,
            sp=self.sp, response_mask=piece.tensors.get("response_mask"), host=piece.meta.get(HOST_COPY),
            multi_modal_inputs=piece.non_tensors.get(MM_KEY),
        )

    def _on_device(self, piece: Batch) -> Batch:
        """``piece`` on this rank's device, its host copy in ``meta[HOST_COPY]``."""
        t = piece.tensors
        host = HostBatch.of(t["input_ids"], t["attention_mask"], t.get("position_ids"), t.get("response_mask"))
        out = piece.to(self.device)
        out.meta[HOST_COPY] = host
        return out

    def _forward_all(self, batch: Batch, micro_rows: int | None, max_tokens: int | None,
                     fn: Callable[[Batch], tuple[torch.Tensor | np.ndarray, ...]], *,
                     update_layout: tuple[int, bool] | None = None) -> list[torch.Tensor | np.ndarray]:
        """``fn`` on every micro-batch without gradients; outputs concatenated in the batch's row order.
        An output is a tensor (rows first; floating point comes back as fp32, integers as they are) or an
        object array of per-row tensors (a jagged field, rlpad.core.distill_scoring.split_rows).

        ``update_layout=(mini_rows, shuffle)``: split exactly as the FIRST epoch of :meth:`_ppo_update`
        with the same arguments splits it (mini-batches of ``mini_rows`` global rows in the epoch-0
        order, then micro-batches by ``micro_rows`` / ``max_tokens``), so each row goes through the
        same packed forward here and in that epoch's update; call it before the update, as its
        order depends on the update count.
        """
        self._require_model()
        self.root.eval()
        if update_layout is None:
            chunks = [torch.arange(len(batch))]
        else:
            mini_rows, shuffle = update_layout
            local_mini = self._check_mini(batch, mini_rows, self.role)
            order = self._epoch_order(len(batch), 0, shuffle)
            chunks = [order[s : s + local_mini] for s in range(0, len(batch), local_mini)]
        results: list[list[torch.Tensor]] = []
        with torch.no_grad():
            for rows in chunks:
                pieces, real = self._pieces(batch.index(rows), micro_rows, max_tokens)
                outs: list[tuple[torch.Tensor, ...]] = []
                for piece, is_real in pieces:
                    out = fn(piece)  # dummy pieces run too: every rank joins every FSDP collective
                    if is_real:
                        outs.append(tuple(map(_to_host, out)))
                results.append([restore_order(_cat([o[i] for o in outs]), real) for i in range(len(outs[0]))])
        order = torch.cat(chunks)
        merged = [_cat([r[i] for r in results]) for i in range(len(results[0]))]
        return [_placed(m, order) for m in merged]

    # ------------------------------------------------------------------ teardown

    def shutdown(self) -> None:
        """Destroy the process group (the worker is unusable afterwards)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_host(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """A micro-batch's output on the host: floating point as fp32, integers unchanged, per-row arrays as they are."""
    if isinstance(x, np.ndarray):
        return x
    return x.float().cpu() if x.is_floating_point() else x.cpu()


def _cat(parts: list) -> torch.Tensor | np.ndarray:
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)


def _placed(rows: torch.Tensor | np.ndarray, order: torch.Tensor) -> torch.Tensor | np.ndarray:
    """``rows`` (in ``order``) put back at their places: ``out[order] = rows``."""
    if isinstance(rows, np.ndarray):
        out = np.empty_like(rows)
        out[order.numpy()] = rows
        return out
    return torch.empty_like(rows).index_copy_(0, order, rows)
