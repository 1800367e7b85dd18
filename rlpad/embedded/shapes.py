"""The shapes of the embedded models, torch-free: the tiny architectures, their default sizes, the
warm-started model's dimensions, and the head counts they give (the config checks read these
without building a model; :mod:`rlpad.embedded.tiny` builds the models from them).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ARCHITECTURES", "TINY_DEFAULTS", "TINY_PREFIX", "VL_ARCHITECTURES", "VL_TOKEN_IDS", "VL_VISION",
           "WARM_START_DIMS", "tiny_arch", "tiny_heads"]

# A model path ``tiny:<arch>``: a random tiny model built in code (rlpad.embedded.tiny registers it
# with rlpad.core.models), never a folder.
TINY_PREFIX = "tiny:"

# Each architecture exercises a different attention detail. ``gqa``: key/value heads are half
# the query heads (grouped-query attention); otherwise one key/value head per query head.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    # GQA, qkv bias, tied embeddings.
    "qwen2": dict(model_type="qwen2", gqa=True, tie_word_embeddings=True),
    # Plain multi-head attention (no GQA), untied LM head.
    "llama": dict(model_type="llama", gqa=False, tie_word_embeddings=False),
    # GQA with a sliding window shorter than the test sequences.
    "mistral": dict(model_type="mistral", gqa=True, sliding_window=8, tie_word_embeddings=False),
    # GQA with per-head RMSNorm on queries and keys.
    "qwen3": dict(model_type="qwen3", gqa=True, tie_word_embeddings=True),
}

# The tiny vision-language models (``tiny:qwen2_5_vl``, ``tiny:qwen2_vl``; rlpad.embedded.tiny_vl builds
# them): the text side at TINY_DEFAULTS with two query heads of 32 sharing one key/value head, the
# multimodal rotary sections [t, h, w] = [4, 6, 6] (head_dim / 2 = 16 frequencies, each part non-zero).
# ``tied``: tie_word_embeddings (Qwen2-VL-2B ties, Qwen2.5-VL-7B does not).
VL_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(model_type="qwen2_5_vl", tied=False),
    "qwen2_vl": dict(model_type="qwen2_vl", tied=True),
}
# The vision tower: Qwen's patching (14 px patches, 2 frames per temporal patch, 2x2 merge: a 56x56
# image is a 4x4 patch grid, 4 tokens in the text), width 64 in 2 heads of 32, depth 2; Qwen2.5-VL's
# windows span 56 px (2x2 merged tokens), block 0 windowed, block 1 full.
VL_VISION: dict[str, Any] = dict(depth=2, width=64, num_heads=2, patch_size=14, temporal_patch_size=2,
                                 spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
                                 mrope_section=[4, 6, 6])
# The vision special tokens of the tiny VL models, after the character tokenizer's 80 ids (0-79);
# the VL tokenizer (rlpad.embedded.vl_tokenizer, vl-data) takes its other added tokens from 84 on.
VL_TOKEN_IDS: dict[str, int] = {"vision_start": 80, "vision_end": 81, "image_pad": 82, "video_pad": 83}

# tiny_config's default sizes (``tiny:<arch>`` model paths are built with exactly these).
TINY_DEFAULTS: dict[str, int] = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, head_dim=32,
                                     max_position_embeddings=2048)

# The embedded default model (~132k parameters, ``embedded:<task>`` paths): 2 layers, width 64, two
# heads of 32 sharing one key/value head. Wider (128) or deeper (3 layers) models learned no faster
# under GRPO in the tuning runs, and every step of a smaller model is cheaper. vLLM's Qwen2 takes
# the head size as hidden_size // num_attention_heads (it ignores head_dim), and its CPU attention
# accepts head sizes 32, 64, 80, 96, ...: keep hidden = heads * head_dim.
WARM_START_DIMS: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=32, intermediate_size=256)


def tiny_arch(path: str) -> str | None:
    """The architecture named by a ``tiny:<arch>`` model path; None for any other path."""
    return path[len(TINY_PREFIX):] if path.startswith(TINY_PREFIX) else None


def tiny_heads(arch: str, hidden_size: int = TINY_DEFAULTS["hidden_size"],
               head_dim: int = TINY_DEFAULTS["head_dim"]) -> tuple[int, int]:
    """(query heads, key/value heads) of tiny architecture ``arch``: ``hidden_size // head_dim``
    query heads (vLLM derives the head size that way), half as many key/value heads (at least one)
    for a GQA architecture."""
    if arch in VL_ARCHITECTURES:
        return hidden_size // head_dim, 1
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    heads = hidden_size // head_dim
    return heads, (max(1, heads // 2) if ARCHITECTURES[arch]["gqa"] else heads)
