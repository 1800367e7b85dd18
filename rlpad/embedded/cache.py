"""Where the driver builds what the embedded recipes need: the warm start and the toy datasets."""

from __future__ import annotations

import os

from rlpad.config.schema import SFTConfig

__all__ = ["cache_root"]


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
