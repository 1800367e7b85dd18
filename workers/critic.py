"""The FSDP2 critic worker: PPO value model (causal LM backbone + scalar head, rlpad.core.value).

Batch keys (declared once per method, :mod:`workers.contract`): ``FORWARD`` for the values;
``update_critic`` also needs ``response_mask``, ``values`` (from the rollout) and ``returns``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlpad.algorithms.losses import compute_value_loss, masked_sum
from rlpad.batch import Batch
from rlpad.config.schema import CriticConfig
from rlpad.core.fused_modules import apply_fused_modules
from rlpad.core.models import empty_causal_lm, load_causal_lm, load_tokenizer, parse_dtype
from rlpad.core.value import ValueModel
from rlpad.export.names import critic_name, folder_order
from rlpad.export.safetensors_stream import TensorSpec
from rlpad.export.value_model import CRITIC_ROLE, ROLE_KEY, value_layout
from workers.contract import FORWARD, batch_method, forward_plus
from workers.fsdp import FSDPWorker, reports_seconds
from workers.collectives import full_tensor
from workers.offload import resident, start_resting
from workers.weight_export import write_hf_weights

__all__ = ["CriticWorker"]

UPDATE = forward_plus(("response_mask", "values", "returns"), finite=("values", "returns"))


class CriticWorker(FSDPWorker):
    """FSDP2 worker of the ``critic`` role (one rank). ``rollout_n``: samples per prompt (mini-batch rows)."""

    role = "critic"

    def __init__(self, config: CriticConfig, role: str = "critic", rollout_n: int = 1, **dist_kwargs: Any):
        super().__init__(config, role=role, **dist_kwargs)
        self.rollout_n = rollout_n

    def init_model(self) -> None:
        """Join the process group, build and shard the value model, build AdamW + warm-up."""
        self._init_distributed()
        mcfg = self.config.model
        path = self._local_path(mcfg.path)
        attn = dict(attn_implementation=mcfg.attn_implementation, use_remove_padding=mcfg.use_remove_padding,
                    trust_remote_code=mcfg.trust_remote_code, share_prompts=mcfg.share_prompts,
                    sequence_parallel=self.sp_size > 1)
        if self.reads_checkpoint:  # the other ranks build on the meta device and receive their shards
            lm = load_causal_lm(path, dtype=mcfg.dtype, device="cpu", attn_device=self.device, **attn)
        else:
            lm = empty_causal_lm(path, dtype=mcfg.dtype, attn_device=self.device, **attn)
        self._check_heads(lm.config)
        if mcfg.use_liger:  # liger-kernel's fused decoder modules (before sharding: they patch the modules)
            apply_fused_modules(lm, "liger", key="critic.model.use_liger", device_type=torch.device(self.device).type)
        if mcfg.enable_gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        value_model = ValueModel(lm, seed=self.seed)
        del lm  # the LM head is not part of the critic
        self.root = self._shard_from_rank0(value_model, value_model.backbone)
        if mcfg.compile_decoder_layers:  # after sharding: FSDP's hooks stay outside the compiled forwards
            apply_fused_modules(value_model.backbone, "compile", key="critic.model.compile_decoder_layers",
                                device_type=torch.device(self.device).type)
        self.model = value_model.backbone
        self._build_optimizer(self.config.optim)
        fsdp = self.config.model.fsdp_config  # verl's: the state in host memory between calls
        start_resting(self, fsdp.param_offload, fsdp.optimizer_offload)

    def _values(self, piece: Batch):
        args, kwargs = self._scoring_args(piece, self.config.model)
        return self.root(*args, **kwargs)

    def _micro(self) -> tuple[int | None, int | None]:
        c = self.config
        return c.ppo_micro_batch_size_per_gpu, (c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None)

    @reports_seconds
    @batch_method(FORWARD)
    @resident
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` (B, R) of the response tokens (0 on padding)."""
        (values,) = self._forward_all(batch, *self._micro(), lambda p: (self._values(p),))
        return Batch({"values": values})

    def _value_loss(self, piece: Batch, norms: dict[str, float]):
        mask = piece["response_mask"]
        vpreds = self._values(piece)
        loss, shares = compute_value_loss(
            vpreds, piece["values"], piece["returns"], mask, self.config.cliprange_value, self.config.loss_agg_mode,
            **norms,
        )  # fmt: skip
        shares["vf_loss"] = loss
        shares["vpred_mean"] = (masked_sum(vpreds, mask) / norms["global_tokens"]).detach()
        return loss, shares

    @reports_seconds
    @batch_method(UPDATE)
    @resident
    def update_critic(self, batch: Batch, *, return_grads: bool = False) -> dict[str, Any]:
        """Clipped value-loss update (same epochs / mini / micro-batch rules and loss scaling as the actor)."""
        c = self.config
        micro_rows, max_tokens = self._micro()
        return self._ppo_update(
            batch, mini_rows=c.ppo_mini_batch_size * self.rollout_n, epochs=c.ppo_epochs, shuffle=False,
            micro_rows=micro_rows, max_tokens=max_tokens, grad_clip=c.grad_clip, loss_fn=self._value_loss,
            prefix="critic", return_grads=return_grads,
        )  # fmt: skip

    @resident
    def save_checkpoint(self, path: str) -> None:
        """:meth:`FSDPWorker.save_checkpoint`, the state on the device for it (``model.fsdp_config``)."""
        super().save_checkpoint(path)

    @resident
    def load_checkpoint(self, path: str) -> None:
        """:meth:`FSDPWorker.load_checkpoint`, the state on the device for it (``model.fsdp_config``)."""
        super().load_checkpoint(path)

    def model_card(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The critic's folder beside its weights (:func:`rlpad.export.hf_folder.write_model_files`'s arguments): its
        model's config as a ``*ForTokenClassification`` with one label and ``"rlpad_role": "critic"``
        (:mod:`rlpad.export.value_model`), the weights' ``dtype`` (default: the parameters'), the tokenizer."""
        mcfg = self.config.model
        try:
            tokenizer = load_tokenizer(self._local_path(mcfg.tokenizer_path or mcfg.path))
        except (OSError, ValueError):
            tokenizer = None
        own = next(iter(self.root.state_dict().values())).dtype
        return dict(config=self.root.config, dtype=dtype or own, architecture=value_layout(self.root.config)[0],
                    tokenizer=tokenizer, generates=False, num_labels=1, **{ROLE_KEY: CRITIC_ROLE})

    @resident
    def save_hf(self, path: str, dtype: str | None = None) -> None:
        """Write the value model as a Hugging Face folder at ``path`` (``*ForTokenClassification``, one label;
        load it back with :func:`rlpad.export.value_model.load_value_model`), streamed as the actor's
        (:meth:`workers.weight_export.WeightExportMixin.save_hf`); a collective."""
        out = parse_dtype(dtype) if dtype is not None else None
        state = self.root.state_dict()
        _, prefix, head = value_layout(self.root.config)
        sources = sorted(((critic_name(k, prefix, head), k) for k in state), key=lambda p: folder_order(p[0]))
        specs = [TensorSpec(n, tuple(state[k].shape), out if out is not None and state[k].is_floating_point()
                            else state[k].dtype) for n, k in sources]
        tensors = ((n, full_tensor(state[k]).detach()) for n, k in sources)
        write_hf_weights(path, specs, tensors, self.rank == 0, lambda: self.model_card(out))
        if self.world_size > 1:
            dist.barrier()
