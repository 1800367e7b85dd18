"""FLOP model of the scoring forward: what each path computes, described once, counted once.

A path's work is a :class:`ForwardWork`: the tokens that go through the decoder's linear layers,
the attention problems its kernels are called on, and the tokens the LM head runs on. Each path of
:func:`rlpad.core.forward.scoring_hidden_states` (+ the LM head of ``compute_log_probs``), as the
code runs it, for a batch of B rows of S columns with N valid response tokens:

* padded: B x S tokens; B attention problems of S x S, every pair computed (sdpa with the
  padding mask cannot skip masked pairs; with no padding at all transformers passes no mask and
  sdpa runs causal); LM head on N;
* remove-padding: the nnz valid tokens; per sequence n x n, causal (torch's varlen flash kernel
  on CUDA, per-sequence ``is_causal`` sdpa on CPU: both skip the upper triangle); LM head on N;
* shared-prompt: each prompt once plus the responses, ``sum(P + sum L)`` tokens; per prompt P x P
  causal; per response L queries over P + L keys, bottom-right causal with the varlen kernels
  (CUDA bf16/fp16), every pair with the masked sdpa of the CPU branch; LM head on N;
* transformers packed (:mod:`rlpad.bench.peers`): the nnz valid tokens; with sdpa one nnz x nnz
  problem with an explicit block-diagonal mask, every pair computed; with flex_attention per
  sequence causal (its block mask skips the rest, block granularity not counted); LM head on all
  nnz tokens (full logits).

The head runs on the N scored tokens on every path: the core gathers their hidden states first.
FLOPs are matmul FLOPs, 2 per multiply-add: linear ``2 x tokens x (layer weights) x layers``,
attention ``2 x 2 x pairs x heads x head_dim x layers`` (QK^T and PV), head ``2 x N x hidden x
vocab``. Not counted: norms, rotary tables, softmax, the embedding gather, log-softmax and
entropy (the chunked head's ``E_p[z]`` is an elementwise sum), sliding windows
(the benchmark models have none), causal kernels' work on diagonal blocks beyond the exact
triangle. A backward is 2x its forward (the benchmarks' fwd+bwd = 3x; the chunked head's
recompute is not counted). tests/test_bench_flops.py checks these counts by hand and against
torch's FLOP counter on the real forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

__all__ = ["AttentionBlock", "ForwardWork", "forward_flops", "packed_peer_work", "packed_work",
           "padded_and_packed_flops", "padded_work", "shared_prompt_work", "vision_flops"]


@dataclass(frozen=True)
class AttentionBlock:
    """``count`` attention problems of ``queries`` queries over ``keys`` keys, the queries being the
    last ``queries`` positions (bottom-right). ``causal``: the kernel skips the pairs where a key
    comes after its query; otherwise (an explicit mask) it computes every pair."""

    count: int
    queries: int
    keys: int
    causal: bool

    @property
    def pairs(self) -> int:
        """(query, key) pairs the kernel computes."""
        if not self.causal:
            return self.rectangle
        q, k = self.queries, self.keys
        return self.count * (q * (k - q) + q * (q + 1) // 2)

    @property
    def rectangle(self) -> int:
        """Every (query, key) pair of the problems: what a kernel that skips nothing computes."""
        return self.count * self.queries * self.keys


@dataclass(frozen=True)
class ForwardWork:
    """What one scoring forward computes: ``tokens`` through the decoder's linear layers, the
    ``attention`` problems of each layer, ``head_tokens`` through the LM head."""

    tokens: int
    attention: tuple[AttentionBlock, ...]
    head_tokens: int

    @property
    def pairs(self) -> int:
        return sum(a.pairs for a in self.attention)

    @property
    def rectangle_pairs(self) -> int:
        return sum(a.rectangle for a in self.attention)


def _lengths(attention_mask: torch.Tensor, response_length: int) -> tuple[list[int], list[int]]:
    """(valid prompt length, valid response length) of every row."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, S), got shape {tuple(attention_mask.shape)}")
    prompt_cols = attention_mask.shape[1] - response_length
    if not 0 <= prompt_cols < attention_mask.shape[1]:
        raise ValueError(f"response_length={response_length} must be in [1, {attention_mask.shape[1]}]")
    mask = attention_mask.long()
    return mask[:, :prompt_cols].sum(1).tolist(), mask[:, prompt_cols:].sum(1).tolist()


def padded_work(attention_mask: torch.Tensor, response_length: int) -> ForwardWork:
    """The padded path: every row full length, S x S attention, head on the scored tokens. The
    attention is masked (every pair) unless no token is padding: then transformers passes no mask
    and sdpa runs causal."""
    batch, seqlen = attention_mask.shape
    _, responses = _lengths(attention_mask, response_length)
    causal = bool(attention_mask.bool().all())
    return ForwardWork(batch * seqlen, (AttentionBlock(batch, seqlen, seqlen, causal),), sum(responses))


def packed_work(attention_mask: torch.Tensor, response_length: int) -> ForwardWork:
    """The remove-padding path: the valid tokens, causal attention per sequence."""
    prompts, responses = _lengths(attention_mask, response_length)
    lengths = Counter(p + r for p, r in zip(prompts, responses))
    blocks = tuple(AttentionBlock(count, n, n, causal=True) for n, count in sorted(lengths.items()))
    return ForwardWork(sum(prompts) + sum(responses), blocks, sum(responses))


def packed_peer_work(attention_mask: torch.Tensor, response_length: int, *, masked: bool) -> ForwardWork:
    """transformers packed: the valid tokens in one row, the LM head on all of them. ``masked``
    (sdpa): one nnz x nnz problem, every pair computed; else (flex_attention) causal per sequence."""
    rmpad = packed_work(attention_mask, response_length)
    attention = (AttentionBlock(1, rmpad.tokens, rmpad.tokens, causal=False),) if masked else rmpad.attention
    return ForwardWork(rmpad.tokens, attention, rmpad.tokens)


def shared_prompt_work(attention_mask: torch.Tensor, response_length: int, groups: Sequence[Sequence[int]], *,
                       causal_responses: bool) -> ForwardWork:
    """The shared-prompt path: each group's prompt once (causal), each response over [its prompt,
    itself]. ``groups``: rows by identical prompt (:func:`rlpad.core.shared_prompt.prompt_groups`).
    ``causal_responses``: True where the varlen kernels run (CUDA bf16/fp16), False for the masked
    sdpa of the CPU branch."""
    prompts, responses = _lengths(attention_mask, response_length)
    if sorted(r for g in groups for r in g) != list(range(len(prompts))):
        raise ValueError(f"groups must partition the {len(prompts)} rows, got {list(map(list, groups))}")
    shapes: Counter[tuple[int, int, bool]] = Counter()  # (queries, keys, causal) -> problems
    tokens = 0
    for rows in groups:
        plen = prompts[rows[0]]
        shapes[(plen, plen, True)] += 1
        tokens += plen
        for r in rows:
            if responses[r]:  # a row without response tokens adds nothing to the packed row
                shapes[(responses[r], plen + responses[r], causal_responses)] += 1
                tokens += responses[r]
    blocks = tuple(AttentionBlock(count, q, k, causal) for (q, k, causal), count in sorted(shapes.items()))
    return ForwardWork(tokens, blocks, sum(responses))


def _layer_linear_params(config: PretrainedConfig) -> int:
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    return hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size  # q, k, v, o; gate, up, down


def forward_flops(config: PretrainedConfig, work: ForwardWork) -> dict[str, float]:
    """``{"linear", "attention", "head", "total"}``: forward matmul FLOPs of ``work`` on ``config``'s model."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    linear = 2 * work.tokens * _layer_linear_params(config) * layers
    attention = 2 * 2 * work.pairs * config.num_attention_heads * head_dim * layers
    head = 2 * work.head_tokens * config.hidden_size * config.vocab_size
    return {"linear": float(linear), "attention": float(attention), "head": float(head),
            "total": float(linear + attention + head)}


def padded_and_packed_flops(
    config: PretrainedConfig, attention_mask: torch.Tensor, response_length: int
) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`forward_flops` of the padded and of the remove-padding path on one batch."""
    return (forward_flops(config, padded_work(attention_mask, response_length)),
            forward_flops(config, packed_work(attention_mask, response_length)))


def vision_flops(vision_config: PretrainedConfig, grids: torch.Tensor) -> dict[str, float]:
    """``{"linear", "attention", "total"}``: forward matmul FLOPs of a Qwen2(.5)-VL vision tower on the
    images of ``grids (n, 3)`` (t, h, w patches), counted as :func:`forward_flops` counts the decoder:
    the patch embedding, per block qkv + proj + MLP on every patch and bidirectional attention over each
    image frame (Qwen2.5-VL: over each window in the blocks outside ``fullatt_block_indexes``, the
    windows of transformers' ``get_vision_window_index``), the patch merger on every merged token."""
    from transformers.vision_utils import get_vision_window_index

    grids = grids.reshape(-1, 3).long()
    c = vision_config
    width = getattr(c, "embed_dim", None) or c.hidden_size  # Qwen2-VL names the tower's width embed_dim
    out = getattr(c, "out_hidden_size", None) or c.hidden_size
    mlp = 3 * width * c.intermediate_size if hasattr(c, "out_hidden_size") else 2 * width * c.mlp_ratio * width
    patches = int(grids.prod(-1).sum())
    frames = (grids[:, 1] * grids[:, 2]).repeat_interleave(grids[:, 0])
    full_pairs = int((frames**2).sum())
    depth, windowed = c.depth, []
    if hasattr(c, "fullatt_block_indexes"):  # Qwen2.5-VL: windowed blocks attend within windows
        _, cu = get_vision_window_index(grids, c.spatial_merge_size, c.window_size, c.patch_size)
        windowed = [b for b in range(depth) if b not in c.fullatt_block_indexes]
        window_pairs = int(((cu[1:] - cu[:-1]).long() ** 2).sum())
    pairs = full_pairs * (depth - len(windowed)) + (window_pairs * len(windowed) if windowed else 0)
    embed = 2 * patches * c.in_channels * c.temporal_patch_size * c.patch_size**2 * width
    merge = c.spatial_merge_size**2
    merger = 2 * (patches // merge) * (merge * width) * (merge * width + out)
    linear = embed + 2 * patches * (4 * width * width + mlp) * depth + merger
    attention = 2 * 2 * pairs * width
    return {"linear": float(linear), "attention": float(attention), "total": float(linear + attention)}
