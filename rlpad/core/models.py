"""Loading causal LMs (and their tokenizers) from a local path, with the right attention."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlpad.core.attention import VARLEN_ATTENTION, varlen_implementation

__all__ = ["DTYPES", "load_causal_lm", "load_tokenizer", "parse_dtype"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError naming the choices otherwise."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_causal_lm(
    path: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    share_prompts: bool = False,
) -> PreTrainedModel:
    """A causal LM from a local checkpoint ``path`` or ``tiny:<arch>`` (random, seed 0).

    The model always gets a varlen-capable attention (flash_attention_2 on CUDA with flash-attn,
    rlpad's own ``rlpad_varlen`` elsewhere), which serves both the padded and the packed path;
    ``share_prompts`` picks ``rlpad_varlen`` on every device (the shared-prompt forward needs it).
    """
    torch_dtype = parse_dtype(dtype)
    attn = VARLEN_ATTENTION if share_prompts else varlen_implementation(device)
    if path.startswith("tiny:"):
        from rlpad.embedded.tiny import tiny_model

        return tiny_model(path.split(":", 1)[1], dtype=torch_dtype, attn_implementation=attn).to(device)
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a local directory (models load from disk, not a hub)")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
    )
    return model.to(device)


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
