"""Small random vision-language models, Qwen2.5-VL and Qwen2-VL, built locally (no model hub).

The configs are constructed directly from :data:`rlpad.embedded.shapes.VL_ARCHITECTURES` /
:data:`~rlpad.embedded.shapes.VL_VISION`: 2 text layers (width 64, two query heads of 32 sharing one
key/value head: a head size vLLM's CPU attention takes), a depth-2 vision tower whose output width is
the text width, multimodal rotary sections [4, 6, 6], and the vision special tokens of
:data:`~rlpad.embedded.shapes.VL_TOKEN_IDS`. :mod:`rlpad.embedded.tiny` serves them as
``tiny:qwen2_5_vl`` / ``tiny:qwen2_vl``. The language model gets the requested attention
(``rlpad_varlen`` by default), the vision tower its own (:func:`rlpad.core.vision.vision_attention`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel

from rlpad.core.vision import vl_attn_implementation
from rlpad.embedded.shapes import TINY_DEFAULTS, VL_ARCHITECTURES, VL_TOKEN_IDS, VL_VISION

__all__ = ["tiny_vl_config", "tiny_vl_model", "tiny_vl_reward_model"]

def tiny_vl_config(
    arch: str = "qwen2_5_vl",
    *,
    vocab_size: int = TINY_DEFAULTS["vocab_size"],
    hidden_size: int = TINY_DEFAULTS["hidden_size"],
    num_hidden_layers: int = TINY_DEFAULTS["num_hidden_layers"],
    head_dim: int = TINY_DEFAULTS["head_dim"],
    intermediate_size: int | None = None,
    max_position_embeddings: int = TINY_DEFAULTS["max_position_embeddings"],
    num_key_value_heads: int = 1,
    vision_depth: int = VL_VISION["depth"],
    vision_width: int = VL_VISION["width"],
    mrope_section: list[int] | None = None,
    vision: dict[str, Any] | None = None,
    **overrides: Any,
) -> PretrainedConfig:
    """The config of a tiny ``arch`` (one of :data:`~rlpad.embedded.shapes.VL_ARCHITECTURES`) VL model.

    Query heads: ``hidden_size // head_dim``. ``mrope_section`` (t, h, w frequencies) must sum to
    ``head_dim // 2``; the default scales [4, 6, 6] to the head size. ``vision``: vision-config keys
    over the tiny tower's (a benchmark's real shape). ``overrides`` go to the top-level config."""
    if arch not in VL_ARCHITECTURES:
        raise ValueError(f"unknown tiny VL architecture {arch!r}; choose one of {sorted(VL_ARCHITECTURES)}")
    if hidden_size % head_dim:
        raise ValueError(f"head_dim={head_dim} must divide hidden_size={hidden_size}")
    half = head_dim // 2
    if mrope_section is None:
        base = VL_VISION["mrope_section"]
        mrope_section = [half * s // sum(base) for s in base]
        mrope_section[0] += half - sum(mrope_section)
    if sum(mrope_section) != half or min(mrope_section) < 1:
        raise ValueError(f"mrope_section={mrope_section} must be 3 positive parts summing to head_dim // 2 = {half}")
    spec = VL_ARCHITECTURES[arch]
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=hidden_size // head_dim, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size or 4 * hidden_size, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, attention_dropout=0.0, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(mrope_section)},
        pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=spec["tied"],
    )  # fmt: skip
    heads = VL_VISION["num_heads"]
    common = dict(depth=vision_depth, num_heads=heads, in_channels=3, patch_size=VL_VISION["patch_size"],
                  temporal_patch_size=VL_VISION["temporal_patch_size"],
                  spatial_merge_size=VL_VISION["spatial_merge_size"])  # fmt: skip
    if arch == "qwen2_5_vl":
        vision_config = dict(common, hidden_size=vision_width, intermediate_size=2 * vision_width, out_hidden_size=hidden_size,
                      window_size=VL_VISION["window_size"], fullatt_block_indexes=list(VL_VISION["fullatt_block_indexes"]))
    else:  # Qwen2-VL: embed_dim is the tower's width, hidden_size its output (the text width)
        vision_config = dict(common, embed_dim=vision_width, hidden_size=hidden_size, mlp_ratio=2)
    vision_config.update(vision or {})
    fields = dict(
        text_config=text, vision_config=vision_config, tie_word_embeddings=spec["tied"],
        image_token_id=VL_TOKEN_IDS["image_pad"], video_token_id=VL_TOKEN_IDS["video_pad"],
        vision_start_token_id=VL_TOKEN_IDS["vision_start"], vision_end_token_id=VL_TOKEN_IDS["vision_end"],
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    fields.update(overrides)
    return AutoConfig.for_model(spec["model_type"], **fields)


def tiny_vl_model(
    arch: str = "qwen2_5_vl",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    device: torch.device | str = "cpu",
    **config_overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised ``*ForConditionalGeneration`` of ``arch`` (deterministic in ``seed``), on ``device``."""
    from rlpad.core.attention import VARLEN_ATTENTION  # registers the varlen attention

    config = tiny_vl_config(arch, **config_overrides)
    device = torch.device(device)
    attn = vl_attn_implementation(attn_implementation or VARLEN_ATTENTION)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def tiny_vl_reward_model(arch: str = "qwen2_5_vl", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                         attn_implementation: str | None = None, **config_overrides: Any) -> PreTrainedModel:
    """A tiny VL model with a reward head: :func:`tiny_vl_model` plus ``score = Linear(hidden, 1)``
    drawn N(0, 1) (transformers has no Qwen2(.5)-VL ``*ForSequenceClassification``; the core's reward
    path reads ``score`` and the VL backbone, :func:`rlpad.core.reward_model.compute_scores`)."""
    model = tiny_vl_model(arch, seed=seed, dtype=dtype, attn_implementation=attn_implementation, **config_overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    model.score = torch.nn.Linear(model.config.get_text_config().hidden_size, 1, bias=False, dtype=dtype)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen))
    return model.eval()
