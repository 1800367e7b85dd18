"""Hugging Face model folders: what goes in beside the weights, and publishing a folder atomically.

A folder holds ``config.json`` (its ``architectures`` and ``dtype`` those of the weights written),
``generation_config.json``, the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, the chat template)
and the weights (:mod:`rlpad.export.safetensors_stream`): what ``AutoModelForCausalLM.from_pretrained``
and ``vllm serve`` take. It is written into ``<final>.tmp`` and renamed when complete, so a crash
mid-write leaves a ``.tmp`` folder and never a half folder under the final name; ``latest`` is a link
replaced in one ``os.replace``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["LORA_ADAPTER_DIR", "MODEL_FILES_DIR", "copy_model_files", "model_files", "point_latest", "publish", "staged", "staging",
           "write_model_files"]

MODEL_FILES_DIR = "huggingface"  # a checkpoint role folder's config, generation config and tokenizer (verl's name)
LORA_ADAPTER_DIR = "lora_adapter"  # a LoRA actor's adapter in peft's format, in its checkpoint and its HF folder
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt")
CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"


def write_model_files(folder: str, config: Any, *, dtype: torch.dtype, architecture: str | None = None,
                      tokenizer: Any = None, generation_config: Any = None, generates: bool = True,
                      **extra: Any) -> None:
    """``config.json`` (a copy of ``config`` with ``dtype``, ``architectures`` = [``architecture``] when given,
    and the ``extra`` attributes), ``generation_config.json`` (``generation_config``, else the one the config
    implies; none when not ``generates``) and ``tokenizer``'s files (with its chat template) into ``folder``."""
    from transformers import GenerationConfig

    os.makedirs(folder, exist_ok=True)
    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's config is left as it was
    config.dtype = dtype
    if architecture is not None:
        config.architectures = [architecture]
    for key, value in extra.items():
        setattr(config, key, value)
    config.save_pretrained(folder)
    if generates:
        gen = generation_config if generation_config is not None else GenerationConfig.from_model_config(config)
        gen.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def model_files(folder: str) -> list[str]:
    """The names of the files in ``folder`` that are not weights (config, generation config, tokenizer)."""
    return sorted(f for f in os.listdir(folder)
                  if os.path.isfile(os.path.join(folder, f)) and not f.endswith(WEIGHT_SUFFIXES))


def copy_model_files(source: str, folder: str) -> None:
    """Copy the non-weight files of ``source`` (a checkpoint's ``huggingface/``) into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for name in model_files(source):
        shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))


def staging(final: str) -> str:
    """A fresh, empty ``<final>.tmp`` folder (a leftover of a crash is removed)."""
    path = f"{final.rstrip(os.sep)}.tmp"
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def publish(staged: str, final: str) -> str:
    """Rename the complete folder ``staged`` to ``final`` (an older ``final`` is removed first; an empty
    folder is replaced by the rename itself)."""
    if os.path.isdir(final) and os.listdir(final):
        shutil.rmtree(final)
    os.replace(staged, final)
    return final


@contextmanager
def staged(final: str) -> Iterator[str]:
    """A staging folder for ``final``, published when the block ends without an exception; removed when it
    raises (the exception goes on)."""
    path = staging(final)
    try:
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    publish(path, final)


def point_latest(parent: str, name: str) -> str:
    """Make ``<parent>/latest`` a relative link to ``name`` (a folder in ``parent``), replaced atomically."""
    link, tmp = os.path.join(parent, "latest"), os.path.join(parent, f".latest.tmp-{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, link)
    return link
