"""The ``rlpad`` command: ``check``, ``bench``, ``config``, ``train``, ``eval``, ``toy-data``, ``merge-lora``, ``export``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from rlpad.bench.command import add_bench_parser, run_bench
from rlpad.export.command import add_export_parser


def _config(args: argparse.Namespace) -> int:
    """``rlpad config [recipe] [overrides]``: print every key, or write the Markdown reference."""
    from rlpad.config.doc import describe, format_console, markdown
    from rlpad.recipe.checks import registry_choices
    from rlpad.recipe.load import load_config

    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not os.path.isfile(recipe):  # no recipe, only overrides
        recipe, overrides = None, [recipe, *overrides]
    try:
        sections = describe(load_config(recipe, overrides), registry_choices())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.markdown:
        os.makedirs(os.path.dirname(args.markdown) or ".", exist_ok=True)
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(sections, value_label="value" if recipe or overrides else "default"))
        print(f"wrote {args.markdown}")
        return 0
    try:
        print(format_console(sections))
    except BrokenPipeError:  # `rlpad config | head`
        sys.stderr.close()
    return 0


def _merge_lora(args: argparse.Namespace) -> int:
    """``rlpad merge-lora MODEL ADAPTER OUT``: the adapter merged into the model, saved as an HF folder."""
    from rlpad.lora.adapters import merge_adapter_folder
    import rlpad.embedded.tiny  # noqa: F401  tiny:<arch> model paths

    try:
        out = merge_adapter_folder(args.model, args.adapter, args.out, dtype=args.dtype)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpad", description="RL post-training with exact remove-padding")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="padded vs remove-padding agreement and speed on tiny models")
    check.add_argument("--reps", type=int, default=3)
    add_bench_parser(sub)
    cfg = sub.add_parser("config", help="every config key with its value (default, recipe or override), type and "
                         "meaning, read from the schema's comments (rlpad/config/)")
    cfg.add_argument("recipe", nargs="?", default=None, help="recipe YAML (default: the built-in defaults)")
    cfg.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    cfg.add_argument("--markdown", metavar="PATH", default=None,
                     help="write the keys as Markdown tables instead (docs/configuration.md is this with no recipe)")
    merge = sub.add_parser("merge-lora", help="merge a LoRA adapter (peft folder, e.g. <checkpoint>/actor/lora_adapter) "
                           "into its base model and save a Hugging Face model folder")
    merge.add_argument("model", help="the base model: a local HF folder (or tiny:<arch>)")
    merge.add_argument("adapter", help="the adapter folder (adapter_config.json + adapter_model.safetensors)")
    merge.add_argument("out", help="the merged model's folder (written with the tokenizer)")
    merge.add_argument("--dtype", default="float32", help="the merged weights' dtype (float32 | bfloat16 | float16)")
    add_export_parser(sub)
    train = sub.add_parser("train", help="GRPO/PPO from a recipe (same as python -m rlpad.train)", add_help=False)
    train.add_argument("rest", nargs=argparse.REMAINDER)
    evaluate = sub.add_parser("eval", help="the recipe's validation alone on a checkpoint or a model folder: per-source "
                              "mean@N / best@k / maj@k, a table and a JSON file (rlpad eval --help)", add_help=False)
    evaluate.add_argument("rest", nargs=argparse.REMAINDER)
    toy = sub.add_parser("toy-data", help="write the toy addition dataset (same as python -m rlpad.embedded.toy)", add_help=False)
    toy.add_argument("rest", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its own parser takes every option (argparse's REMAINDER would not)
        from rlpad.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["eval"]:
        from rlpad.evaluation import main as eval_main

        return eval_main(argv[1:])
    if argv[:1] == ["toy-data"]:
        from rlpad.embedded.toy import main as toy_main

        return toy_main(argv[1:])
    args = parser.parse_args(argv)
    command = shlex.join(["rlpad", *argv])
    if args.command == "check":
        from rlpad.bench.check import run_check

        return 0 if run_check(reps=args.reps) else 1
    if args.command == "config":
        return _config(args)
    if args.command == "merge-lora":
        return _merge_lora(args)
    if args.command == "export":
        from rlpad.export.command import run_export

        return run_export(args)
    return run_bench(args, command)


if __name__ == "__main__":
    sys.exit(main())
