"""``rlpad bench export``: seconds, disk written and peak memory of ``rlpad export`` at a benchmark shape.

A random model of the shape (rlpad/bench/models.py; default ``qwen2.5-0.5b``, 494M parameters, fp32) is saved
as the actor's sharded checkpoint (the DCP layout a one-rank run writes: ``{"model": LogProbModel state}``, plus
``huggingface/``), then exported in fresh child processes (``python -m rlpad.bench.export CHILD ...``), each
reporting its resident memory before the export and its peak during it (sampled every 2 ms): the
export's own peak is the difference. Beside it, the whole-model way (every tensor loaded, then one ``save_file``) for the ratio.
Medians over ``reps`` runs of each; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

from rlpad.bench.table import Table

__all__ = ["run_export_bench", "tables"]

WAYS = ("streamed", "streamed_bf16", "whole_model")  # rlpad export; with --dtype bfloat16; load all + save_file


def _write_checkpoint(model_name: str, path: str) -> dict[str, Any]:
    """The actor checkpoint of a random ``model_name`` at ``path`` (role folder); its parameter count and bytes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rlpad.bench.models import bench_model
    from rlpad.core.forward import LogProbModel
    from rlpad.export.hf_folder import MODEL_FILES_DIR, write_model_files

    model = bench_model(model_name, seed=0, dtype=torch.float32)
    root = LogProbModel(model)
    state = root.state_dict()
    with warnings.catch_warnings():  # DCP says no process group exists: none is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": state}, checkpoint_id=path, no_dist=True)
    write_model_files(os.path.join(path, MODEL_FILES_DIR), model.config, dtype=torch.float32,
                      architecture=type(model).__name__)
    unique = {t.data_ptr(): t for t in state.values()}
    return {"params": sum(t.numel() for t in unique.values()),
            "checkpoint_bytes": sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                                    if os.path.isfile(os.path.join(path, f)))}


def _rss() -> int:
    """This process's resident memory now (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """The highest resident memory seen while the block runs, sampled every ``interval_s`` by a thread."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> _PeakRSS:
        self.peak = _rss()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def child(way: str, checkpoint: str, out: str) -> dict[str, Any]:
    """One export of ``checkpoint`` into ``out`` in this (fresh) process: seconds, bytes written, resident
    memory before and at its peak (sampled every 2 ms)."""
    from transformers import AutoConfig

    from rlpad.export.export import export_checkpoint
    from rlpad.export.hf_folder import MODEL_FILES_DIR
    from rlpad.export.names import LM_HEAD, actor_sources
    from rlpad.export.saved_shards import SavedShards

    tied = AutoConfig.from_pretrained(os.path.join(checkpoint, MODEL_FILES_DIR)).tie_word_embeddings
    baseline = _rss()
    start = time.perf_counter()
    with _PeakRSS() as peak:
        if way == "whole_model":
            from safetensors.torch import save_file

            shards = SavedShards(checkpoint)
            state = shards.load(shards.keys())
            os.makedirs(out)
            save_file({n: state[k] for n, k in actor_sources(state, tied) if not (tied and n == LM_HEAD)},
                      os.path.join(out, "model.safetensors"))
            written = os.path.getsize(os.path.join(out, "model.safetensors"))
        else:
            result = export_checkpoint(checkpoint, out, dtype="bfloat16" if way == "streamed_bf16" else None,
                                       progress=False)
            written = result.bytes
    return {"seconds": time.perf_counter() - start, "bytes": written, "baseline_rss": baseline, "peak_rss": peak.peak}


def run_export_bench(model: str = "qwen2.5-0.5b", *, reps: int = 1, workdir: str | None = None) -> dict[str, Any]:
    """Write the checkpoint, export it ``reps`` times each way (fresh processes); the medians."""
    root = tempfile.mkdtemp(prefix="rlpad_bench_export_", dir=workdir)
    try:
        checkpoint = os.path.join(root, "checkpoints", "global_step_1", "actor")
        start = time.perf_counter()
        info = _write_checkpoint(model, checkpoint)
        info["checkpoint_write_s"] = time.perf_counter() - start
        runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
        for rep in range(reps):
            for way in WAYS:
                out = os.path.join(root, f"{way}_{rep}")
                done = subprocess.run([sys.executable, "-m", "rlpad.bench.export", "CHILD", way, checkpoint, out],
                                      check=True, capture_output=True, text=True)
                runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
                shutil.rmtree(out)
        medians = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
        return {"model": model, **info, "reps": reps, "ways": medians, "runs": runs}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tables(result: dict[str, Any]) -> list[Table]:
    gib = 2.0**30
    rows = []
    for way, label in (("streamed", "rlpad export (as saved, fp32)"), ("streamed_bf16", "rlpad export --dtype bfloat16"),
                       ("whole_model", "whole model loaded, one save_file")):
        m = result["ways"][way]
        rows.append((label, f"{m['seconds']:.1f}", f"{m['bytes'] / gib:.2f}", f"{(m['peak_rss'] - m['baseline_rss']) / gib:.2f}",
                     f"{m['peak_rss'] / gib:.2f}"))
    stream, whole = result["ways"]["streamed"], result["ways"]["whole_model"]
    ratio = (whole["peak_rss"] - whole["baseline_rss"]) / max(stream["peak_rss"] - stream["baseline_rss"], 1)
    return [Table(("export", "seconds", "disk written GiB", "peak RSS above start GiB", "peak RSS GiB"), rows,
                  title=f"export of a {result['model']} actor checkpoint ({result['params'] / 1e6:.0f}M parameters, "
                        f"fp32, {result['checkpoint_bytes'] / gib:.2f} GiB of shards), median of {result['reps']}",
                  notes=[f"the streamed export holds {1 / ratio:.2f}x the memory of loading the whole model "
                         f"({ratio:.1f}x less); each export in a fresh process"])]


if __name__ == "__main__":
    if sys.argv[1:2] == ["CHILD"]:
        print(json.dumps(child(*sys.argv[2:5])))
