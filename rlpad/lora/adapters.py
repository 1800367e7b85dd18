"""LoRA with Hugging Face peft: adapters on a causal LM, their merge into full weights, the adapter
folder (peft's format) and its merge into a Hugging Face model folder (docs/lora.md).

The rules (targets, ranks, names) are :mod:`rlpad.lora.rules`'s; this module applies them with peft.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from rlpad.core.vision import vision_tower
from rlpad.lora.rules import LoraSpec, lora_spec, select_targets

__all__ = ["ADAPTER_PREFIX", "adapter_disabled", "apply_lora", "check_lora", "decoder_linear_names",
           "load_adapter_weights", "merge_adapter_folder", "merged_weight", "save_adapter"]

ADAPTER_PREFIX = "base_model.model."  # peft's saved adapter keys: base_model.model.<module>.lora_A.weight


def decoder_linear_names(model: nn.Module) -> list[str]:
    """Full names of the model's ``nn.Linear`` modules, the LM head (output embeddings) left out, and a VL
    model's vision tower too (LoRA adapts the language model; the tower stays frozen)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tower = vision_tower(model)
    skip = {id(m) for m in tower.modules()} if tower is not None else set()
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head and id(m) not in skip]


def _lora_config(spec: LoraSpec, targets: list[str]) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                      use_rslora=spec.use_rslora, task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, spec: LoraSpec, seed: int = 0) -> Any:
    """``peft.PeftModel`` over ``model`` (modified in place: its target linears become LoRA layers, every
    other parameter frozen). ``lora_A`` is drawn from a generator seeded with ``seed`` (peft's init;
    ``lora_B`` = 0, so the adapted model starts equal to ``model``). A meta-device model stays meta."""
    from peft import get_peft_model

    targets = select_targets(decoder_linear_names(model), spec.target_modules, spec.exclude_modules)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, _lora_config(spec, targets))


def adapter_disabled(peft_model: Any):
    """Context in which the model computes with its base weights only (peft's ``disable_adapter``)."""
    return peft_model.disable_adapter()


def _load_adapter_state(path: str) -> dict[str, torch.Tensor]:
    from peft.utils import load_peft_weights

    return load_peft_weights(path, device="cpu")


def load_adapter_weights(peft_model: Any, path: str) -> None:
    """Copy a saved adapter's tensors (peft folder ``path``) into ``peft_model``; ValueError when a tensor
    is missing or has another shape (an adapter of another architecture)."""
    from peft import set_peft_model_state_dict

    state = _load_adapter_state(path)
    own = {k: v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    want = {k.replace(".default.weight", ".weight"): v.shape for k, v in own.items()}
    bad = [k for k, shape in want.items() if k not in state or tuple(state[k].shape) != tuple(shape)]
    if bad:
        k = bad[0]
        got = tuple(state[k].shape) if k in state else "missing"
        raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={path!r} does not fit the model "
                         f"({len(bad)} of {len(want)} adapter tensors missing or of another shape, e.g. {k}: "
                         f"{got} vs {tuple(want[k])}): an adapter of another architecture?")
    set_peft_model_state_dict(peft_model, state)


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * lora_b @ lora_a`` (out, in), computed in fp32, returned in ``weight``'s dtype."""
    delta = (lora_b.float() @ lora_a.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


def save_adapter(path: str, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], spec: LoraSpec,
                 base_model: str | None = None) -> None:
    """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors) loadable by
    ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest``. ``adapters``: HF module name ->
    ``(lora_A (r, in), lora_B (out, r))``. Its ``target_modules`` are the adapted modules' full names, so
    loading it rebuilds exactly these modules (suffixes would also select those an ``exclude_modules`` left out)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = _lora_config(spec, sorted(adapters))
    config.base_model_name_or_path = base_model
    config.save_pretrained(path)
    tensors = {}
    for module, (a, b) in adapters.items():
        tensors[f"{ADAPTER_PREFIX}{module}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"{ADAPTER_PREFIX}{module}.lora_B.weight"] = b.detach().cpu().contiguous()
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))


def merge_adapter_folder(model_path: str, adapter_path: str, out: str, *, dtype: str = "float32") -> str:
    """Merge the adapter at ``adapter_path`` into the model at ``model_path`` (a folder or a registered
    source, e.g. ``tiny:qwen2``) and save a Hugging Face model folder (with the tokenizer) at ``out``."""
    from peft import PeftModel

    from rlpad.core.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(model_path, dtype=dtype, device="cpu", use_remove_padding=False, attn_implementation="sdpa")
    merged = PeftModel.from_pretrained(model, adapter_path).merge_and_unload()
    os.makedirs(out, exist_ok=True)
    merged.save_pretrained(out)
    try:
        load_tokenizer(model_path).save_pretrained(out)
    except (OSError, ValueError):
        pass  # no tokenizer next to the weights: the weights alone are still loadable
    return out


def check_lora(config: Any) -> None:
    """The model-dependent LoRA checks, before any worker starts (ValueError naming the key): the target
    modules match a linear of the actor's model and are not all excluded; a ``lora_adapter_path`` fits
    the model. Builds the model on the meta device (no weight read)."""
    mcfg = config.actor_rollout_ref.model
    spec = lora_spec(mcfg)
    if spec is None:
        return
    from rlpad.core.models import empty_causal_lm

    model = empty_causal_lm(mcfg.path, dtype=mcfg.dtype, trust_remote_code=mcfg.trust_remote_code,
                            attn_implementation="auto", use_remove_padding=mcfg.use_remove_padding)
    targets = select_targets(decoder_linear_names(model), spec.target_modules, spec.exclude_modules)
    if mcfg.lora_adapter_path is not None:
        modules = dict(model.named_modules())
        state = _load_adapter_state(mcfg.lora_adapter_path)
        for module in targets:
            linear = modules[module]
            a = state.get(f"{ADAPTER_PREFIX}{module}.lora_A.weight")
            b = state.get(f"{ADAPTER_PREFIX}{module}.lora_B.weight")
            if a is None or b is None or a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
                got = "missing" if a is None or b is None else f"A {tuple(a.shape)}, B {tuple(b.shape)}"
                raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={mcfg.lora_adapter_path!r} does not fit "
                                 f"{mcfg.path!r}: {module} ({linear.in_features} -> {linear.out_features}) gets {got}; "
                                 "an adapter of another architecture?")
