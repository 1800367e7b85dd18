"""The ``model.attn_implementation`` choice: what ``auto`` picks, and what an explicit choice needs.

==================  =======================================================================
choice              runs
==================  =======================================================================
auto                flash_attention_2 when flash-attn imports and the device is CUDA, else rlpad_varlen
flash_attention_2   flash-attn's kernels through transformers (CUDA + the flash-attn package)
rlpad_varlen        rlpad's varlen attention: torch's varlen kernel on CUDA (needs a torch with
                    ``torch.nn.attention.varlen.varlen_attn``), per-sequence sdpa on CPU
sdpa                torch sdpa with a padding mask: the padded path only
==================  =======================================================================

:func:`resolve_attn_implementation` turns a choice into the name the model is loaded with, or
raises ValueError naming what is missing, before any weights are loaded.
"""

from __future__ import annotations

import importlib.util

import torch

from rlpad.config import ATTN_IMPLEMENTATIONS as ATTN_CHOICES
from rlpad.core.attention import VARLEN_ATTENTION, torch_varlen_missing

__all__ = ["ATTN_CHOICES", "resolve_attn_implementation"]


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attn_implementation(choice: str, device: torch.device | str, *, use_remove_padding: bool = True) -> str:
    """The transformers attention implementation for ``choice`` on ``device``; ValueError if it cannot run.

    The error names the missing piece: flash-attn or a CUDA device for ``flash_attention_2``, a
    torch with the varlen kernel for ``rlpad_varlen`` on CUDA, ``use_remove_padding=false`` for ``sdpa``.
    """
    if choice not in ATTN_CHOICES:
        raise ValueError(f"attn_implementation={choice!r} is not valid; choose one of {', '.join(ATTN_CHOICES)}")
    cuda = torch.device(device).type == "cuda"
    if choice == "auto":
        return "flash_attention_2" if cuda and _flash_attn_installed() else VARLEN_ATTENTION
    if choice == "flash_attention_2":
        if not _flash_attn_installed():
            raise ValueError("attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                             "installed (pip install 'rlpad[flash]'); rlpad_varlen or auto run without it")
        if not cuda:
            raise ValueError(f"attn_implementation=flash_attention_2 needs a CUDA device, the model is on {device}; "
                             "use rlpad_varlen or auto")
    if choice == VARLEN_ATTENTION and cuda:
        missing = torch_varlen_missing()
        if missing is not None:
            raise ValueError(f"attn_implementation=rlpad_varlen on CUDA needs {missing}; upgrade torch, "
                             "or use flash_attention_2 with flash-attn installed")
    if choice == "sdpa" and use_remove_padding:
        raise ValueError("attn_implementation=sdpa runs the padded path only: set "
                         "model.use_remove_padding=false, or choose auto / rlpad_varlen / flash_attention_2")
    return choice
