"""Run a function on N freshly spawned processes (the ranks of a gloo group, no Ray) and collect
what each returns. The function must live at module level of an importable module; each rank calls
``fn(rank, world, *args)`` with one torch thread and its return value comes back through a file."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["spawn_ranks"]


def _rank(fn: Callable[..., Any], rank: int, world: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn_ranks(fn: Callable[..., Any], world: int, out_dir: pathlib.Path, *args: Any,
                timeout_s: float = 900.0) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each in its own spawned process."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(fn, r, world, str(out_dir), args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"rank exit codes {codes} (a rank's traceback is above)"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
