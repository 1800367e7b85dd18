"""The ``rlpad`` command: ``check``, ``bench``, ``train``."""

from __future__ import annotations

import argparse
import sys


def _bench(args: argparse.Namespace) -> int:
    if args.what == "logprob":
        from rlpad.bench.logprob import run

        run(args.models, reps=args.reps, memory=not args.no_memory, out=args.out or "results/bench_logprob.json")
        return 0
    raise ValueError(f"unknown benchmark {args.what!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpad", description="RL post-training with exact remove-padding")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="padded vs remove-padding agreement and speed on tiny models")
    check.add_argument("--reps", type=int, default=3)
    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench.add_argument("what", choices=["logprob"])
    bench.add_argument("--models", nargs="*", default=None, help="logprob: model sizes (tiny, 40m)")
    bench.add_argument("--reps", type=int, default=3)
    bench.add_argument("--no-memory", action="store_true", help="logprob: skip the LM-head memory part")
    bench.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.command == "check":
        from rlpad.check import run_check

        return 0 if run_check(reps=args.reps) else 1
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
