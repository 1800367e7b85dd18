"""``rlpad bench host --device cuda``: is one forward micro-batch device-bound? (issue #54's 0.5B rows)

The batch of the issue (16 rows: 2 prompts x 8 responses; prompt 512 with responses <= 256, prompt 128
with responses <= 512), the ``qwen2.5-0.5b`` shape in bf16, forward only (old / reference log-probs),
called as the workers call the core (the batch's host copy given, checks done where it entered).
Per path (rmpad, shared) and variant:

* ``plain``: the model as loaded;
* ``rms_norm``: its RMSNorms on aten's fused op (:mod:`rlpad.core.fused_modules`, 12 fewer launches a layer);
* ``graphed``: the backbone of THIS micro-batch captured once in a CUDA graph and replayed (the
  index plan still built on the host and copied each call, the head and the scatter eager): whether
  CUDA graphs pay for forward-only scoring before packed rows are padded to length buckets for them
  (not built: the measurement comes first). On the CPU it runs its eager fallback, equal to ``plain``.

For each: ``wall_ms`` (synchronised, no profiler: the median of ``reps``), ``enqueue_ms`` (from the
call to its return without waiting for the GPU: the host's time; ~wall when the GPU waits on the
host), from one profiled call ``device_ms`` (the kernels' time), ``launches`` (kernels, memcpy,
memset) and per decoder layer, and ``syncs``: the synchronising calls (``torch.cuda.set_sync_debug_mode``)
with the line that made each. Targets: ``wall / device <= 1.1``; shared faster than rmpad whenever
its device time is lower. ``dry_run``: the same code on the CPU at a tiny width (graphed eager, no syncs).
"""

from __future__ import annotations

import statistics
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from rlpad.bench.host import GROUPS, MODEL, N, PATHS, SHAPES, micro_batch
from rlpad.bench.kernels import profile_pass
from rlpad.bench.measure import device_peak, require_cuda
from rlpad.bench.models import bench_model
from rlpad.bench.table import Table
from rlpad.core.attention import VARLEN_ATTENTION
from rlpad.core.forward import backbone_of, compute_log_probs, head_log_probs
from rlpad.core.fused_modules import FUSED_MODULES
from rlpad.core.host_plan import HostBatch, packed_plan
from rlpad.core.padding import pad_input

__all__ = ["SYNC_WARNING", "VARIANTS", "count_warnings", "cuda_syncs", "cuda_tables", "run_cuda"]

VARIANTS = ("plain", "rms_norm", "graphed")


def _plain(model, b: dict, response: int, path: str, host: HostBatch) -> Callable[[], object]:
    def fn():
        return compute_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], response,
                                 use_remove_padding=True, share_prompts=path == "shared", calculate_entropy=True,
                                 check=False, host=host)  # fmt: skip
    return fn


def _graphed(model, b: dict, response: int, path: str, host: HostBatch) -> Callable[[], object]:
    """The backbone's call of this micro-batch, recorded from an eager forward, captured in a CUDA graph
    (on the CPU: called eagerly, the fallback); each call: the index plan rebuilt on the host and copied
    (what a graph over bucketed rows needs), the packed ids and positions copied into the graph's input
    buffers, the graph replayed, the head on the scored slots and the scatter eager. Equal to
    :func:`_plain`'s numbers: the same kernels on the same inputs."""
    from rlpad.core.forward import groups_to_share
    from rlpad.core.shared_prompt import pack_shared_prompts

    backbone = backbone_of(model)
    recorded: dict[str, Any] = {}
    hook = backbone.register_forward_pre_hook(lambda m, a, kw: recorded.update(kw), with_kwargs=True)
    try:
        _plain(model, b, response, path, host)()
    finally:
        hook.remove()
    device = recorded["input_ids"].device
    graph = None
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture (lazy initialisation)
                backbone(**recorded)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden = backbone(**recorded).last_hidden_state[0]
    grid = (b["input_ids"].shape[0], response)

    def fn():
        nonlocal hidden
        if path == "shared":
            groups = groups_to_share(host, response, 0.0)
            row = pack_shared_prompts(host.input_ids, host.attention_mask, host.position_ids, response,
                                      groups=groups).to(device)
            ids, positions, slots, response_idx = row.input_ids, row.position_ids, row.score_index, row.response_idx
        else:
            plan = packed_plan(host, response).to(device)
            ids, positions, slots, response_idx = plan.input_ids, plan.position_ids, plan.score_slots, plan.response_idx
        recorded["input_ids"].copy_(ids.view(1, -1))
        recorded["position_ids"].copy_(positions.view(1, -1))
        if graph is not None:
            graph.replay()
        else:
            hidden = backbone(**recorded).last_hidden_state[0]
        labels = b["input_ids"][:, -response:].reshape(-1)[response_idx]
        lp, ent = head_log_probs(model, hidden.index_select(0, slots), labels, 1.0, True, None)
        return pad_input(lp[:, None], response_idx, *grid)[..., 0], pad_input(ent[:, None], response_idx, *grid)[..., 0]
    hidden = None if graph is None else hidden
    fn.graph, fn.inputs = graph, recorded  # kept alive with the function (the graph reads these buffers)
    return fn


# c10's warning for a synchronising call (warn_or_error_on_sync). NOT any message with "synchroniz" in it:
# torch.cuda.set_sync_debug_mode's own notice ("Synchronization debug mode is a prototype feature and does not
# yet detect all synchronizing operations") is warned ONCE per process, at the first call that turns the mode
# on, and counted as a sync it made the first measured forward of the GPU lane read 2 (the H200 runs of
# 2026-11-27 and -28: test_no_host_sync_per_layer[bf16], rmpad at 2 layers, the first measured call only).
SYNC_WARNING = "called a synchronizing CUDA operation"


def _python_caller() -> str:
    """``file:line`` of the innermost Python frame that made the current warning, outside torch itself."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if name.endswith(("warnings.py", "host_cuda.py")) or "/torch/" in name:
            continue
        for root in ("/site-packages/", "/rlpad/", "/tests/"):
            if root in name:
                name = name[name.rindex(root) + (len(root) if root == "/site-packages/" else 1):]
                break
        return f"{name}:{frame.lineno}"
    return "?"


def count_warnings(fn: Callable[[], object], text: str) -> tuple[int, dict[str, int]]:
    """``(n, {file:line: count})``: the warnings containing ``text`` that ``fn()`` raises, each at the Python
    line that made it (every one counted: the filters say "always" meanwhile)."""
    where: Counter[str] = Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if text in str(message):
            where[_python_caller()] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        fn()
    return sum(where.values()), dict(where)


def cuda_syncs(fn: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """The synchronising CUDA calls ``fn`` makes (``torch.cuda.set_sync_debug_mode("warn")``) and where."""
    torch.cuda.synchronize()

    def watched():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return count_warnings(watched, SYNC_WARNING)


def _measure(fn: Callable[[], object], device: torch.device, layers, reps: int) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for _ in range(2):
            fn()
        walls, enqueues = [], []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            fn()
            enqueues.append(time.perf_counter() - start)
            sync()
            walls.append(time.perf_counter() - start)
        prof = profile_pass(fn, device, layers=layers)
        syncs, where = cuda_syncs(fn) if device.type == "cuda" else (None, {})
    out = {"wall_ms": statistics.median(walls) * 1e3, "enqueue_ms": statistics.median(enqueues) * 1e3,
           "device_ms": prof["device_ms"], "launches": prof["launches"],
           "launches_per_layer": prof.get("launches_per_layer"), "syncs": syncs, "sync_where": where,
           "top": prof["top"][:6]}
    out["wall_vs_device"] = out["wall_ms"] / out["device_ms"] if out["device_ms"] else None
    return out


def run_cuda(*, reps: int = 10, shapes=SHAPES, variants=VARIANTS, dry_run: bool = False) -> dict[str, Any]:
    """Every path x variant at each shape; ``dry_run``: the CPU, the ``tiny`` model, one short shape, no graphs."""
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variants {bad}; choose among {list(VARIANTS)}")
    device = torch.device("cpu") if dry_run else require_cuda()
    name = "tiny" if dry_run else MODEL
    if dry_run:  # graphed runs its eager fallback there
        shapes, reps = ((16, 8),), min(reps, 2)
    models, skipped = {}, {}
    for v in variants:
        model = bench_model(name, seed=0, dtype=torch.bfloat16, device=device, attn_implementation=VARLEN_ATTENTION)
        try:
            if v == "rms_norm":
                FUSED_MODULES["rms_norm"](model)
        except ValueError as e:  # this torch has no fused RMSNorm: the variant not run, said why
            skipped[v] = str(e)
            continue
        models[v] = model.eval()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                              "device": device_peak(device)[0], "model": name, "groups": GROUPS, "n": N,
                              "dry_run": dry_run, "skipped": skipped, "shapes": []}
    for prompt, response in shapes:
        on_host = micro_batch(prompt, response)
        host = HostBatch.of(*on_host.values())
        b = {k: v.to(device) for k, v in on_host.items()}
        shape: dict[str, Any] = {"prompt": prompt, "max_response": response, "rows": GROUPS * N,
                                 "valid_tokens": int(host.attention_mask.sum()), "runs": {}}
        for path in PATHS:
            with torch.no_grad():
                ref = _plain(models.get("plain") or next(iter(models.values())), b, response, path, host)()
            for v, model in models.items():
                make = _graphed if v == "graphed" else _plain
                try:
                    fn = make(model, b, response, path, host)
                    run = shape["runs"][f"{path}/{v}"] = _measure(fn, device, backbone_of(model).layers, reps)
                    with torch.no_grad():
                        got = fn()
                    run["lp_max_diff_vs_plain"] = (got[0] - ref[0]).abs().max().item()
                    del fn
                except Exception as e:  # noqa: BLE001 - e.g. a capture that fails: the row says why, the rest runs
                    shape["runs"][f"{path}/{v}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        result["shapes"].append(shape)
    return result


def cuda_tables(result: dict[str, Any]) -> list[Table]:
    """One row per shape x path x variant of a :func:`run_cuda` result."""
    rows = []
    for s in result["shapes"]:
        for key, r in s["runs"].items():
            path, variant = key.split("/")
            if "error" in r:
                rows.append([f"{s['prompt']}/{s['max_response']}", path, variant, r["error"], *["-"] * 7])
                continue
            rows.append([f"{s['prompt']}/{s['max_response']}", path, variant, f"{r['wall_ms']:.2f}",
                         f"{r['enqueue_ms']:.2f}", f"{r['device_ms']:.2f}",
                         f"{r['wall_vs_device']:.2f}" if r["wall_vs_device"] else "-", str(r["launches"]),
                         f"{r['launches_per_layer']:.1f}" if r.get("launches_per_layer") is not None else "-",
                         "-" if r["syncs"] is None else str(r["syncs"]), f"{r['lp_max_diff_vs_plain']:.2g}"])
    notes = ["wall: synchronised, median, no profiler; enqueue: the call's return without waiting for the GPU "
             "(the host's time); device: the kernels' time in one profiled call; launches: kernels + memcpy + "
             "memset (per decoder layer: inside the layers' forwards); syncs: torch.cuda.set_sync_debug_mode; lp diff: "
             "max |log-prob - plain's| (graphed: 0, the same kernels; rms_norm: its one rounding per norm)",
             "targets (issue #54): wall / device <= 1.1; shared faster than rmpad whenever its device time is lower"]
    notes += [f"not run: {v} ({why})" for v, why in result.get("skipped", {}).items()]
    for s in result["shapes"]:
        for key, r in s["runs"].items():
            if r.get("sync_where"):
                notes.append(f"{s['prompt']}/{s['max_response']} {key} syncs at: " +
                             ", ".join(f"{k} x{v}" for k, v in r["sync_where"].items()))
    title = (f"one forward micro-batch on {result['device']} (torch {result['torch']}), {result['model']} bf16, "
             f"{result['groups']} prompts x {result['n']} responses, as the workers call the core")
    return [Table(["P/R<=", "path", "variant", "wall ms", "enqueue ms", "device ms", "wall / device", "launches",
                   "launches/layer", "syncs", "lp diff vs plain"], rows, title=title, notes=notes)]
