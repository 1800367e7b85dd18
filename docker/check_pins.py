#!/usr/bin/env python3
"""Check that the GPU image's pins (docker/constraints-gpu.txt) fit together.

Two halves:
- `check(lock)` works offline on docker/gpu-pins.lock.json, the Requires-Dist lines that matter,
  recorded from each pinned package's own metadata. tests/test_docker.py calls it in CI.
- `python docker/check_pins.py [--write]` refreshes those facts from the package index. It reads
  only each wheel's METADATA: PEP 658 `.metadata` files when the index serves them, otherwise
  HTTP range requests into the wheel's zip directory (well under 1% of a 300 MB vllm wheel).
  Packages with no wheel (flash-attn ships an sdist only) are read from the sdist's PKG-INFO
  when the sdist is small. Without --write it exits 1 if the lock no longer matches the index
  or the constraints file.

Run it after changing a pin, then commit the regenerated lock with the constraints.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import re
import sys
import tarfile
import urllib.parse
import urllib.request
import zipfile
from email.parser import HeaderParser
from html import unescape
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
CONSTRAINTS = HERE / "constraints-gpu.txt"
LOCK = HERE / "gpu-pins.lock.json"

# The image's interpreter and platform: markers are evaluated for it, not for this machine.
IMAGE_PYTHON = "3.12"
IMAGE_PYTHON_FULL = "3.12.3"  # Ubuntu 24.04's python3.12
TARGET_ENV = {
    **default_environment(),
    "python_version": IMAGE_PYTHON,
    "python_full_version": IMAGE_PYTHON_FULL,
    "platform_system": "Linux",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
SDIST_MAX_BYTES = 32 << 20


def read_constraints(path: Path = CONSTRAINTS) -> dict[str, str]:
    """{canonical name: exact version} from `name==version` lines; anything looser is an error."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if req.extras or len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise ValueError(f"{path.name}: want a plain `name==version` pin, got {line!r}")
        pins[canonicalize_name(req.name)] = specs[0].version
    return pins


def applies(req: Requirement) -> bool:
    """Does this Requires-Dist line apply to a plain install (no extras) on the image?"""
    return req.marker is None or req.marker.evaluate(TARGET_ENV)


def relevant_requires(requires_dist: list[str], pinned: set[str]) -> dict[str, str]:
    """The requirements on other pinned packages, as {name: specifier}, for the image's platform."""
    out: dict[str, str] = {}
    for line in requires_dist:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in pinned and applies(req):
            spec = str(req.specifier)
            out[name] = ",".join(s for s in (out.get(name), spec) if s)
    return dict(sorted(out.items()))


def check(lock: dict, pins: dict[str, str] | None = None) -> list[str]:
    """Problems with a set of pins, judged by the recorded metadata; [] when they fit together."""
    pins = pins if pins is not None else lock["pins"]
    problems = []
    if lock["pins"] != pins:
        problems.append(f"lock was made for {lock['pins']}, constraints pin {pins}: rerun check_pins.py --write")
    for name, version in pins.items():
        facts = lock["packages"].get(name)
        if facts is None:
            problems.append(f"{name}=={version}: no recorded metadata")
            continue
        if facts["version"] != version:
            problems.append(f"{name}: metadata recorded for {facts['version']}, pinned {version}")
        rp = facts.get("requires_python") or ""
        if rp and Version(IMAGE_PYTHON_FULL) not in SpecifierSet(rp):
            problems.append(f"{name}=={version} needs Python {rp}, the image has {IMAGE_PYTHON}")
        for dep, spec in facts["requires"].items():
            if dep in pins and Version(pins[dep]) not in SpecifierSet(spec, prereleases=True):
                problems.append(f"{name}=={version} requires {dep}{spec}, pinned {dep}=={pins[dep]}")
    return problems


# ---------- reading metadata from the index (only for --write / drift checks) ----------

class RangeFile(io.RawIOBase):
    """A read-only file over HTTP range requests, enough for zipfile to read one member."""

    def __init__(self, url: str):
        head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60)
        if head.headers.get("Accept-Ranges", "").lower() != "bytes":
            raise OSError(f"{url}: server does not take range requests; refusing a full download")
        self.url, self.size, self.pos = url, int(head.headers["Content-Length"]), 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buf):
        end = min(self.size, self.pos + len(buf))
        if end <= self.pos:
            return 0
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        data = urllib.request.urlopen(req, timeout=60).read()
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


def index_files(index: str, name: str) -> list[tuple[str, str, str]]:
    """(filename, url, attributes) for every file of a project on a PEP 503 simple page."""
    page = urllib.request.urlopen(f"{index.rstrip('/')}/{name}/", timeout=60).read().decode()
    out = []
    for attrs, text in re.findall(r"<a\s+([^>]*)>([^<]+)</a>", page):
        href = unescape(re.search(r'href="([^"]+)"', attrs).group(1))
        url = urllib.parse.urljoin(f"{index.rstrip('/')}/{name}/", href.split("#", 1)[0])
        out.append((text.strip(), url, attrs))
    return out


# Wheels pip would pick inside the image: CPython 3.12 on glibc 2.39 (Ubuntu 24.04), x86_64.
_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
_PY = tuple(int(x) for x in IMAGE_PYTHON.split("."))
IMAGE_TAGS = set(cpython_tags(_PY, platforms=_PLATFORMS)) | set(compatible_tags(_PY, platforms=_PLATFORMS))


def fetch_metadata(index: str, name: str, version: str) -> tuple[str, str]:
    """(METADATA text, the file it came from) for name==version."""
    wheels, sdists = [], []
    for filename, url, attrs in index_files(index, name):
        if filename.endswith(".whl"):
            n, v, _, tags = parse_wheel_filename(filename)
            if n == name and v == Version(version) and tags & IMAGE_TAGS:
                wheels.append((filename, url, attrs))
        elif filename.endswith(".tar.gz"):
            n, v = parse_sdist_filename(filename)
            if n == name and v == Version(version):
                sdists.append((filename, url))
    if wheels:
        filename, url, attrs = wheels[0]
        if "data-core-metadata" in attrs or "data-dist-info-metadata" in attrs:
            return urllib.request.urlopen(url + ".metadata", timeout=60).read().decode(), filename
        with zipfile.ZipFile(RangeFile(url)) as zf:
            member = next(m for m in zf.namelist() if m.endswith(".dist-info/METADATA") and m.count("/") == 1)
            return zf.read(member).decode(), filename
    if not sdists:
        raise LookupError(f"{name}=={version}: no wheel for the image and no sdist on {index}")
    filename, url = sdists[0]
    resp = urllib.request.urlopen(url, timeout=60)
    if int(resp.headers.get("Content-Length", 0)) > SDIST_MAX_BYTES:
        raise OSError(f"{filename} is over {SDIST_MAX_BYTES >> 20} MB; record its metadata by hand")
    with tarfile.open(fileobj=io.BytesIO(resp.read()), mode="r:gz") as tf:
        member = min((m for m in tf.getmembers() if m.name.endswith("/PKG-INFO")), key=lambda m: m.name.count("/"))
        return tf.extractfile(member).read().decode(), filename


def build_lock(index: str, pins: dict[str, str], notes: dict) -> dict:
    packages = {}
    for name, version in pins.items():
        text, source = fetch_metadata(index, name, version)
        meta = HeaderParser().parsestr(text)
        packages[name] = {
            "version": meta["Version"],
            "source": source,
            "requires_python": meta.get("Requires-Python", ""),
            "requires": relevant_requires(meta.get_all("Requires-Dist") or [], set(pins) - {name}),
        }
        # torch's CUDA build shows in the cuda-toolkit it depends on; the base image must match it.
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if name == "torch" and canonicalize_name(req.name) == "cuda-toolkit" and applies(req):
                packages[name]["cuda_toolkit"] = str(req.specifier).lstrip("=")
        print(f"{name}=={version}: {packages[name]['requires']}", file=sys.stderr)
    return {
        "checked_on": datetime.date.today().isoformat(),
        "how": "Requires-Dist of each file below, read from the index by docker/check_pins.py",
        "pins": pins, "packages": packages, "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default=os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"))
    ap.add_argument("--write", action="store_true", help="rewrite docker/gpu-pins.lock.json")
    args = ap.parse_args(argv)
    pins = read_constraints()
    old = json.loads(LOCK.read_text()) if LOCK.exists() else {"notes": {}}
    new = build_lock(args.index, pins, old.get("notes", {}))
    problems = check(new, pins)
    for p in problems:
        print("PROBLEM:", p)
    if args.write:
        LOCK.write_text(json.dumps(new, indent=2) + "\n")
        print(f"wrote {LOCK}")
    elif any(new[k] != old.get(k) for k in ("pins", "packages")):
        print("the lock differs from the index: rerun with --write and review the diff")
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
