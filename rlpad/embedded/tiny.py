"""Small random causal LMs and a character-level tokenizer, built locally (no model hub).

Used by the tests, ``rlpad check``, the benchmarks and the embedded default recipe. Importing this
module registers the ``tiny:<arch>`` model paths with :mod:`rlpad.core.models` (random, seed 0).
Head sizes are multiples of 32 so the same models run in vLLM's CPU attention. The vision-language
architectures (``tiny:qwen2_5_vl``, ``tiny:qwen2_vl``) are built by :mod:`rlpad.embedded.tiny_vl`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast)

from rlpad.core.models import ModelSource, register_model_source
from rlpad.embedded.shapes import ARCHITECTURES, TINY_DEFAULTS, TINY_PREFIX, VL_ARCHITECTURES, VL_TOKEN_IDS, tiny_heads

__all__ = ["ARCHITECTURES", "CHARSET", "CODE_CHARSET", "VISION_TOKENS", "VL_CHAT_TEMPLATE", "build_tokenizer", "tiny_config",
           "tiny_model", "tiny_reward_model"]

CHARSET = "0123456789+-*/=?#:.,()[] abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# every printable ASCII character, newline and tab: what programs are written in (rlpad.embedded.toy_code)
CODE_CHARSET = CHARSET + "".join(sorted(set(map(chr, range(32, 127))) - set(CHARSET))) + "\n\t"
SPECIAL_TOKENS = {"pad": "<|pad|>", "eos": "<|endoftext|>", "unk": "<|unk|>"}
# Qwen's vision special tokens (the VL tokenizer's, at the ids of shapes.VL_TOKEN_IDS), by their key there.
VISION_TOKENS = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
                 "image_pad": "<|image_pad|>", "video_pad": "<|video_pad|>"}
# The VL chat template: a message's content is a string or a list of {"type": "text", "text"} /
# {"type": "image"} parts; an image part becomes <|vision_start|><|image_pad|><|vision_end|> (the
# processor expands the pad to the image's tokens, rlpad.multimodal.processor).
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    + VISION_TOKENS["vision_start"] + VISION_TOKENS["image_pad"] + VISION_TOKENS["vision_end"]
    + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


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
    ``head_dim`` must divide ``hidden_size``; explicit head counts in ``overrides`` win. A VL
    architecture's config comes from :func:`rlpad.embedded.tiny_vl.tiny_vl_config`.
    """
    if arch in VL_ARCHITECTURES:
        from rlpad.embedded.tiny_vl import tiny_vl_config

        return tiny_vl_config(arch, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                              intermediate_size=intermediate_size, head_dim=head_dim,
                              max_position_embeddings=max_position_embeddings, **overrides)  # fmt: skip
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES) + sorted(VL_ARCHITECTURES)}")
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
    """A randomly initialised causal LM of architecture ``arch`` (deterministic in ``seed``), built on ``device``
    (a VL architecture: its ``*ForConditionalGeneration``, :func:`rlpad.embedded.tiny_vl.tiny_vl_model`)."""
    from rlpad.core.attention import VARLEN_ATTENTION  # registers the varlen attention

    if arch in VL_ARCHITECTURES:
        from rlpad.embedded.tiny_vl import tiny_vl_model

        return tiny_vl_model(arch, seed=seed, dtype=dtype, attn_implementation=attn_implementation, device=device,
                             **config_overrides)  # fmt: skip

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


def build_tokenizer(save_dir: str | os.PathLike | None = None, charset: str = CHARSET, *,
                    vision: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``charset`` (:data:`CHARSET`; :data:`CODE_CHARSET` for programs) with
    pad/eos/unk and a chat template.

    Ids: 0 pad, 1 eos, 2 unk, then one id per character (a charset extending another keeps its ids);
    ``vision``: then the vision special tokens (:data:`VISION_TOKENS` at the ids of
    :data:`rlpad.embedded.shapes.VL_TOKEN_IDS`) and :data:`VL_CHAT_TEMPLATE`. Saved with ``save_pretrained``
    when ``save_dir`` is given, which vLLM and ``AutoTokenizer`` load offline.
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
    if vision:
        order = sorted(VISION_TOKENS, key=VL_TOKEN_IDS.__getitem__)
        tokenizer.add_special_tokens({"additional_special_tokens": [VISION_TOKENS[k] for k in order]})
        got = {k: tokenizer.convert_tokens_to_ids(VISION_TOKENS[k]) for k in order}
        if got != VL_TOKEN_IDS:
            raise RuntimeError(f"the vision tokens landed at {got}, the tiny VL models expect {VL_TOKEN_IDS}")
        tokenizer.chat_template = VL_CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def _tiny_image_processor(arch: str) -> Any:
    """The image processor of a tiny VL architecture (None for a text one)."""
    if arch not in VL_ARCHITECTURES:
        return None
    from rlpad.embedded.vl_processor import build_image_processor

    return build_image_processor()


register_model_source(TINY_PREFIX, ModelSource(
    config=tiny_config,
    model=lambda arch, dtype, attn: tiny_model(arch, dtype=dtype, attn_implementation=attn),
    tokenizer=lambda arch: build_tokenizer(vision=arch in VL_ARCHITECTURES),
    image_processor=_tiny_image_processor,
))
