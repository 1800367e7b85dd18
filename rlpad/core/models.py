"""Loading causal LMs (and their tokenizers) from a local path, with the right attention.

A path ``<prefix><name>`` whose prefix is registered (:func:`register_model_source`) is served by
code instead of a folder: the embedded side registers ``tiny:<arch>`` (rlpad.embedded.tiny), so
this module never names it. :func:`model_source` is the one test of such a path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                          PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase)

from rlpad.config.choices import DTYPES as DTYPE_NAMES
from rlpad.core.attention import VARLEN_ATTENTION, guard_padded_sdpa
from rlpad.core.attn_choice import resolve_attn_implementation
from rlpad.core.vision import is_vl, is_vl_config, vl_attn_implementation

__all__ = ["DTYPES", "MODEL_SOURCES", "VISION_LOGIT_BIAS", "ModelSource", "empty_causal_lm", "empty_pretrained", "load_causal_lm", "load_pretrained", "load_tokenizer",
           "mask_vision_logits", "model_config", "model_source", "parse_dtype", "register_model_source", "require_folder"]

DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}  # the config's names


@dataclass(frozen=True)
class ModelSource:
    """Models built by code for the paths ``<prefix><name>``; each callable takes the ``name``."""

    config: Callable[[str], PretrainedConfig]  # name -> the model's config
    model: Callable[[str, torch.dtype, str], PreTrainedModel]  # (name, dtype, attn implementation) -> model on CPU
    tokenizer: Callable[[str], PreTrainedTokenizerBase]  # name -> its tokenizer (left padding)
    image_processor: Callable[[str], Any] | None = None  # name -> its image processor (None: a text model's)


MODEL_SOURCES: dict[str, ModelSource] = {}  # path prefix (ending in ":") -> its source


def register_model_source(prefix: str, source: ModelSource) -> None:
    """Serve the paths ``<prefix><name>`` from ``source`` (``prefix`` ends in ``:``)."""
    if not prefix.endswith(":") or len(prefix) < 2:
        raise ValueError(f"a model source prefix ends in ':' after a name, got {prefix!r}")
    MODEL_SOURCES[prefix] = source


def model_source(path: str) -> tuple[ModelSource, str] | None:
    """``(source, name)`` when a registered source serves ``path``, else None (a folder path)."""
    for prefix, source in MODEL_SOURCES.items():
        if path.startswith(prefix):
            return source, path[len(prefix):]
    return None


def _not_a_folder(what: str, path: str) -> ValueError:
    sources = ", ".join(f"{p}<name>" for p in MODEL_SOURCES) or "none registered"
    return ValueError(f"{what} path {path!r} is not a local directory (models load from disk, not a hub; "
                      f"sources built in code: {sources})")


def model_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of the model at ``path`` (a folder's config.json, or its registered source's)."""
    found = model_source(path)
    if found is not None:
        return found[0].config(found[1])
    if not os.path.isdir(path):
        raise _not_a_folder("model", path)
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


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
    """A causal LM from a local checkpoint ``path`` or a registered source's path (``tiny:<arch>``); a
    Qwen2(.5)-VL folder loads as its ``*ForConditionalGeneration`` (no ``trust_remote_code`` needed).

    ``attn_device``: where the model will run, when it is loaded elsewhere first (default ``device``).

    ``attn_implementation`` (see :mod:`rlpad.core.attn_choice`): ``auto`` gives a varlen-capable
    attention (flash_attention_2 on CUDA with flash-attn, rlpad's own ``rlpad_varlen`` elsewhere),
    which serves both the padded and the packed path; an explicit choice that cannot run here,
    or ``sdpa`` with ``use_remove_padding``, raises ValueError before anything is loaded.
    ``share_prompts`` and ``sequence_parallel`` need ``rlpad_varlen`` (``auto`` picks it on every device).
    """
    torch_dtype = parse_dtype(dtype)
    attn = _attn(attn_implementation, attn_device or device, use_remove_padding, share_prompts, sequence_parallel)
    found = model_source(path)
    if found is not None:
        return _guarded(found[0].model(found[1], torch_dtype, attn).to(device))
    if not os.path.isdir(path):
        raise _not_a_folder("model", path)
    auto, attn = _auto_class(model_config(path, trust_remote_code), attn)
    model = auto.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn, trust_remote_code=trust_remote_code)
    return _guarded(model.to(device))


def _auto_class(config: PretrainedConfig, attn: str) -> tuple[type, str | dict[str, str]]:
    """The auto class and attention of a causal LM: a VL model (Qwen2(.5)-VL) is a
    ``*ForConditionalGeneration`` whose vision tower gets its own attention (rlpad.core.vision)."""
    if is_vl_config(config):
        return AutoModelForImageTextToText, vl_attn_implementation(attn)
    return AutoModelForCausalLM, attn


def _guarded(model: PreTrainedModel) -> PreTrainedModel:
    """``model``, its padded sdpa masks guarded against fully masked query rows where it runs
    transformers' own ``sdpa`` (``rlpad_varlen``'s padded branch does it itself): never NaN in bf16
    whichever kernel sdpa picks (:func:`rlpad.core.attention.guard_padded_sdpa`); a VL model's vision
    tokens masked out of its logits (:func:`mask_vision_logits`)."""
    if model.config._attn_implementation == "sdpa":
        guard_padded_sdpa(model)
    if is_vl(model):
        mask_vision_logits(model)
    return model


VISION_LOGIT_BIAS = -1.0e4  # exp(-1e4 + any logit) is 0 in every float type: probability exactly 0


def mask_vision_logits(model: PreTrainedModel) -> PreTrainedModel:
    """The policy of a VL model never emits its vision special tokens (image / video pad, vision start /
    end): a non-persistent LM-head bias of :data:`VISION_LOGIT_BIAS` at their ids (0 elsewhere) gives them
    probability 0 in ``generate`` and in every head of the scoring core (which reads ``lm_head.bias``),
    so the rollout samples from the distribution the actor scores. Not a parameter: no gradient, never
    saved or synced. A head that has a bias of its own is refused."""
    head, config = model.get_output_embeddings(), model.config
    if isinstance(getattr(head, "bias", None), torch.nn.Parameter):
        raise ValueError("the VL model's LM head has a bias of its own; rlpad masks the vision tokens with one")
    ids = sorted({getattr(config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                               "vision_end_token_id") if getattr(config, k, None) is not None})
    bias = torch.zeros(head.weight.shape[0], dtype=head.weight.dtype, device=head.weight.device)
    if bias.device.type != "meta":
        bias[ids] = VISION_LOGIT_BIAS
    if "bias" in head._parameters:
        del head._parameters["bias"]
    head.register_buffer("bias", bias, persistent=False)
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
    config = model_config(path, trust_remote_code)
    auto, attn = _auto_class(config, attn)
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch_dtype, attn_implementation=attn, trust_remote_code=trust_remote_code)
    return _guarded(model.eval())


def require_folder(what: str, path: str) -> None:
    """ValueError unless ``path`` is a local directory (``what`` names the model in the message)."""
    if not os.path.isdir(path):
        raise _not_a_folder(what, path)


def load_pretrained(auto_class: type, path: str, *, dtype: str | torch.dtype = "float32",
                    device: str | torch.device = "cpu", trust_remote_code: bool = False,
                    attn_implementation: str = "auto", use_remove_padding: bool = True,
                    attn_device: str | torch.device | None = None) -> PreTrainedModel:
    """A model of ``auto_class`` (say ``AutoModelForSequenceClassification``) from the folder ``path``,
    with the attention :func:`load_causal_lm` would pick for ``attn_device`` (default ``device``), in eval mode."""
    require_folder("model", path)
    attn = _attn(attn_implementation, attn_device or device, use_remove_padding, False)
    model = auto_class.from_pretrained(path, dtype=parse_dtype(dtype), attn_implementation=attn,
                                       trust_remote_code=trust_remote_code)
    return _guarded(model.to(device)).eval()


def empty_pretrained(auto_class: type, path: str, *, dtype: str | torch.dtype = "float32",
                     attn_device: str | torch.device = "cpu", trust_remote_code: bool = False,
                     attn_implementation: str = "auto", use_remove_padding: bool = True) -> PreTrainedModel:
    """The model :func:`load_pretrained` would return, built on the meta device from the folder's config."""
    require_folder("model", path)
    attn = _attn(attn_implementation, attn_device, use_remove_padding, False)
    config = model_config(path, trust_remote_code)
    with torch.device("meta"):
        model = auto_class.from_config(config, dtype=parse_dtype(dtype), attn_implementation=attn,
                                       trust_remote_code=trust_remote_code)
    return _guarded(model.eval())


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved at ``path`` (or its registered source's), left-padding."""
    found = model_source(path)
    if found is not None:
        return found[0].tokenizer(found[1])
    if not os.path.isdir(path):
        raise _not_a_folder("tokenizer", path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
