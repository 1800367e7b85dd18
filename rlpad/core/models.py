"""Loading causal LMs (and their tokenizers) from a local path, with the right attention."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlpad.config import DTYPES as DTYPE_NAMES
from rlpad.core.attention import VARLEN_ATTENTION, guard_padded_sdpa
from rlpad.core.attn_choice import resolve_attn_implementation

__all__ = ["DTYPES", "empty_causal_lm", "load_causal_lm", "load_tokenizer", "parse_dtype"]

DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}  # the config's names


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError naming the choices otherwise."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def _attn(choice: str, device, use_remove_padding: bool, share_prompts: bool, sequence_parallel: bool = False) -> str:
    """The attention implementation: :func:`resolve_attn_implementation`, or ``rlpad_varlen`` for
    ``share_prompts`` and ``sequence_parallel`` (ValueError for another explicit choice)."""
    for needs, what in ((share_prompts, "share_prompts"), (sequence_parallel, "sequence parallelism")):
        if needs and choice not in ("auto", VARLEN_ATTENTION):
            raise ValueError(f"{what} needs attn_implementation 'auto' or {VARLEN_ATTENTION!r}, got {choice!r}")
    if share_prompts or sequence_parallel:
        choice = VARLEN_ATTENTION
    return resolve_attn_implementation(choice, device, use_remove_padding=use_remove_padding)


def load_causal_lm(
    path: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str = "auto",
    use_remove_padding: bool = True,
    attn_device: str | torch.device | None = None,
    share_prompts: bool = False,
    sequence_parallel: bool = False,
) -> PreTrainedModel:
    """A causal LM from a local checkpoint ``path`` or ``tiny:<arch>`` (random, seed 0).

    ``attn_device``: where the model will run, when it is loaded elsewhere first (default ``device``).

    ``attn_implementation`` (see :mod:`rlpad.core.attn_choice`): ``auto`` gives a varlen-capable
    attention (flash_attention_2 on CUDA with flash-attn, rlpad's own ``rlpad_varlen`` elsewhere),
    which serves both the padded and the packed path; an explicit choice that cannot run here,
    or ``sdpa`` with ``use_remove_padding``, raises ValueError before anything is loaded.
    ``share_prompts`` and ``sequence_parallel`` need ``rlpad_varlen`` (``auto`` picks it on every device).
    """
    torch_dtype = parse_dtype(dtype)
    attn = _attn(attn_implementation, attn_device or device, use_remove_padding, share_prompts, sequence_parallel)
    if path.startswith("tiny:"):
        from rlpad.embedded.tiny import tiny_model

        return _guarded(tiny_model(path.split(":", 1)[1], dtype=torch_dtype, attn_implementation=attn).to(device))
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a local directory (models load from disk, not a hub)")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
    )
    return _guarded(model.to(device))


def _guarded(model: PreTrainedModel) -> PreTrainedModel:
    """``model``, its padded sdpa masks guarded against fully masked query rows where it runs
    transformers' own ``sdpa`` (``rlpad_varlen``'s padded branch does it itself): never NaN in bf16
    whichever kernel sdpa picks (:func:`rlpad.core.attention.guard_padded_sdpa`)."""
    if model.config._attn_implementation == "sdpa":
        guard_padded_sdpa(model)
    return model


def empty_causal_lm(
    path: str,
    *,
    dtype: str | torch.dtype = "float32",
    attn_device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str = "auto",
    use_remove_padding: bool = True,
    share_prompts: bool = False,
    sequence_parallel: bool = False,
) -> PreTrainedModel:
    """The model :func:`load_causal_lm` would return, built on the meta device from the config alone.

    No weight is read or allocated (buffers are meta too); a sharded loader fills it in. The
    attention implementation is chosen for ``attn_device``, where the weights will live.
    """
    torch_dtype = parse_dtype(dtype)
    attn = _attn(attn_implementation, attn_device, use_remove_padding, share_prompts, sequence_parallel)
    if path.startswith("tiny:"):
        from rlpad.embedded.tiny import tiny_config

        config = tiny_config(path.split(":", 1)[1])
    elif os.path.isdir(path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    else:
        raise ValueError(f"model path {path!r} is not a local directory (models load from disk, not a hub)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype, attn_implementation=attn,
            trust_remote_code=trust_remote_code,
        )
    return _guarded(model.eval())


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved at ``path`` (or rlpad's character tokenizer for ``tiny:<arch>``), left-padding."""
    if path.startswith("tiny:"):
        from rlpad.embedded.tiny import build_tokenizer

        return build_tokenizer()
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer path {path!r} is not a local directory")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
