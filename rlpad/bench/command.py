"""``rlpad bench``: its arguments and the dispatch to each benchmark (their modules imported only when run)."""

from __future__ import annotations

import argparse
import os
from typing import TextIO

__all__ = ["CUDA_BENCHES", "add_bench_parser", "run_bench"]

CUDA_BENCHES = ("logprob", "prefix", "sp", "head", "host")  # the benchmarks with a --device cuda variant


def run_bench(args: argparse.Namespace, command: str) -> int:
    """One benchmark with its engine and library output in ``bench_<what>.log`` beside its JSON (as a training
    run's in run.log, :class:`rlpad.run_log.RunLog`): the console keeps one progress line and the tables."""
    from rlpad.run_log import RunLog, stderr_to_file

    folder = (args.out if args.what == "all" else os.path.dirname(args.out)) if args.out else "results"
    path = os.path.join(folder or ".", f"bench_{args.what}{'_vl' if args.vl else ''}"
                                       f"{'_cuda' if args.device == 'cuda' else ''}.log")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    print(f"rlpad bench {args.what}: running; engine and library messages go to {path}", flush=True)
    with stderr_to_file(path) as console, RunLog(os.path.dirname(path), "error", console=console,
                                                 name=os.path.basename(path)) as run_log:
        run_log.own_vllm_logging()
        return _run_bench(args, command, console)


def _run_bench(args: argparse.Namespace, command: str, console: TextIO) -> int:
    """The benchmark ``args.what``; one-line refusals go to ``console``."""
    from rlpad.bench.table import show, write_json

    load = os.getloadavg()  # before the benchmark loads the machine itself

    def report(name: str, tables: list) -> None:
        show(name, tables, markdown=args.markdown, command=command, load=load)

    if args.what == "head":
        device = "cpu" if args.dry_run else args.device
        suffix = "_cuda" if args.device == "cuda" else ""
        try:
            if args.sweep:
                from rlpad.bench.head_sweep import run_sweep, sweep_tables

                result = run_sweep(device, tokens=tuple(args.tokens) if args.tokens else None, hidden=args.hidden,
                                   vocab=args.vocab, reps=args.reps, budget_s=args.budget_s)
                tables = sweep_tables(result)
            else:
                from rlpad.bench.head import run_head, tables as head_tables

                result = run_head(device, tokens=tuple(args.tokens) if args.tokens else None, hidden=args.hidden,
                                  vocab=args.vocab, reps=args.reps)
                tables = head_tables(result)
        except ValueError as e:  # no CUDA device, or bad sizes: one line, before any compute
            print(f"error: {e}", file=console)
            return 2
        name = "head_sweep" if args.sweep else "head"
        report(f"{name}{' cuda' if args.device == 'cuda' else ''}", tables)
        write_json(result, args.out or f"results/bench_{name}{suffix}.json")
    elif args.what == "sp":
        from rlpad.bench.sp import run_sp_bench, tables

        try:
            result = run_sp_bench(model=(args.models or ["40m"])[0], sizes=tuple(args.sizes), seqs=args.seqs,
                                  min_len=args.lengths[0], max_len=args.lengths[1], reps=args.reps, device=args.device)
        except ValueError as e:  # bad sizes, or too few GPUs: one line, before any compute
            print(f"error: {e}", file=console)
            return 2
        report(f"sp{' cuda' if args.device == 'cuda' else ''}", tables(result))
        write_json(result, args.out or f"results/bench_sp{'_cuda' if args.device == 'cuda' else ''}.json")
    elif args.device == "cuda":
        if args.what not in CUDA_BENCHES:
            print(f"error: --device cuda is for `rlpad bench {'/'.join(CUDA_BENCHES)}`, not {args.what!r}",
                  file=console)
            return 2
        try:
            if args.what == "logprob" and args.vl:
                from rlpad.bench.logprob_vl import run_vl, vl_tables

                result = run_vl(args.models, reps=args.reps, dry_run=args.dry_run, device="cuda")
                tables = vl_tables(result)
            elif args.what == "logprob":
                from rlpad.bench.logprob_cuda import cuda_tables, run_cuda

                out = args.out or f"results/bench_{args.what}_cuda.json"

                def shape_done(so_far: dict) -> None:  # the JSON so far: a run cut short keeps its shapes
                    write_json(so_far, out)
                    print(f"bench logprob --device cuda: {so_far['shapes'][-1]['model']} done", flush=True)
                result = run_cuda(reps=args.reps, memory=not args.no_memory, shapes=args.models,
                                  micro_rows=args.micro_rows, dry_run=args.dry_run, columns=args.columns,
                                  on_shape=shape_done)
                tables = cuda_tables(result)
            elif args.what == "host":
                from rlpad.bench.host_cuda import cuda_tables as host_tables, run_cuda as run_host_cuda

                result = run_host_cuda(reps=args.reps, dry_run=args.dry_run)
                tables = host_tables(result)
            else:
                from rlpad.bench.prefix import run_cuda, tables as prefix_tables

                result = run_cuda(reps=args.reps, groups=args.groups, micro_rows=args.micro_rows or 16,
                                  models=args.models, dry_run=args.dry_run)
                tables = prefix_tables(result)
        except ValueError as e:  # no CUDA device, or bad sizes: one line, before any compute
            print(f"error: {e}", file=console)
            return 2
        name = f"{args.what}{'_vl' if args.vl else ''}"
        report(f"{name} cuda", tables)
        write_json(result, args.out or f"results/bench_{name}_cuda.json")
    elif args.what == "all":
        from rlpad.bench.report import run_all

        run_all(args.out or "results", reps=args.reps, markdown=args.markdown, command=command, load=load)
    elif args.what == "logprob" and args.vl:
        from rlpad.bench.logprob_vl import run_vl, vl_tables

        result = run_vl(args.models, reps=args.reps, device="cpu")
        report("logprob vl", vl_tables(result))
        write_json(result, args.out or "results/bench_logprob_vl.json")
    elif args.what == "logprob":
        from rlpad.bench.logprob import run, tables

        result = run(args.models, reps=args.reps, memory=not args.no_memory, out=args.out or "results/bench_logprob.json")
        report("logprob", tables(result))
    elif args.what == "e2e" and args.max_off_policy_steps is not None:
        from rlpad.bench.e2e_async import curve_tables, run_async_curves, run_async_e2e, tables

        recipe = (args.recipe or ["recipes/grpo_tiny_long.yaml"])[0]
        name = os.path.splitext(os.path.basename(recipe))[0]
        try:
            if args.curves:
                result = run_async_curves(recipe, args.max_off_policy_steps, overrides=args.set or (),
                                          png=args.curves, out=args.out or f"results/async_curves_{name}.json")
                report(f"async curves {name}", curve_tables(result))
            else:
                result = run_async_e2e(recipe, args.max_off_policy_steps, steps=args.steps or 8,
                                       overrides=args.set or (), out=args.out or f"results/bench_e2e_async_{name}.json")
                report(f"e2e async {name}", tables(result))
        except ValueError as e:  # bad k list, too few steps or cores: one line, before any compute
            print(f"error: {e}", file=console)
            return 2
    elif args.what == "stream":
        from rlpad.bench.stream import MODES, run_stream_bench, tables

        try:
            result = run_stream_bench(steps=args.steps or 8, modes=args.modes or tuple(MODES), overrides=args.set or (),
                                      out=args.out or "results/bench_stream.json", dry_run=args.dry_run)
        except ValueError as e:  # bad modes or steps, or a refused config: one line, before any compute
            print(f"error: {e}", file=console)
            return 2
        report("stream", tables(result))
    elif args.what == "e2e":
        from rlpad.bench.e2e import run_e2e, tables

        recipes = args.recipe or ["recipes/grpo_tiny_long.yaml"]
        for recipe in recipes:
            name = os.path.splitext(os.path.basename(recipe))[0]
            out = args.out if args.out and len(recipes) == 1 else f"results/bench_e2e_{name}.json"
            report(f"e2e {name}", tables(run_e2e(recipe, steps=args.steps or 4, overrides=args.set or (), out=out)))
    elif args.what == "host":
        from rlpad.bench.host import MODEL, run as run_host, tables

        try:
            result = run_host((args.models or [MODEL])[0], reps=args.reps, dry_run=args.dry_run)
        except ValueError as e:  # an unknown model row or bad repetitions: one line, before any compute
            print(f"error: {e}", file=console)
            return 2
        report("host", tables(result))
        write_json(result, args.out or "results/bench_host.json")
    elif args.what == "prefix":
        from rlpad.bench.prefix import run as run_prefix, tables

        result = run_prefix((args.models or ["40m"])[0], reps=args.reps, groups=args.groups,
                            out=args.out or "results/bench_prefix.json")
        report("prefix", tables(result))
    elif args.what == "workers":
        from rlpad.bench.worker_group import run_worker_bench, tables  # Ray through workers/

        result = run_worker_bench(model=(args.models or ["40m"])[0], reps=args.reps)
        report("workers", tables(result))
        write_json(result, args.out or "results/bench_workers.json")
    elif args.what == "lora":
        from rlpad.bench.lora import LORA_MODELS, run_lora_bench, tables

        result = run_lora_bench(tuple(args.models or LORA_MODELS), rank=args.lora_rank, reps=args.reps)
        report("lora", tables(result))
        write_json(result, args.out or "results/bench_lora.json")
    elif args.what == "rm":
        from rlpad.bench.reward_model import run_rm_bench, tables

        result = run_rm_bench((args.models or ["40m"])[0], reps=args.reps)
        report("rm", tables(result))
        write_json(result, args.out or "results/bench_rm.json")
    elif args.what == "export":
        from rlpad.bench.export import run_export_bench, tables

        result = run_export_bench((args.models or ["qwen2.5-0.5b"])[0], reps=args.reps)
        report("export", tables(result))
        write_json(result, args.out or "results/bench_export.json")
    elif args.what == "code":
        from rlpad.bench.code import run_code_bench, tables

        result = run_code_bench(reps=max(args.reps, 10))
        report("code", tables(result))
        write_json(result, args.out or "results/bench_code.json")
    elif args.what == "sync":
        from rlpad.bench.sync import SYNC_MODELS, run_sync_bench, tables  # Ray through workers/

        result = run_sync_bench(tuple(args.models or SYNC_MODELS), reps=args.reps)
        report("sync", tables(result))
        write_json(result, args.out or "results/bench_sync.json")
    elif args.what == "agent":
        from rlpad.bench.agent import run_agent_bench, tables

        if args.dry_run:  # the HF backend, 2 trajectories of 2 turns: the code path only
            result = run_agent_bench(engine="hf", in_flight=2, trajectories=2, turns=2, tokens_per_turn=4,
                                     observation_tokens=2, tool_latency_s=0.01, prompt_length=4, reps=1)
        else:
            result = run_agent_bench()
        report("agent", tables(result))
        write_json(result, args.out or "results/bench_agent.json")
    else:
        from rlpad.bench.rollout import run_rollout_bench, tables

        if args.dry_run:  # one engine at tiny shapes, no replicas: the code path only
            result = run_rollout_bench(reps=1, batch_size=2, n=2, response_length=8, mismatch_dtypes=())
        else:
            from rlpad.bench.replicas import run_replica_bench  # Ray through workers/

            result = run_rollout_bench(reps=args.reps)
            result["replicas"] = run_replica_bench(reps=args.reps)
        report("rollout", tables(result))
        write_json(result, args.out or "results/bench_rollout.json")
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """The ``rlpad bench`` subcommand's arguments."""
    bench = sub.add_parser("bench", help="benchmarks: print a table, write JSON (all: + Markdown and PNG); "
                           "--markdown PATH writes the table into a doc")
    bench.add_argument("what", nargs="?", default="all", choices=["all", "logprob", "prefix", "workers", "rollout", "sync",
                                                                   "e2e", "sp", "head", "lora", "rm", "export", "host", "code",
                                                                   "stream", "agent"])
    bench.add_argument("--models", nargs="*", default=None,
                       help="rows of rlpad/bench/models.py; logprob: sizes (tiny 40m; --device cuda: shapes of "
                            "rlpad/bench/logprob_cuda.py, qwen2.5-0.5b 7b-layers); prefix, workers: one size; "
                            "sync: sizes (40m 160m); lora: sizes (40m qwen2.5-0.5b); rm: one size (default 40m); "
                            "export: one size (default qwen2.5-0.5b); host: one row (default qwen2.5-0.5b)")
    bench.add_argument("--reps", type=int, default=3)
    bench.add_argument("--groups", type=int, default=8, help="prefix: prompt groups per batch (x n=8 rows)")
    bench.add_argument("--no-memory", action="store_true", help="logprob: skip the LM-head memory part")
    bench.add_argument("--vl", action="store_true",
                       help="logprob: a vision-language batch (rlpad/bench/logprob_vl.py: padded / rmpad / shared "
                            "prompts with images, the vision tower's share; CPU tiny-vl, --device cuda 7b-vl-layers)")
    bench.add_argument("--out", default=None, help="JSON path (all: output folder, default results/)")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="logprob, prefix: cuda runs the bf16 GPU benchmarks (logprob: qwen2.5-0.5b and "
                            "7b-layers beside transformers packing; prefix: qwen2.5-0.5b); "
                            "sp: one GPU per rank (nccl); head: the 7B head shape")
    bench.add_argument("--micro-rows", type=int, default=None,
                       help="logprob, prefix --device cuda: rows per micro-batch (logprob: default each shape's "
                            "own; prefix: 16, whole groups of 8)")
    bench.add_argument("--columns", default="all",
                       help="logprob --device cuda: a set of rlpad/bench/logprob_cuda.py COLUMN_SETS (all, peers, "
                            "compiled, flex) or a comma list of columns")
    bench.add_argument("--recipe", nargs="*", default=None,
                       help="e2e: recipe(s) to run (default recipes/grpo_tiny_long.yaml)")
    bench.add_argument("--steps", type=int, default=None,
                       help="e2e: training steps per mode (default 4, the first a warm-up; with "
                            "--max-off-policy-steps 8, the first 2 not counted)")
    bench.add_argument("--set", nargs="*", default=None, help="e2e, stream: recipe overrides a.b.c=value")
    bench.add_argument("--modes", nargs="*", default=None,
                       help="stream: runs of recipes/grpo_tiny_stream.yaml (sync first; sync k1 stream stream_regen: "
                            "rlpad/bench/stream.py), the same trained samples each (--steps, default 8, 2 not counted)")
    bench.add_argument("--sizes", nargs="*", type=int, default=[1, 2, 4], help="sp: sequence-parallel sizes")
    bench.add_argument("--seqs", type=int, default=8, help="sp: sequences in the packed row")
    bench.add_argument("--lengths", nargs=2, type=int, default=[1024, 4096], metavar=("MIN", "MAX"),
                       help="sp: response lengths, evenly spaced from MIN to MAX")
    bench.add_argument("--max-off-policy-steps", nargs="+", type=int, default=None, metavar="K",
                       help="e2e: one run per trainer.max_off_policy_steps (0 first), one engine and a one-rank actor "
                            "each on its own core: phase seconds, sync/async step ratio and its ideal")
    bench.add_argument("--curves", default=None, metavar="PNG",
                       help="e2e --max-off-policy-steps: train the whole recipe per k instead and plot the rewards")
    bench.add_argument("--tokens", nargs="*", type=int, default=None,
                       help="head: token counts (default cuda 4800 19000, cpu 128 512)")
    bench.add_argument("--hidden", type=int, default=None, help="head: hidden size (default cuda 3584, cpu 128)")
    bench.add_argument("--vocab", type=int, default=None, help="head: vocabulary (default cuda 152064, cpu 2048)")
    bench.add_argument("--sweep", action="store_true",
                       help="head: time every tile configuration of rlpad/bench/head_sweep.py's SWEEP (CUDA; on the "
                            "CPU: Triton's interpreter at tiny shapes), each checked against fp64")
    bench.add_argument("--budget-s", type=float, default=None,
                       help="head --sweep: start no configuration after this many seconds (the rest: rows saying so)")
    bench.add_argument("--dry-run", action="store_true",
                       help="logprob, prefix, head with --device cuda: the same code on the CPU at tiny shapes (the "
                            "GPU command's dry run, scripts/test_gpu.sh with RLPAD_GPU_DRY_RUN=1); rollout: one "
                            "engine at tiny shapes, no replicas; stream: the configs checked, no runs; agent: the HF "
                            "backend, 2 trajectories; no timing "
                            "meaning")
    bench.add_argument("--lora-rank", type=int, default=8, help="lora: the adapters' rank")
    bench.add_argument("--markdown", metavar="PATH", default=None,
                       help="also write the table(s) into this Markdown file, between the markers "
                            "<!-- rlpad bench NAME: begin/end --> (replaced when present, else appended)")
