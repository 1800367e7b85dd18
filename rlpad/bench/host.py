"""``rlpad bench host``: the host's work per decoder layer and per forward, remove-padding vs shared prompts.

At the 0.5B shape a GPU forward waits on its host (issue #54): what the host does per layer (op
dispatch, Python in the modules and in rlpad's attention hook), per forward (the index plan of the
packed or shared-prompt row) and every read of a device value sets the wall time. This measures
that host work on the CPU (:mod:`rlpad.bench.host_proxy`), on the code path a GPU runs (the
attention dispatch offered an sm90 GPU's varlen kernel), for the batch of the issue: 16 rows
(2 prompts x 8 responses), prompt 512 with responses <= 256, and prompt 128 with responses <= 512,
the ``qwen2.5-0.5b`` layer structure (14 query / 2 key-value heads, q/k/v bias, tied head), bf16:

* ops per decoder layer, forward and forward+backward: the ops a forward dispatches on ``meta``
  (views aside: each is a kernel launch or more on a GPU) at depths 2 and 6, differenced; the
  integer-output ops among them (an index built in a layer: 0 expected) and the ops outside the
  layers (embedding, plan copy, head: the head runs torch's path on ``meta``, the fused Triton
  kernel on a GPU); host-to-device copies per forward;
* host us per layer: the CPU at tiny width (14 heads of 4, on a short 16-row batch, so each op's
  own work is ~1 us) with FlashAttention's forward a no-work stand-in: Python + dispatch, without a
  GPU's ~2-5 us launch per op (add ops x launch for a GPU host); the layer's host work does not
  depend on the batch on the varlen path (no per-sequence loop: ops per layer are equal across shapes);
* the plan: host ops and us of building the forward's index plan from the batch's host copy
  (:func:`rlpad.core.host_plan.packed_plan`, or the prompt groups and
  :func:`rlpad.core.shared_prompt.pack_shared_prompts`), on the real batch;
* device reads (each a synchronising call on a GPU, :class:`~rlpad.bench.host_proxy.DeviceReads`):
  as the workers call the core (host copy given, checks done where the batch entered) and as a
  direct ``compute_log_probs`` call (checks on, no host copy), with where each read is made;
* the forward's copy / index ops by name, per layer and outside, with their output bytes at the
  model's real width (``meta``: no memory): what a GPU forward writes in copies.

``--models``: the model row (default ``qwen2.5-0.5b``; ``7b-layers`` for its copies).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections import Counter
from typing import Any

import torch

from rlpad.bench.host_proxy import DeviceOps, DeviceReads, UntrackedRead, gpu_code_path
from rlpad.bench.kernels import COPY, kernel_kind
from rlpad.bench.models import model_shape
from rlpad.bench.table import Table
from rlpad.core.forward import compute_log_probs, groups_to_share
from rlpad.core.host_plan import HostBatch, packed_plan
from rlpad.core.shared_prompt import pack_shared_prompts
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import tiny_model

__all__ = ["DEPTHS", "GROUPS", "MODEL", "N", "PATHS", "SHAPES", "SHORT", "TINY_WIDTH", "host_us", "measure_shape",
           "micro_batch", "run", "tables"]

SHAPES = ((512, 256), (128, 512))  # (prompt length, max response length): the two batches
GROUPS, N = 2, 8  # 16 rows: 2 prompts x 8 responses (one GPU micro-batch)
MODEL = "qwen2.5-0.5b"
PATHS = ("rmpad", "shared")
DEPTHS = (2, 6)  # per layer = (count at 6 - count at 2) / 4
TINY_WIDTH = dict(hidden_size=56, head_dim=4, intermediate_size=64, vocab_size=256)  # the host-time runs
SHORT = (4, 2)  # the host-time runs' prompt length / max response length: each op's own work ~1 us
VOCAB = 256  # token ids of the batches (below every model's vocabulary)


def _model(name: str, layers: int, *, device: str, width: dict | None = None) -> torch.nn.Module:
    arch, spec = model_shape(name)
    spec = {**spec, **(width or {}), "num_hidden_layers": layers}
    return tiny_model(arch, dtype=torch.bfloat16, device=device, **spec)


def micro_batch(prompt: int, response: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The issue's micro-batch: :data:`GROUPS` prompts of ``prompt`` tokens x :data:`N` responses of 1 to
    ``response`` tokens (input_ids, attention_mask, position_ids)."""
    b = grpo_batch(GROUPS, N, prompt, response, vocab_size=VOCAB, seed=seed, min_prompt=prompt)
    return {k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}


def _score(model, b: dict, response: int, path: str, *, host: HostBatch | None, check: bool = False):
    return compute_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], response,
                             use_remove_padding=True, share_prompts=path == "shared", calculate_entropy=True,
                             check=check, host=host)  # fmt: skip


def _on_meta(models: dict[int, torch.nn.Module], b: dict, response: int, path: str) -> dict[str, Any]:
    """Device ops of a forward and a forward+backward on ``meta`` at each depth, and the forward's copies."""
    host = HostBatch.of(*b.values())
    meta = {k: v.to("meta") for k, v in b.items()}
    counts: dict[int, dict[str, DeviceOps]] = {}
    for depth, model in models.items():
        counts[depth] = {}
        with gpu_code_path(), torch.no_grad(), DeviceOps() as fwd:
            _score(model, meta, response, path, host=host)
        with gpu_code_path(), DeviceOps() as both:
            lp, ent = _score(model, meta, response, path, host=host)
            (lp.sum() + ent.sum()).backward()
        model.zero_grad(set_to_none=True)
        counts[depth] = {"fwd": fwd, "fwdbwd": both}
    lo, hi = DEPTHS
    span = hi - lo

    def per_layer(kind: str, field: str = "ops") -> Counter:
        diff = Counter(getattr(counts[hi][kind], field))
        diff.subtract(getattr(counts[lo][kind], field))
        return Counter({k: v / span for k, v in diff.items() if v})

    layer = per_layer("fwd")
    outside = Counter(counts[lo]["fwd"].ops)
    outside.subtract(Counter({k: v * lo for k, v in layer.items()}))
    layer_bytes, outside_bytes = per_layer("fwd", "bytes"), Counter(counts[lo]["fwd"].bytes)
    outside_bytes.subtract(Counter({k: v * lo for k, v in layer_bytes.items()}))
    copies = {where: {k: [ops[k], by[k]] for k in ops if ops[k] and (kernel_kind("aten::" + k[5:]) == COPY
                                                                       or k in ("aten._to_copy", "aten.copy_"))}
              for where, ops, by in (("layer", layer, layer_bytes), ("outside", outside, outside_bytes))}
    return {"ops_per_layer": {"fwd": sum(layer.values()), "fwdbwd": sum(per_layer("fwdbwd").values())},
            "ops_outside_fwd": sum(v for v in outside.values() if v), "layer_ops": dict(sorted(layer.items())),
            "index_ops_per_layer": sum(per_layer("fwd", "ints").values()),
            "h2d_per_forward": counts[lo]["fwd"].h2d, "copies": copies}


def _reads(model: torch.nn.Module, b: dict, response: int, path: str) -> dict[str, Any]:
    """Device reads of a forward as the workers run it and as a direct checked call."""
    out: dict[str, Any] = {}
    for name, check, host in (("worker", False, HostBatch.of(*b.values())), ("checked_call", True, None)):
        try:
            with gpu_code_path(), torch.no_grad(), DeviceReads() as reads:
                meta = {k: v.to("meta") for k, v in b.items()}
                _score(model, meta, response, path, host=host, check=check)
            out[name], out[f"{name}_where"] = reads.total(), dict(reads.where)
        except UntrackedRead as e:  # a read of an activation: a sync inside the layers
            out[name], out[f"{name}_where"] = None, {"untracked": str(e)}
    return out


def _cpu_us(fn, reps: int) -> float:
    """The median CPU time of ``reps`` calls of ``fn`` on this thread, us: the host's own work, not the time
    the machine's other load keeps it waiting (a shared CPU: wall time would count that)."""
    times = []
    for _ in range(reps):
        start = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - start)
    return statistics.median(times) / 1e3


def _plan(b: dict, response: int, path: str, reps: int) -> dict[str, float]:
    """Host ops and us of the forward's index plan from the batch's host copy (what a GPU forward builds)."""
    host = HostBatch.of(*b.values())

    def build():
        if path == "rmpad":
            return packed_plan(host, response)
        groups = groups_to_share(host, response, 0.0)
        return pack_shared_prompts(host.input_ids, host.attention_mask, host.position_ids, response, groups=groups)

    with DeviceOps(device="cpu") as ops:
        build()
    return {"plan_ops": ops.total(), "plan_us": _cpu_us(build, reps)}


def host_us(paths: tuple[str, ...] = PATHS, reps: int = 15) -> dict[str, dict[str, float]]:
    """``{path: {"layer_us", "rest_us"}}``: host us per decoder layer and of the rest of a forward
    (embedding, final norm, head, scatter; its plan aside), the CPU at tiny width on the short batch, the
    heavy ops no-work stand-ins; paths and depths interleaved, the median CPU time of ``reps`` each. One
    figure per path: on the varlen path a layer's host work does not depend on the batch."""
    prompt, response = SHORT
    b = micro_batch(prompt, response, seed=1)
    host = HostBatch.of(*b.values())
    models = {d: _model(MODEL, d, device="cpu", width=TINY_WIDTH).train() for d in DEPTHS}
    times: dict[tuple[str, int], list[float]] = {(p, d): [] for p in paths for d in DEPTHS}
    with gpu_code_path(cpu=True), torch.no_grad():
        for _ in range(reps + 1):  # the first round warms up
            for (path, d), ts in times.items():
                ts.append(_cpu_us(lambda path=path, d=d: _score(models[d], b, response, path, host=host), 1))
    out = {}
    for path in paths:
        lo, hi = (statistics.median(times[(path, d)][1:]) for d in DEPTHS)
        layer = (hi - lo) / (DEPTHS[1] - DEPTHS[0])
        plan = _plan(b, response, path, reps)["plan_us"]  # the short batch's own plan, not the real batch's
        out[path] = {"layer_us": layer, "rest_us": lo - DEPTHS[0] * layer - plan}
    return out


def measure_shape(model_name: str, prompt: int, response: int, *, reps: int = 15,
                  paths: tuple[str, ...] = PATHS, host: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Every figure of one batch shape for each of ``paths`` (see the module docstring); ``host``: the
    paths' :func:`host_us` (None: no host-time figures)."""
    b = micro_batch(prompt, response)
    models = {d: _model(model_name, d, device="meta").train() for d in DEPTHS}
    layers = model_shape(model_name)[1]["num_hidden_layers"]
    result: dict[str, Any] = {"prompt": prompt, "max_response": response, "rows": GROUPS * N,
                              "valid_tokens": int(b["attention_mask"].sum()), "model_layers": layers, "paths": {}}
    for path in paths:
        r = _on_meta(models, b, response, path)
        r.update(_reads(models[DEPTHS[0]], b, response, path))
        r.update(_plan(b, response, path, reps))
        if host is not None:
            r.update(host[path])
            r["forward_host_ms"] = (r["plan_us"] + r["rest_us"] + layers * r["layer_us"]) / 1e3
        result["paths"][path] = r
    return result


def run(model_name: str = MODEL, *, reps: int = 15, shapes=SHAPES, dry_run: bool = False) -> dict[str, Any]:
    """The benchmark over ``shapes``; ``dry_run``: one short shape, 2 repetitions (the code path only)."""
    model_shape(model_name)  # ValueError naming the rows
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if dry_run:
        shapes, reps = ((32, 16),), min(reps, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a GPU's host thread dispatches alone (and idle OpenMP threads on a busy CPU stall)
    try:
        times = host_us(PATHS, reps)
        measured = [measure_shape(model_name, p, r, reps=reps, host=times) for p, r in shapes]
    finally:
        torch.set_num_threads(threads)
    return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "machine": platform.processor() or "cpu",
            "cores": os.cpu_count(), "threads": 1, "model": model_name, "depths": list(DEPTHS),
            "tiny_width": TINY_WIDTH, "short_batch": list(SHORT), "groups": GROUPS, "n": N, "dry_run": dry_run,
            "shapes": measured}


def _reads_text(r: dict, key: str) -> str:
    n = r.get(key)
    return "activation!" if n is None else str(n)


def tables(result: dict[str, Any]) -> list[Table]:
    """The per-path table and the copies table of a :func:`run` result."""
    rows, copy_rows = [], []
    for s in result["shapes"]:
        shape = f"{s['prompt']}/{s['max_response']}"
        for path, r in s["paths"].items():
            rows.append([shape, path, f"{r['ops_per_layer']['fwd']:.0f}", f"{r['ops_per_layer']['fwdbwd']:.0f}",
                         f"{r['index_ops_per_layer']:.0f}", f"{r['ops_outside_fwd']:.0f}",
                         f"{r['layer_us']:.0f}" if "layer_us" in r else "-", str(r["plan_ops"]), f"{r['plan_us']:.0f}",
                         f"{r['forward_host_ms']:.1f}" if "forward_host_ms" in r else "-", str(r["h2d_per_forward"]),
                         f"{_reads_text(r, 'worker')} / {_reads_text(r, 'checked_call')}"])
            for where in ("layer", "outside"):
                for op, (count, nbytes) in sorted(r["copies"][where].items(), key=lambda kv: -kv[1][1]):
                    copy_rows.append([shape, path, where, op.removeprefix("aten."), f"{count:g}",
                                      f"{nbytes / 2**20:.1f}"])
    title = (f"host work of one forward, {result['model']} layer structure, bf16, {result['groups']} prompts x "
             f"{result['n']} responses, the GPU code path (sm90 varlen offer) on the CPU; torch {result['torch']}")
    notes = [f"ops: dispatched on meta (views aside: each a kernel launch or more on a GPU), per layer = depth "
             f"{result['depths'][1]} - depth {result['depths'][0]}, divided; index ops: integer outputs in a layer; "
             f"outside: per forward (the head runs torch's path on meta, Triton's on a GPU)",
             f"host us: CPU time of this thread (medians), one thread, tiny width ({result['tiny_width']['hidden_size']} = 14 heads of 4), "
             f"a 16-row batch of prompts {result['short_batch'][0]} / responses <= {result['short_batch'][1]}, "
             "FlashAttention and the GEMMs no-work stand-ins; without a GPU's launch cost (~2-5 us per op on its host)",
             "plan: host ops and us building the forward's index plan on this batch; host ms/forward: plan + rest + "
             "layers x us/layer at the model's depth",
             "device reads (a GPU's synchronising calls): as the workers call the core (host copy given) / a direct "
             "compute_log_probs call with its checks and no host copy"]
    columns = ["P/R<=", "path", "ops/layer fwd", "ops/layer fwd+bwd", "index ops/layer", "ops outside (fwd)",
               "host us/layer", "plan host ops", "plan us", "host ms/forward", "H2D copies", "device reads"]
    out = [Table(columns, rows, title=title, notes=notes)]
    out.append(Table(["P/R<=", "path", "where", "op", "per layer or forward", "MiB"], copy_rows,
                     title=f"the forward's copy / index ops and their output bytes at the {result['model']} width "
                           "(meta; per layer, or per forward outside the layers)"))
    return out
