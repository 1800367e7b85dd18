"""Per-token log-probabilities and entropies, from logits or chunk by chunk from hidden states.

The chunked path runs the LM head on ``chunk_size`` tokens at a time under activation
checkpointing, so the (N, V) fp32 logits never exist whole; backward recomputes each chunk.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["entropy_from_logits", "log_probs_and_entropy", "chunked_log_probs_and_entropy", "log_probs_from_logits"]


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[labels]`` in fp32; logits (..., V), labels (...)."""
    return log_probs_and_entropy(logits, labels, temperature, calculate_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` in fp32, per position."""
    logits = logits.float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, calculate_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``labels`` and (optionally) entropy, from one pass over ``logits``."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not calculate_entropy:
        return log_probs, None
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return log_probs, entropy


def _head_chunk(hidden, weight, bias, labels, temperature, calculate_entropy):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    log_probs, entropy = log_probs_and_entropy(logits, labels, temperature, calculate_entropy)
    return (log_probs, entropy) if calculate_entropy else (log_probs,)


def chunked_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    calculate_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``labels`` and entropy through the LM head ``weight (V, H)``, chunk by chunk.

    ``hidden`` is (N, H) final hidden states and ``labels`` (N,). Exact, differentiable with
    respect to ``hidden``, ``weight`` and ``bias``; peak extra memory ~ chunk_size x V.
    """
    if chunk_size < 1:
        raise ValueError(f"logits_chunk_size must be >= 1, got {chunk_size}")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (N, H) and labels (N,), got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    log_probs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start : start + chunk_size], weight, bias, labels[start : start + chunk_size], temperature, calculate_entropy)
        out = checkpoint(_head_chunk, *args, use_reentrant=False) if needs_grad else _head_chunk(*args)
        log_probs.append(out[0])
        if calculate_entropy:
            entropies.append(out[1])
    log_probs_all = torch.cat(log_probs) if log_probs else hidden.new_zeros(0, dtype=torch.float32)
    if not calculate_entropy:
        return log_probs_all, None
    return log_probs_all, torch.cat(entropies) if entropies else hidden.new_zeros(0, dtype=torch.float32)
