"""The ``model.attn_implementation`` choice: what ``auto`` picks, and what an explicit choice needs.

==================  =======================================================================
choice              runs
==================  =======================================================================
auto                flash_attention_2 when flash-attn imports and the device is CUDA, else rlpad_varlen
flash_attention_2   flash-attn's kernels through transformers (CUDA + the flash-attn package)
rlpad_varlen        rlpad's varlen attention (:mod:`rlpad.core.attention`); its kernel per call
                    comes from the one dispatch, :mod:`rlpad.core.attn_dispatch` (flash-attn or
                    torch's varlen kernel on CUDA in bf16/fp16, exact sdpa elsewhere)
sdpa                torch sdpa with a padding mask: the padded path only
==================  =======================================================================

:func:`resolve_attn_implementation` turns a choice into the name the model is loaded with, or
raises ValueError naming what is missing, before any weights are loaded;
:func:`require_varlen_attention` / :func:`set_varlen_attention` check or switch a loaded model.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from rlpad.config.choices import ATTN_IMPLEMENTATIONS as ATTN_CHOICES
from rlpad.core.attention import VARLEN_ATTENTION  # also registers rlpad_varlen with transformers
from rlpad.core.attn_dispatch import flash_attn_installed, torch_varlen_missing

__all__ = ["ATTN_CHOICES", "VARLEN_IMPLEMENTATIONS", "auto_attn_implementation", "require_varlen_attention",
           "resolve_attn_implementation", "set_varlen_attention"]

# The implementations that run a packed (1, nnz) row: they read the sequence bounds, not a mask.
VARLEN_IMPLEMENTATIONS = frozenset({VARLEN_ATTENTION, "flash_attention_2", "flash_attention_3"})


def auto_attn_implementation(device: torch.device | str) -> str:
    """What ``auto`` picks on ``device``: flash_attention_2 on CUDA with flash-attn, else rlpad_varlen."""
    return "flash_attention_2" if torch.device(device).type == "cuda" and flash_attn_installed() else VARLEN_ATTENTION


def resolve_attn_implementation(choice: str, device: torch.device | str, *, use_remove_padding: bool = True) -> str:
    """The transformers attention implementation for ``choice`` on ``device``; ValueError if it cannot run.

    The error names the missing piece: flash-attn or a CUDA device for ``flash_attention_2``, a
    varlen kernel (torch's or flash-attn's) for ``rlpad_varlen`` on CUDA, ``use_remove_padding=false``
    for ``sdpa``.
    """
    if choice not in ATTN_CHOICES:
        raise ValueError(f"attn_implementation={choice!r} is not valid; choose one of {', '.join(ATTN_CHOICES)}")
    cuda = torch.device(device).type == "cuda"
    if choice == "auto":
        return auto_attn_implementation(device)
    if choice == "flash_attention_2":
        if not flash_attn_installed():
            raise ValueError("attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                             "installed (pip install 'rlpad[flash]'); rlpad_varlen or auto run without it")
        if not cuda:
            raise ValueError(f"attn_implementation=flash_attention_2 needs a CUDA device, the model is on {device}; "
                             "use rlpad_varlen or auto")
    if choice == VARLEN_ATTENTION and cuda and not flash_attn_installed():
        missing = torch_varlen_missing()
        if missing is not None:
            raise ValueError(f"attn_implementation=rlpad_varlen on CUDA needs {missing}; upgrade torch, "
                             "or install flash-attn")
    if choice == "sdpa" and use_remove_padding:
        raise ValueError("attn_implementation=sdpa runs the padded path only: set "
                         "model.use_remove_padding=false, or choose auto / rlpad_varlen / flash_attention_2")
    return choice


def require_varlen_attention(model: PreTrainedModel, *, share_prompts: bool = False,
                             sequence_parallel: bool = False) -> None:
    """ValueError unless ``model`` runs a varlen attention (what a packed (1, nnz) row needs);
    ``share_prompts`` and ``sequence_parallel`` need ``rlpad_varlen`` itself (it reads the
    shared-prompt segments and exchanges the sequence shards)."""
    impl = model.config._attn_implementation
    if sequence_parallel and impl != VARLEN_ATTENTION:
        raise ValueError(
            f"sequence parallelism needs the {VARLEN_ATTENTION!r} attention (it exchanges the row's slices around "
            f"the kernel), the model uses {impl!r}; load it with attn_implementation='rlpad_varlen' or 'auto'"
        )
    if share_prompts and impl != VARLEN_ATTENTION:
        raise ValueError(
            f"share_prompts=True needs the {VARLEN_ATTENTION!r} attention (it runs varlen kernels on CUDA), the model "
            f"uses {impl!r}; load it with attn_implementation='rlpad_varlen' (model.attn_implementation) or call "
            f"rlpad.core.attn_choice.set_varlen_attention(model, share_prompts=True)"
        )
    if impl not in VARLEN_IMPLEMENTATIONS:
        raise ValueError(
            f"use_remove_padding=True needs a varlen attention ({sorted(VARLEN_IMPLEMENTATIONS)}), the model uses "
            f"{impl!r}; load it with rlpad.core.models.load_causal_lm or call rlpad.core.attn_choice.set_varlen_attention(model)"
        )


def set_varlen_attention(model: PreTrainedModel, *, share_prompts: bool = False) -> str:
    """Switch ``model`` to the varlen attention ``auto`` picks for its device (``rlpad_varlen`` with
    ``share_prompts``); returns the implementation name."""
    name = VARLEN_ATTENTION if share_prompts else auto_attn_implementation(next(model.parameters()).device)
    model.set_attn_implementation(name)
    return name
