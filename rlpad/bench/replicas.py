"""``rlpad bench rollout`` (Ray part, reached through workers/): generated tokens/s of 1 vs several data-parallel vLLM replicas.

The same random tiny Qwen2 and prompt batch as :func:`rlpad.bench.rollout.run_rollout_bench`;
for each replica count a :class:`workers.rollout.RolloutReplicas` (one CPU each) runs one warm-up
and ``reps`` timed seeded generates through the driver's split/merge. Reports median tokens/s
and the ratio to 1 replica, measured in one run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from rlpad.bench.rollout import random_prompts
from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.embedded.tiny import build_tokenizer, tiny_model

__all__ = ["run_replica_bench"]


def run_replica_bench(
    *,
    replicas: tuple[int, ...] = (1, 2),
    batch_size: int = 16,
    n: int = 4,
    prompt_length: int = 32,
    response_length: int = 128,
    reps: int = 3,
    cpu_kv_cache_gb: float = 0.25,
    seed: int = 0,
) -> dict[str, Any]:
    """Median generated tokens/s per replica count; ``speedup`` is relative to the first count."""
    from workers.launcher import local_ray
    from workers.rollout import RolloutReplicas

    vocab = 128
    model = tiny_model("qwen2", hidden_size=128, head_dim=32, num_hidden_layers=2, vocab_size=vocab, seed=seed)
    rollout = RolloutConfig(n=n, temperature=1.0, seed=seed, cpu_kv_cache_gb=cpu_kv_cache_gb)
    data = DataConfig(max_prompt_length=prompt_length, max_response_length=response_length)
    prompts = random_prompts(batch_size, prompt_length, vocab, seed)
    runs = []
    with local_ray(max(replicas), log_to_driver=False):
        with tempfile.TemporaryDirectory(prefix="rlpad-bench-replicas-") as tmp:
            path = os.path.join(tmp, "model")
            model.save_pretrained(path)
            build_tokenizer(path)
            for count in replicas:
                engines = RolloutReplicas(path, rollout, data, num_replicas=count)
                try:
                    engines.generate(prompts, seed=seed)  # warm-up
                    secs, tokens = [], []
                    for rep in range(reps):
                        start = time.perf_counter()
                        out = engines.generate(prompts, seed=seed + 1 + rep)
                        secs.append(time.perf_counter() - start)
                        tokens.append(int(out["response_mask"].sum()))
                finally:
                    engines.shutdown()
                rates = [t / s for t, s in zip(tokens, secs)]
                runs.append({"replicas": count, "gen_s": statistics.median(secs),
                             "response_tokens": statistics.median(tokens), "tokens_per_s": statistics.median(rates)})
    base = runs[0]["tokens_per_s"]
    return {
        "batch_size": batch_size, "n": n, "prompt_length": prompt_length, "response_length": response_length,
        "reps": reps, "cpus": os.cpu_count(), "runs": runs,
        "speedup": {str(r["replicas"]): r["tokens_per_s"] / base for r in runs},
    }  # fmt: skip
