"""Where the driver builds what the embedded recipes need (the warm start, the reward model, the toy
datasets), and how a model folder is built there once (:func:`build_cached`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rlpad.config.schema import SFTConfig

__all__ = ["build_cached", "cache_root"]


def cache_root(sft: SFTConfig) -> str:
    """``sft.cache_dir`` as an absolute path, or the per-user cache: ``$XDG_CACHE_HOME/rlpad`` when
    that is absolute, else ``~/.cache/rlpad``. Never the working directory by default: under
    ``ray job submit --working-dir`` that is Ray's unpacked package, which nodes sharing a temp
    dir share and a node's runtime-env agent may replace while the job runs."""
    if sft.cache_dir:
        return os.path.abspath(os.path.expanduser(sft.cache_dir))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rlpad")


def build_cached(root: str, name: str, info_file: str, seed: int, build: Callable[[str], dict[str, Any]]) -> str:
    """The folder ``root/name``, built once: ``build(folder)`` writes a model into a temporary folder and
    returns its record, written last as ``info_file`` (its presence marks a complete folder), then the
    folder is renamed into place (another process finishing first wins; a stale incomplete folder is
    replaced). ``build`` runs single-threaded under a forked, ``seed``-ed RNG, so the weights do not
    depend on the machine's thread count; the record gains ``seconds``."""
    import torch

    final = os.path.join(root, name)
    if os.path.isfile(os.path.join(final, info_file)):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root)
    try:
        start = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                info = build(tmp)
        finally:
            torch.set_num_threads(threads)
        info["seconds"] = round(time.perf_counter() - start, 2)
        with open(os.path.join(tmp, info_file), "w") as f:
            json.dump(info, f, indent=1, default=str)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first (or a stale incomplete folder is in the way)
            if os.path.isfile(os.path.join(final, info_file)):
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
