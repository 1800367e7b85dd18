"""The one table of benchmark model shapes; every benchmark and measurement script names a row.

Torch-light: importing this module imports neither torch nor transformers (:func:`bench_config`
and :func:`bench_model` do, when called). Each row is ``arch`` (a key of
:data:`rlpad.embedded.tiny.ARCHITECTURES`) plus the :func:`rlpad.embedded.tiny.tiny_config`
arguments of a random model of that shape.

* ``tiny`` / ``tiny-llama``: 0.6M-parameter Qwen2 (GQA, tied embeddings), 0.8M Llama (MHA, untied);
* ``40m``: 45.6M parameters, Qwen2 layout, untied LM head;
* ``160m``: the ``40m`` shape with hidden size, layers, heads and intermediate size all doubled,
  168.3M parameters (the one 160m shape: ``rlpad bench sync`` measured it; ``rlpad.bench.sharded_init``
  used to build a 162M variant with intermediate 2560);
* ``qwen2.5-0.5b``: Qwen2.5-0.5B's shape (24 layers, 14 query / 2 key-value heads, vocab 151936,
  tied), the GPU benchmarks' model;
* ``7b-layers``: 4 decoder layers of Qwen2.5-7B's shape (hidden 3584, 28 query / 4 key-value heads of
  128, intermediate 18944, vocab 152064, untied LM head), 2.0B parameters: a 7B model's per-token
  kernels (its GEMM sizes, attention heads, LM head) on one GPU without its 28 layers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_SHAPES", "bench_config", "bench_model", "model_shape"]

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="qwen2", vocab_size=1024, hidden_size=128, num_hidden_layers=2, head_dim=32,
                 num_attention_heads=4, num_key_value_heads=2),
    "tiny-llama": dict(arch="llama", vocab_size=1024, hidden_size=128, num_hidden_layers=2, head_dim=32),
    "40m": dict(arch="qwen2", vocab_size=32000, hidden_size=512, num_hidden_layers=4, head_dim=64,
                num_attention_heads=8, num_key_value_heads=8, intermediate_size=1408, tie_word_embeddings=False),
    "160m": dict(arch="qwen2", vocab_size=32000, hidden_size=1024, num_hidden_layers=8, head_dim=64,
                 num_attention_heads=16, num_key_value_heads=16, intermediate_size=2816, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24, head_dim=64,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                         tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1_000_000.0),
    "7b-layers": dict(arch="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=4, head_dim=128,
                      num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                      tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1_000_000.0),
}


def model_shape(name: str) -> tuple[str, dict[str, Any]]:
    """``(arch, tiny_config arguments)`` of row ``name``; ValueError naming the rows when unknown."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown benchmark model {name!r}; choose one of {sorted(MODEL_SHAPES)}")
    spec = dict(MODEL_SHAPES[name])
    return spec.pop("arch"), spec


def bench_config(name: str):
    """The transformers config of row ``name`` (:func:`rlpad.embedded.tiny.tiny_config`)."""
    from rlpad.embedded.tiny import tiny_config

    arch, spec = model_shape(name)
    return tiny_config(arch, **spec)


def bench_model(name: str, *, seed: int = 0, **kwargs: Any):
    """A random model of row ``name`` (:func:`rlpad.embedded.tiny.tiny_model`; ``kwargs``: dtype,
    attn_implementation, device)."""
    from rlpad.embedded.tiny import tiny_model

    arch, spec = model_shape(name)
    return tiny_model(arch, seed=seed, **spec, **kwargs)
