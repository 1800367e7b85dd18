"""Small random causal LMs and a character-level tokenizer, built locally (no model hub).

Used by the tests, ``rlpad check``, the benchmarks and the embedded default recipe. Importing this
module registers the ``tiny:<arch>`` model paths with :mod:`rlpad.core.models` (random, seed 0).
Head sizes are multiples of 32 so the same models run in vLLM's CPU attention.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast)

from rlpad.core.models import ModelSource, register_model_source
from rlpad.embedded.shapes import ARCHITECTURES, TINY_DEFAULTS, TINY_PREFIX, tiny_heads

__all__ = ["ARCHITECTURES", "CHARSET", "CODE_CHARSET", "build_tokenizer", "tiny_config", "tiny_model", "tiny_reward_model"]

CHARSET = "0123456789+-*/=?#:.,()[] abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# every printable ASCII character, newline and tab: what programs are written in (rlpad.embedded.toy_code)
CODE_CHARSET = CHARSET + "".join(sorted(set(map(chr, range(32, 127))) - set(CHARSET))) + "\n\t"
SPECIAL_TOKENS = {"pad": "<|pad|>", "eos": "<|endoftext|>", "unk": "<|unk|>"}


def tiny_config(
    arch: str = "qwen2",
    *,
    vocab_size: int = TINY_DEFAULTS["vocab_size"],
    hidden_size: int = TINY_DEFAULTS["hidden_size"],
    num_hidden_layers: int = TINY_DEFAULTS["num_hidden_layers"],
    intermediate_size: int | None = None,
    head_dim: int = TINY_DEFAULTS["head_dim"],
    max_position_embeddings: int = TINY_DEFAULTS["max_position_embeddings"],
    **overrides: Any,
) -> PretrainedConfig:
    """A small config of architecture ``arch`` (one of :data:`ARCHITECTURES`).

    Query heads = ``hidden_size // head_dim`` (vLLM derives the head size that way), so
    ``head_dim`` must divide ``hidden_size``; explicit head counts in ``overrides`` win.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    if hidden_size % head_dim:
        raise ValueError(f"head_dim={head_dim} must divide hidden_size={hidden_size}")
    fields = dict(ARCHITECTURES[arch])
    model_type = fields.pop("model_type")
    del fields["gqa"]
    fields["num_attention_heads"], fields["num_key_value_heads"] = tiny_heads(arch, hidden_size, head_dim)
    fields.update(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        intermediate_size=intermediate_size or 4 * hidden_size,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        attention_dropout=0.0,
        rms_norm_eps=1e-6,
    )
    if arch in ("qwen2", "qwen3"):
        fields.setdefault("use_sliding_window", False)
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def tiny_model(
    arch: str = "qwen2",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    device: torch.device | str = "cpu",
    **config_overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised causal LM of architecture ``arch`` (deterministic in ``seed``), built on ``device``."""
    from rlpad.core.attention import VARLEN_ATTENTION  # registers the varlen attention

    config = tiny_config(arch, **config_overrides)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation or VARLEN_ATTENTION
        )
    return model.eval()


def tiny_reward_model(
    arch: str = "qwen2",
    *,
    head: str = "sequence",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised reward model of architecture ``arch``: ``*ForSequenceClassification``
    (``head="sequence"``) or ``*ForTokenClassification`` (``head="token"``), ``num_labels=1``, on the CPU.
    The score head is drawn N(0, 1) (not transformers' 0.02) so scores differ visibly between sequences."""
    from rlpad.core.attention import VARLEN_ATTENTION  # registers the varlen attention

    heads = {"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification}
    if head not in heads:
        raise ValueError(f"head must be one of {sorted(heads)}, got {head!r}")
    config = tiny_config(arch, **{"num_labels": 1, **config_overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = heads[head].from_config(config, dtype=dtype, attn_implementation=attn_implementation or VARLEN_ATTENTION)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 1.0)
    return model.eval()


def build_tokenizer(save_dir: str | os.PathLike | None = None, charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``charset`` (:data:`CHARSET`; :data:`CODE_CHARSET` for programs) with
    pad/eos/unk and a chat template.

    Ids: 0 pad, 1 eos, 2 unk, then one id per character (a charset extending another keeps its ids). Saved with ``save_pretrained`` when
    ``save_dir`` is given, which vLLM and ``AutoTokenizer`` load offline.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {SPECIAL_TOKENS["pad"]: 0, SPECIAL_TOKENS["eos"]: 1, SPECIAL_TOKENS["unk"]: 2}
    for ch in charset:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk"]))
    # one piece per character (Oniguruma's "(?m)": a newline too, when the charset has one)
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)." if "\n" in charset else "."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_TOKENS["pad"],
        eos_token=SPECIAL_TOKENS["eos"],
        unk_token=SPECIAL_TOKENS["unk"],
        padding_side="left",
        model_max_length=2048,
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


register_model_source(TINY_PREFIX, ModelSource(
    config=tiny_config,
    model=lambda arch, dtype, attn: tiny_model(arch, dtype=dtype, attn_implementation=attn),
    tokenizer=lambda arch: build_tokenizer(),
))
