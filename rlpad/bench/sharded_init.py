"""Sharded initialisation, measured: peak memory of each rank and bit-equality with a full load.

``python -m rlpad.bench.sharded_init --model 160m --world 2`` saves a random checkpoint, starts
``world`` plain processes (gloo, one rank each, no Ray) that run :meth:`ActorWorker.init_model`
(rank 0 reads the checkpoint; the others build on the meta device and receive their shards),
and prints per rank: peak RSS (VmHWM), its growth over the RSS just before ``init_model``, both
as a fraction of the full fp32 model size, and whether the sharded weights gathered back equal
a full load of the checkpoint bit for bit (``compare_to="other-seed"`` also compares them with a
checkpoint of another seed: a negative control that must report mismatches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from rlpad.bench.memory import peak_rss_bytes, rss_bytes
from rlpad.bench.models import MODEL_SHAPES, bench_model, model_shape
from rlpad.bench.table import write_json

__all__ = ["main", "run_init_bench"]


def save_model(name: str, path: str, seed: int = 0) -> int:
    """Write row ``name`` of :data:`rlpad.bench.models.MODEL_SHAPES` to ``path``; returns its parameter count."""
    model = bench_model(name, seed=seed)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _rank_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from rlpad.config.schema import ActorRolloutRefConfig
    from rlpad.core.models import load_causal_lm
    from workers.actor import ActorWorker

    cfg = ActorRolloutRefConfig()
    cfg.model.path = args.path
    worker = ActorWorker(cfg, role="actor", rank=args.rank, world_size=args.world, master_port=args.port,
                         device="cpu")  # a host-memory (VmHWM) measurement
    rss_before = rss_bytes()
    worker.init_model()
    hwm = peak_rss_bytes()
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in worker.root.parameters())
    gathered = dict(worker.iter_hf_tensors())  # a collective: every rank gathers the full weights
    tied = bool(getattr(worker.model.config, "tie_word_embeddings", False))
    buffers = dict(worker.model.named_buffers())  # rotary tables etc. (non-persistent: not in the state dict)

    def mismatches(path: str) -> list[str]:
        ref_model = load_causal_lm(path)
        reference = ref_model.state_dict()
        bad = sorted(k for k in reference if k not in gathered or not torch.equal(gathered[k], reference[k]))
        return bad + sorted(f"buffer:{k}" for k, b in ref_model.named_buffers() if not torch.equal(buffers[k], b))

    still_tied = worker.model.lm_head.weight is worker.model.get_input_embeddings().weight if tied else None
    result = {"rank": args.rank, "reads_checkpoint": worker.reads_checkpoint, "rss_before_bytes": rss_before,
              "hwm_bytes": hwm, "shard_bytes": shard_bytes, "tensors": len(gathered), "mismatched": mismatches(args.path),
              "mismatched_other": mismatches(args.compare_to) if args.compare_to else None,
              "tied_embeddings_shared": still_tied}
    with open(args.result, "w") as f:
        json.dump(result, f)
    worker.shutdown()


def run_init_bench(model: str = "160m", world: int = 2, compare_to: str | None = None,
                   timeout_s: float = 600.0) -> dict[str, Any]:
    """Save ``model`` (a row of :data:`rlpad.bench.models.MODEL_SHAPES`), init it sharded over ``world`` processes; per-rank results."""
    from workers.net import free_port

    model_shape(model)  # ValueError naming the table's rows
    if world < 2:
        raise ValueError(f"world must be >= 2 to have a rank that does not read the checkpoint, got {world}")
    with tempfile.TemporaryDirectory(prefix="rlpad-initbench-") as tmp:
        path = os.path.join(tmp, model)
        params = save_model(model, path)
        other = None
        if compare_to == "other-seed":  # negative control: a checkpoint with different weights
            other = os.path.join(tmp, "other")
            save_model(model, other, seed=1)
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen([sys.executable, "-m", "rlpad.bench.sharded_init", "--rank", str(r), "--world", str(world),
                              "--port", str(port), "--path", path, "--result", os.path.join(tmp, f"rank{r}.json")]
                             + (["--compare-to", other] if other else []), env=env)
            for r in range(world)
        ]
        codes = [p.wait(timeout=timeout_s) for p in procs]
        if any(codes):
            raise RuntimeError(f"init_bench ranks exited with {codes}")
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    full_bytes = params * 4
    for res in ranks:
        res["hwm_over_model"] = res["hwm_bytes"] / full_bytes
        res["growth_over_model"] = (res["hwm_bytes"] - res["rss_before_bytes"]) / full_bytes
    return {"model": model, "params": params, "fp32_bytes": full_bytes, "world": world, "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlpad.bench.sharded_init", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="160m", choices=sorted(MODEL_SHAPES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path for the results")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # internal: one rank
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--compare-to", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        _rank_main(args)
        return 0
    result = run_init_bench(args.model, args.world)
    print(f"{result['model']}: {result['params'] / 1e6:.1f}M parameters, fp32 {result['fp32_bytes'] / 2**20:.0f} MiB, "
          f"world {result['world']}")
    for r in result["ranks"]:
        print(f"  rank {r['rank']} reads={r['reads_checkpoint']!s:5}  VmHWM {r['hwm_bytes'] / 2**20:7.0f} MiB "
              f"({r['hwm_over_model']:.2f}x model)  growth during init {r['growth_over_model']:.2f}x model  "
              f"bit-identical: {not r['mismatched']}")
    if args.out:
        write_json(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
