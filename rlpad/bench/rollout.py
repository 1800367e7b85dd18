"""``rlpad bench rollout``: generation throughput, live weight-sync time and the rollout-vs-actor
log-prob mismatch on a tiny model.

A random tiny Qwen2 (tied embeddings) is saved to a temporary directory, the backend starts on
it, one warm-up generate runs, then ``reps`` timed generates (``batch_size`` prompts x ``n``
samples; random weights rarely emit EOS, so responses run near full length) and ``reps`` pushes
of the full state dict. The mismatch compares the engine's ``rollout_log_probs`` of the sampled
tokens with rlpad's fp32 remove-padding forward of the same weights (what the actor computes),
for the engine in fp32 and, in a second engine, in each of ``mismatch_dtypes``
(:func:`rlpad.algorithms.rollout_correction.log_prob_mismatch`; ``d = actor - rollout``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch

from rlpad.batch import Batch
from rlpad.bench.table import Table
from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.rollout import build_rollout
from rlpad.core.forward import compute_log_probs
from rlpad.embedded.tiny import build_tokenizer, tiny_model
from rlpad.algorithms.rollout_correction import log_prob_mismatch

__all__ = ["run_rollout_bench", "tables"]


def random_prompts(batch_size: int, prompt_length: int, vocab: int, seed: int) -> Batch:
    """``batch_size`` left-padded prompts of random ids, lengths in [prompt_length // 2, prompt_length]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_length // 2, prompt_length + 1, (batch_size,), generator=gen)
    mask = (torch.arange(prompt_length) >= prompt_length - lengths.unsqueeze(1)).long()
    ids = torch.randint(3, vocab, (batch_size, prompt_length), generator=gen) * mask
    return Batch({"input_ids": ids, "attention_mask": mask}, {"uid": [str(i) for i in range(batch_size)]})


def run_rollout_bench(
    *,
    backend: str = "vllm",
    batch_size: int = 16,
    n: int = 4,
    prompt_length: int = 32,
    response_length: int = 128,
    reps: int = 3,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    vocab_size: int = 128,
    cpu_kv_cache_gb: float = 0.5,
    seed: int = 0,
    mismatch_dtypes: tuple[str, ...] = ("bfloat16",),
) -> dict[str, Any]:
    """Measure one rollout backend; returns a JSON-ready dict (tokens/s, sync seconds, mismatch by engine dtype)."""
    model = tiny_model("qwen2", hidden_size=hidden_size, head_dim=32, num_hidden_layers=num_hidden_layers,
                       vocab_size=vocab_size, seed=seed)
    rollout = RolloutConfig(name=backend, n=n, temperature=1.0, seed=seed, cpu_kv_cache_gb=cpu_kv_cache_gb)
    data = DataConfig(max_prompt_length=prompt_length, max_response_length=response_length)
    prompts = random_prompts(batch_size, prompt_length, vocab_size, seed)
    with tempfile.TemporaryDirectory(prefix="rlpad-bench-rollout-") as path:
        model.save_pretrained(path)
        build_tokenizer(path)
        start = time.perf_counter()
        engine = build_rollout(path, rollout, data)
        startup = time.perf_counter() - start
        engine.generate(prompts)  # warm-up
        gen_s, tokens = [], []
        for _ in range(reps):
            start = time.perf_counter()
            out = engine.generate(prompts)
            gen_s.append(time.perf_counter() - start)
            tokens.append(int(out["response_mask"].sum()))
        state = model.state_dict()
        sync_s = [engine.update_weights(state) for _ in range(reps)]
        mismatch = {"float32": _mismatch(model, out)}
        _shutdown(engine)
        for dtype in mismatch_dtypes:
            other = build_rollout(path, replace(rollout, dtype=dtype), data)
            mismatch[dtype] = _mismatch(model, other.generate(prompts, seed=seed))
            _shutdown(other)
    return {
        "backend": backend,
        "num_params": sum(p.numel() for p in model.parameters()),
        "batch_size": batch_size,
        "n": n,
        "prompt_length": prompt_length,
        "response_length": response_length,
        "startup_s": startup,
        "gen_s": statistics.median(gen_s),
        "response_tokens": statistics.median(tokens),
        "gen_tokens_per_s": sum(tokens) / sum(gen_s),
        "sync_s": statistics.median(sync_s),
        "sync_s_all": sync_s,
        "mismatch": mismatch,
    }


def _mismatch(model: torch.nn.Module, out: Batch) -> dict[str, float]:
    """Mismatch of the engine's log-probs vs rlpad's fp32 remove-padding forward of ``model``."""
    with torch.no_grad():
        old, _ = compute_log_probs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                   out["responses"].shape[1], use_remove_padding=True,
                                   temperature=out.meta["temperature"])
    return log_prob_mismatch(old, out["rollout_log_probs"], out["response_mask"])


def _shutdown(engine: Any) -> None:
    if hasattr(engine, "shutdown"):
        engine.shutdown()


def tables(result: dict[str, Any]) -> list[Table]:
    """Generation speed, weight sync, log-prob mismatch and (when measured) the replica scaling of a
    :func:`run_rollout_bench` result (``result["replicas"]``: rlpad.bench.replicas)."""
    out = [Table(title=f"rollout ({result['backend']}, {result['num_params'] / 1e6:.2f}M-param Qwen2, "
                       f"{result['batch_size']} prompts x n={result['n']})",
                 notes=[f"{result['gen_tokens_per_s']:.0f} generated tokens/s; weight sync into the live engine "
                        f"{result['sync_s'] * 1e3:.1f} ms (median)"])]
    rows = [[f"{dtype} engine", f"{m['tokens']:.0f}", f"{m['abs_diff_mean']:.2e}", f"{m['abs_diff_max']:.2e}",
             f"{m['k3_kl']:.2e}", f"{m['pearson']:.6f}"] for dtype, m in result["mismatch"].items()]
    out.append(Table(["rollout", "tokens", "|diff| mean", "|diff| max", "k3 KL", "Pearson"], rows,
                     title="rollout vs actor (fp32) log-probs of the sampled tokens"))
    replicas = result.get("replicas")
    if replicas:
        rows = [[str(r["replicas"]), f"{r['tokens_per_s']:.0f}", f"{replicas['speedup'][str(r['replicas'])]:.2f}x"]
                for r in replicas["runs"]]
        out.append(Table(["replicas", "generated tok/s", "of 1"], rows,
                         title=f"rollout replicas ({replicas['batch_size']} prompts x n={replicas['n']}, "
                               f"{replicas['cpus']} CPUs)"))
    return out
