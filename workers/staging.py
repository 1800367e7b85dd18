"""Getting what a worker reads onto its node.

Two kinds of paths reach the workers:

- **Checkpoints the user names** (``model.path: /data/qwen``): they must be on storage every node
  reads (a shared filesystem, or the same copy on each node). Each worker checks its own node
  and fails fast with ``ValueError`` naming the node IP and the path.
- **Folders the driver built** (the embedded warm start and its tokenizer, in the per-user cache of
  rlpad.embedded.cache, never in Ray's copy of the working dir): they exist only on the driver's
  node. :func:`ship_dir` puts their bytes in the Ray object store once; a worker on another node
  (even one that happens to see the driver's path) writes them into a per-node cache
  (``<tmp>/rlpad-shipped/<name>-<digest>``, written to a temporary folder and renamed, checked by
  content digest) and reads that copy.

Why ship rather than rebuild the warm start on each node: shipping is exact by construction
(the same bytes), while a rebuild is only as deterministic as the node's float arithmetic
(another CPU type may pick other kernels), and the folder is small (about 0.6 MB).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field

import ray

from rlpad.core.models import model_source

__all__ = ["NodePaths", "ShippedDir", "dir_digest", "ship_dir"]

DIGEST_FILE = ".rlpad-shipped-digest"


def _files(path: str) -> list[str]:
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in names if n != DIGEST_FILE]
    return sorted(out)


def dir_digest(path: str) -> str:
    """SHA-256 over the relative names and bytes of every file under ``path``."""
    h = hashlib.sha256()
    for rel in _files(path):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(path, rel), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


@dataclass(frozen=True)
class ShippedDir:
    """A driver-side folder in the object store: its path and node there, content digest, the files' bytes."""

    source: str
    node_id: str
    digest: str
    files: ray.ObjectRef = field(compare=False)  # dict[relative path, bytes]


def ship_dir(path: str) -> ShippedDir:
    """Put the folder ``path`` (on this, the driver's, node) in the object store."""
    if not os.path.isdir(path):
        raise ValueError(f"cannot ship {path!r}: not a directory on the driver's node")
    blobs = {}
    for rel in _files(path):
        with open(os.path.join(path, rel), "rb") as f:
            blobs[rel] = f.read()
    node_id = ray.get_runtime_context().get_node_id()
    return ShippedDir(os.path.abspath(path), node_id, dir_digest(path), ray.put(blobs))


def _node() -> str:
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return socket.gethostname()


class NodePaths:
    """Maps a path from the config to one readable on this node; passed to every worker.

    ``shipped``: the driver-built folders by their driver path. ``cache_root``: where shipped
    folders are written on a node that lacks them (default ``<tmp>/rlpad-shipped``).
    """

    def __init__(self, shipped: dict[str, ShippedDir] | None = None, cache_root: str | None = None):
        self.shipped = dict(shipped or {})
        self.cache_root = cache_root

    def __call__(self, path: str) -> str:
        if model_source(path) is not None:  # built in code (tiny:<arch>), no folder
            return path
        if path in self.shipped:
            return self._materialize(self.shipped[path])
        if not os.path.isdir(path):
            raise ValueError(
                f"checkpoint path {path!r} is not a directory on node {_node()}: every node that runs a worker "
                f"must read it (shared storage, or the same copy on each node)"
            )
        return path

    def _materialize(self, item: ShippedDir) -> str:
        if ray.get_runtime_context().get_node_id() == item.node_id and os.path.isdir(item.source):
            return item.source  # the driver's node: read the original
        root = self.cache_root or os.path.join(tempfile.gettempdir(), "rlpad-shipped")
        final = os.path.join(root, f"{os.path.basename(item.source.rstrip(os.sep))}-{item.digest[:16]}")
        marker = os.path.join(final, DIGEST_FILE)
        if os.path.isfile(marker):
            with open(marker) as f:
                if f.read().strip() == item.digest:
                    return final
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        try:
            for rel, data in ray.get(item.files).items():
                os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
                with open(os.path.join(tmp, rel), "wb") as f:
                    f.write(data)
            if dir_digest(tmp) != item.digest:
                raise RuntimeError(f"shipped copy of {item.source!r} does not match its digest")
            with open(os.path.join(tmp, DIGEST_FILE), "w") as f:  # written last: marks a complete copy
                f.write(item.digest)
            try:
                os.rename(tmp, final)
            except OSError:  # another worker on this node finished first, or a stale folder is in the way
                if not os.path.isfile(marker):
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final
