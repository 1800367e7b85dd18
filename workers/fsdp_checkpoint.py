"""Sharded checkpoints of an FSDP2 worker: weights, optimizer, LR schedule, step count and RNG.

A mixin of :class:`workers.fsdp.FSDPWorker` (it uses ``root``, ``optimizer``, ``scheduler``,
``update_steps``, ``rank``, ``world_size``). Weights reshard on load, so a run saved on N ranks
resumes on M.

With LoRA only the adapters (and their AdamW state) are saved: the frozen base is rebuilt from the model
folder, as at the start; the adapter also goes out in peft's format (``lora_adapter/``). Rank 0 also writes
``huggingface/``: the model's config, generation config and tokenizer (the worker's ``model_card``), so
``rlpad export`` turns the checkpoint into a model folder with nothing else at hand.

Before the first update the optimizer has no state. torch's ``get_state_dict`` would create it by
running ``optimizer.step()`` on zero gradients, and AdamW counts that step (every later bias
correction shifts by one). So an optimizer without state is neither asked for a state dict nor
saved (``extra["optimizer_state"] = False``); loading such a checkpoint leaves the optimizer fresh.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

# a LoRA actor's checkpoint: its adapter as a peft folder in LORA_ADAPTER_DIR; every checkpoint: the model's config,
# generation config and tokenizer in MODEL_FILES_DIR (what `rlpad export` writes beside the weights)
from rlpad.export.hf_folder import LORA_ADAPTER_DIR, MODEL_FILES_DIR, write_model_files

__all__ = ["LORA_ADAPTER_DIR", "CheckpointMixin"]


class CheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` for an FSDP2 worker (torch.distributed.checkpoint)."""

    def _has_optimizer_state(self) -> bool:
        return self.optimizer is not None and bool(self.optimizer.state)

    def _state(self, with_optimizer: bool) -> tuple[dict, list]:
        """``{"model": ..., "optim": ...}`` (sharded) and the optimizers it covers (none: model only)."""
        optims = [self.optimizer] if with_optimizer else []
        model_sd, optim_sd = get_state_dict(self.root, optims, options=StateDictOptions(full_state_dict=False))
        if self._frozen_base:  # LoRA: the frozen base is the model folder's; only the adapters are saved
            trainable = {name for name, p in self.root.named_parameters() if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in trainable}
        return ({"model": model_sd, "optim": optim_sd} if optims else {"model": model_sd}), optims

    @property
    def _frozen_base(self) -> bool:
        """A LoRA actor: its base weights are frozen (the model folder's), its adapters trained."""
        return getattr(self, "lora", None) is not None

    def save_checkpoint(self, path: str) -> None:
        """Sharded checkpoint (torch.distributed.checkpoint) of weights, optimizer, LR schedule, step and RNG."""
        self._require_model()
        with_optimizer = self._has_optimizer_state()
        state, _ = self._state(with_optimizer)
        os.makedirs(path, exist_ok=True)
        dcp.save(state, checkpoint_id=path)
        extra = {
            "optimizer_state": with_optimizer,
            "update_steps": self.update_steps,
            "world_size": self.world_size,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": {
                "torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            },
        }  # fmt: skip
        torch.save(extra, os.path.join(path, f"extra_rank{self.rank}.pt"))
        card = getattr(self, "model_card", None)
        if card is not None and self.rank == 0:
            write_model_files(os.path.join(path, MODEL_FILES_DIR), **card())
        if self._frozen_base:  # LoRA: the adapter also in peft's format (docs/lora.md)
            self.save_lora_adapter(os.path.join(path, LORA_ADAPTER_DIR))
        if self.world_size > 1:
            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (weights reshard to this world size; RNG per rank)."""
        self._require_model()
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise ValueError(f"{self.role}: {path!r} is not a checkpoint directory (no .metadata)")
        own = os.path.join(path, f"extra_rank{self.rank}.pt")
        extra = torch.load(own if os.path.exists(own) else os.path.join(path, "extra_rank0.pt"), weights_only=False)
        with_optimizer = self.optimizer is not None and extra.get("optimizer_state", True)
        if self.optimizer is not None and not with_optimizer:
            self.optimizer.state.clear()  # saved before the first update: a fresh optimizer
        state, optims = self._state(with_optimizer)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.root, optims, model_state_dict=state["model"], optim_state_dict=state.get("optim", {}),
                       options=StateDictOptions(strict=not self._frozen_base))
        self.update_steps = int(extra["update_steps"])
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
            if not with_optimizer:  # the LR lives in the optimizer's param groups, which were not saved
                for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                    group["lr"] = lr
        if os.path.exists(own) and extra["world_size"] == self.world_size:
            rng = extra["rng"]
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        if self.world_size > 1:
            dist.barrier()
