"""``rlpad bench sp``: one long packed row split over sp ranks (Ulysses): per-rank peak memory, tokens/s.

The row: ``seqs`` sequences of a short prompt and one long response each (lengths evenly spaced in
``[min_len, max_len]``, 8 of 1-4K tokens by default), the ``40m`` model in fp32, the forward and
backward of the summed response log-probs through the chunked LM head. For each sp in ``sizes``,
sp freshly spawned ranks of one group (gloo on CPU with ``cores // sp`` torch threads each; nccl
on CUDA, one GPU per rank) run it ``reps`` times after a short warm-up:

* peak memory per rank, above what the rank holds before (model, gradients, inputs): VmHWM growth
  on CPU (:mod:`rlpad.bench.memory`), ``max_memory_allocated`` growth on CUDA; the largest rank.
  The CPU ranks run with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``), so
  every freed tensor goes back to the system and VmHWM follows the live tensors; with glibc's
  default (a threshold that grows up to 32 MiB) the freed tensors of a few MiB stay in the heap and
  count in VmHWM (measured: 0.69x instead of 0.59x at sp = 2 on a 10K-token row). The LM head's
  chunk buffers (``chunk`` tokens x vocabulary, fp32) are the same on every rank: a part that does
  not shrink with sp;
* tokens/s: the row's tokens over the median forward+backward seconds;
* the largest log-prob difference to sp = 1 (the row's numbers are the same, only split).

The CUDA variant (``--device cuda``) has not been run yet: the machines this was written on have no GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import statistics
import tempfile
import time
from typing import Any

import torch

from rlpad.bench.table import Table

__all__ = ["long_row_batch", "run_sp_bench", "tables"]

PROMPT = 16  # prompt tokens per sequence


def long_row_batch(seqs: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rollout-layout tensors of ``seqs`` rows: a full ``PROMPT``-token prompt, responses of lengths
    evenly spaced in ``[min_len, max_len]`` (right-padded)."""
    from rlpad.core.layout import position_ids_from_mask

    lengths = torch.linspace(min_len, max_len, seqs).round().long() if seqs > 1 else torch.tensor([max_len])
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (seqs, PROMPT + max_len), generator=gen)
    mask = (torch.arange(PROMPT + max_len) < PROMPT + lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}


def _fwd_bwd(model, batch: dict[str, torch.Tensor], sp, chunk: int) -> torch.Tensor:
    from rlpad.core.forward import compute_log_probs

    response = batch["input_ids"].shape[1] - PROMPT
    lp, _ = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], response,
                              use_remove_padding=True, logits_chunk_size=chunk, check=False, sp=sp)  # fmt: skip
    lp.sum().backward()
    return lp.detach()


def _rank(rank: int, sp_size: int, init: str, spec: dict[str, Any], queue) -> None:
    import torch.distributed as dist

    from rlpad.bench.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    from rlpad.bench.models import bench_model
    from rlpad.core.sequence_parallel import SequenceParallel

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, spec["cores"] // sp_size))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank, world_size=sp_size)
    sp = SequenceParallel(dist.group.WORLD) if sp_size > 1 else None
    model = bench_model(spec["model"], attn_implementation="rlpad_varlen", device=device)
    vocab = model.config.vocab_size
    warm = {k: v.to(device) for k, v in long_row_batch(2, 8, 16, vocab).items()}
    batch = {k: v.to(device) for k, v in long_row_batch(spec["seqs"], spec["min_len"], spec["max_len"], vocab).items()}
    _fwd_bwd(model, warm, sp, spec["chunk"])  # the math libraries' one-time buffers, the gradient buffers
    times, peak = [], 0
    for rep in range(spec["reps"]):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            reset_peak_rss()
            base = rss_bytes()
        start = time.perf_counter()
        lp = _fwd_bwd(model, batch, sp, spec["chunk"])
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peak = max(peak, (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()) - base)
    log_probs = lp.cpu().tolist() if rank == 0 else None  # a plain list: a tensor would travel in shared memory
    queue.put({"rank": rank, "peak_bytes": peak, "seconds": times, "log_probs": log_probs})
    dist.destroy_process_group()


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}  # see the module docstring


def _run_size(sp_size: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, sp_size, os.path.join(tmp, "init"), spec, queue))
                 for r in range(sp_size)]
        saved = {k: os.environ.get(k) for k in MALLOC_ENV}
        os.environ.update(MALLOC_ENV)  # the spawned ranks read it when they start
        try:
            for p in procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        results = []
        while len(results) < sp_size:
            try:
                results.append(queue.get(timeout=5))
            except queue_module.Empty:
                if any(p.exitcode for p in procs):  # a rank failed (its traceback is above): stop the others
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"sp={sp_size}: rank exit codes {[p.exitcode for p in procs]}") from None
        for p in procs:
            p.join()
    return sorted(results, key=lambda r: r["rank"])


def run_sp_bench(*, model: str = "40m", sizes: tuple[int, ...] = (1, 2, 4), seqs: int = 8, min_len: int = 1024,
                 max_len: int = 4096, reps: int = 3, chunk: int = 256, device: str = "cpu") -> dict[str, Any]:
    """Measure every sp of ``sizes`` (see the module docstring); returns the JSON-ready result."""
    from rlpad.bench.models import bench_config

    heads = bench_config(model).num_attention_heads
    sizes = tuple(sorted(set(sizes)))
    bad = [s for s in sizes if s < 1 or heads % s]
    if bad or not sizes or 1 not in sizes:
        raise ValueError(f"sizes must include 1 and divide the {heads} query heads of {model}, got {sizes}")
    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < max(sizes)):
        raise ValueError(f"--device cuda needs {max(sizes)} GPUs, torch sees "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    spec = dict(model=model, seqs=seqs, min_len=min_len, max_len=max_len, reps=reps, chunk=chunk, device=device,
                cores=len(os.sched_getaffinity(0)))
    tokens = int(long_row_batch(seqs, min_len, max_len, 2)["attention_mask"].sum())
    runs, reference = [], None
    for sp_size in sizes:
        ranks = _run_size(sp_size, spec)
        lp = torch.tensor(ranks[0]["log_probs"])
        reference = lp if sp_size == 1 else reference
        seconds = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(reps))
        runs.append({"sp": sp_size, "peak_gib_per_rank": max(r["peak_bytes"] for r in ranks) / 2**30,
                     "peak_gib_by_rank": [r["peak_bytes"] / 2**30 for r in ranks], "fwd_bwd_s": seconds,
                     "tokens_per_s": tokens / seconds,
                     "max_abs_diff_vs_sp1": None if reference is None else float((lp - reference).abs().max())})
    base = next(r for r in runs if r["sp"] == 1)
    for r in runs:
        r["peak_ratio_vs_sp1"] = r["peak_gib_per_rank"] / base["peak_gib_per_rank"]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"config": spec | {"tokens": tokens}, "runs": runs, "load_average": load}


def tables(result: dict[str, Any]) -> list[Table]:
    """The per-sp table of a :func:`run_sp_bench` result."""
    c = result["config"]
    title = (f"sequence parallelism: one packed row of {c['tokens']} tokens ({c['seqs']} sequences, responses of "
             f"{c['min_len']}-{c['max_len']} tokens), {c['model']} fp32 on {c['device']}, forward+backward of the "
             f"log-probs (chunked LM head); median of {c['reps']}")
    rows = [[str(r["sp"]), f"{r['peak_gib_per_rank']:.3f}", f"{r['peak_ratio_vs_sp1']:.2f}", f"{r['fwd_bwd_s']:.2f}",
             f"{r['tokens_per_s']:.0f}", f"{r['max_abs_diff_vs_sp1']:.1e}"] for r in result["runs"]]
    notes = ["peak: memory growth of the largest rank above its model, gradients and inputs "
             f"({'max_memory_allocated' if c['device'] == 'cuda' else 'VmHWM'}); "
             f"CPU ranks get {c['cores']} cores // sp torch threads each"]
    return [Table(["sp", "peak GiB/rank", "vs sp=1", "fwd+bwd s", "tokens/s", "max|dlp| vs sp=1"], rows,
                  title=title, notes=notes)]
