"""``rlpad bench workers``: tokens/s of the worker group's compute_log_prob and update_actor,
remove-padding on vs off on the same batch, and their ratio. Ray is reached through workers/ (imported lazily).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from rlpad.bench.measure import median_seconds
from rlpad.bench.table import Table
from rlpad.embedded.synthetic import ppo_batch

__all__ = ["run_worker_bench", "tables"]


def run_worker_bench(
    *,
    model: str = "tiny",
    world_size: int = 2,
    rows: int = 16,
    prompt_length: int = 128,
    response_length: int = 128,
    reps: int = 3,
    logits_chunk_size: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Median tokens/s (valid tokens) of ``compute_log_prob`` and ``update_actor`` on a real Ray group.

    ``model``: a row of :data:`rlpad.bench.models.MODEL_SHAPES` (saved to a temp dir) or a model path.
    Returns ``{"config", "rmpad": {...}, "padded": {...}, "speedup": {"compute_log_prob", "update_actor"}}``.
    Starts a local Ray (127.0.0.1) if none is running and shuts it down afterwards.
    """
    from rlpad.bench.models import MODEL_SHAPES, bench_model
    from rlpad.config.schema import ActorRolloutRefConfig
    from rlpad.core.models import model_config
    from rlpad.embedded.tiny import build_tokenizer
    from workers.actor import ActorWorker
    from workers.group import WorkerGroup
    from workers.launcher import local_ray

    with local_ray(max(world_size, os.cpu_count() or 1), log_to_driver=False), \
            tempfile.TemporaryDirectory(prefix="rlpad-bench-") as tmp:
        path = model
        if model in MODEL_SHAPES:
            path = os.path.join(tmp, model)
            bench_model(model, seed=seed).save_pretrained(path)
            build_tokenizer(path)
        batch = ppo_batch(rows, prompt_length, response_length, vocab_size=int(model_config(path).vocab_size), seed=seed)
        tokens = int(batch["attention_mask"].sum())
        setup = dict(model=model, world_size=world_size, rows=rows, prompt_length=prompt_length,
                     response_length=response_length, valid_tokens=tokens,
                     padded_tokens=batch["input_ids"].numel(), reps=reps)  # fmt: skip
        result: dict[str, Any] = {"config": setup}
        for name, rmpad in (("rmpad", True), ("padded", False)):
            cfg = ActorRolloutRefConfig()
            cfg.model.path, cfg.model.logits_chunk_size, cfg.model.use_remove_padding = path, logits_chunk_size, rmpad
            cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu = rows, rows // world_size
            cfg.rollout.log_prob_micro_batch_size_per_gpu, cfg.rollout.n = rows // world_size, 1
            cfg.actor.optim.lr = 0.0  # timing only: keep the weights fixed
            group = WorkerGroup(ActorWorker, cfg, role="actor", world_size=world_size, seed=seed)
            try:
                group.call_batch("compute_log_prob", batch)  # warm-up
                t_lp = median_seconds(lambda: group.call_batch("compute_log_prob", batch), reps)
                t_up = median_seconds(lambda: group.call_batch("update_actor", batch, chunk_rows=rows), reps)
            finally:
                group.shutdown()
            result[name] = {"compute_log_prob_s": t_lp, "update_actor_s": t_up,
                            "compute_log_prob_tok_s": tokens / t_lp, "update_actor_tok_s": tokens / t_up}
    result["speedup"] = {k: result["rmpad"][f"{k}_tok_s"] / result["padded"][f"{k}_tok_s"]
                         for k in ("compute_log_prob", "update_actor")}  # fmt: skip
    return result


def tables(result: dict[str, Any]) -> list[Table]:
    """The padded vs remove-padding table of a :func:`run_worker_bench` result."""
    c = result["config"]
    rows = [[key, f"{result['padded'][f'{key}_tok_s']:.0f}", f"{result['rmpad'][f'{key}_tok_s']:.0f}",
             f"{result['speedup'][key]:.2f}x"] for key in ("compute_log_prob", "update_actor")]
    title = (f"worker group: {c['world_size']} ranks, {c['model']}, {c['rows']} rows x ({c['prompt_length']} prompt + "
             f"{c['response_length']} response), {c['valid_tokens'] / c['padded_tokens']:.0%} valid; valid tokens/s, "
             f"median of {c['reps']}")
    return [Table(["call", "padded tok/s", "rmpad tok/s", "rmpad / padded"], rows, title=title)]
