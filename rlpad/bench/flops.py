"""FLOP model of a log-prob forward, to put measured speedups next to the ideal one.

Matmul FLOPs only (2 per multiply-add). Attention counts causal (query, key) pairs, i >= j, for
the padded and the packed forward alike, so their ratio is the work padding adds, nothing else.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

__all__ = ["logprob_flops", "padded_and_valid_flops", "shared_prompt_flops"]


def _layer_linear_params(config: PretrainedConfig) -> int:
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    return attn + mlp


def logprob_flops(config: PretrainedConfig, seq_lengths: list[int], scored_tokens: int) -> dict[str, float]:
    """Forward FLOPs of the decoder over sequences of ``seq_lengths`` plus the LM head on ``scored_tokens``."""
    pairs = sum(n * (n + 1) // 2 for n in seq_lengths)
    return _flops(config, sum(seq_lengths), pairs, scored_tokens)


def shared_prompt_flops(config: PretrainedConfig, groups: list[tuple[int, list[int]]], scored_tokens: int) -> dict[str, float]:
    """Forward FLOPs of the shared-prompt row: ``groups`` = ``[(prompt length P, [response lengths])]``.

    Tokens ``P + sum(R_i)`` per group; attention pairs: the prompt's causal ``P(P+1)/2`` once, and
    per response ``R_i * P + R_i(R_i+1)/2`` (the whole prompt, then causal on itself).
    """
    tokens = sum(p + sum(rs) for p, rs in groups)
    pairs = sum(p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in rs) for p, rs in groups)
    return _flops(config, tokens, pairs, scored_tokens)


def _flops(config: PretrainedConfig, tokens: int, pairs: int, scored_tokens: int) -> dict[str, float]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    linear = 2 * tokens * _layer_linear_params(config) * config.num_hidden_layers
    attention = 2 * 2 * pairs * config.num_attention_heads * head_dim * config.num_hidden_layers  # QK^T and PV
    head = 2 * scored_tokens * config.hidden_size * config.vocab_size
    return {"linear": float(linear), "attention": float(attention), "head": float(head),
            "total": float(linear + attention + head)}


def padded_and_valid_flops(
    config: PretrainedConfig, attention_mask: torch.Tensor, response_length: int
) -> tuple[dict[str, float], dict[str, float]]:
    """FLOPs of the padded forward (every row full length, head on every response column) and of
    the valid tokens only (what the packed forward needs)."""
    batch, seqlen = attention_mask.shape
    valid_lengths = attention_mask.sum(dim=1).tolist()
    scored = int(attention_mask[:, seqlen - response_length :].sum())
    padded = logprob_flops(config, [seqlen] * batch, batch * response_length)
    valid = logprob_flops(config, valid_lengths, scored)
    return padded, valid
