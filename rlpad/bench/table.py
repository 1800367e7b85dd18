"""One table formatter for every benchmark: aligned text for the console, Markdown for the docs.

A benchmark turns its result into :class:`Table` s (cells already formatted); :func:`show` prints
them and, with ``--markdown PATH``, :func:`write_markdown` writes them into PATH between the
markers ``<!-- rlpad bench NAME: begin -->`` and ``<!-- rlpad bench NAME: end -->`` (replacing
what was there, or appending the block), under a line with the command, the date, the machine
and its load average. Tables in the docs are written this way, never typed. :func:`write_json`
writes a benchmark's whole result next to them.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Table", "begin_marker", "end_marker", "format_markdown", "format_text", "machine", "show",
           "write_json", "write_markdown"]


@dataclass
class Table:
    """A titled table of formatted cells, with note lines under it (a table may be notes only).

    ``align``: one character per column, ``l`` or ``r``; default: the first column left, the rest right.
    """

    columns: Sequence[str] = ()
    rows: list[Sequence[str]] = field(default_factory=list)
    title: str = ""
    notes: list[str] = field(default_factory=list)
    align: str = ""

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"table {self.title!r}: a row has {len(row)} cells for {len(self.columns)} columns")
        self.align = self.align or ("l" + "r" * (len(self.columns) - 1) if self.columns else "")
        if len(self.align) != len(self.columns) or set(self.align) - {"l", "r"}:
            raise ValueError(f"table {self.title!r}: align={self.align!r} needs one l or r per column")


def format_text(tables: Sequence[Table]) -> str:
    """The tables as aligned console text: title, header, a rule, rows, notes; a blank line between tables."""
    blocks = []
    for t in tables:
        lines = [t.title] if t.title else []
        if t.columns:
            widths = [max(len(str(c)) for c in col) for col in zip(t.columns, *t.rows)]

            def fmt(cells: Sequence[str]) -> str:
                return "  ".join(str(c).ljust(w) if a == "l" else str(c).rjust(w)
                                 for c, w, a in zip(cells, widths, t.align)).rstrip()

            header = fmt(t.columns)
            lines += [header, "-" * len(header), *map(fmt, t.rows)]
        lines += t.notes
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def format_markdown(tables: Sequence[Table]) -> str:
    """The tables in Markdown: title paragraph, a pipe table (alignment from ``align``), note paragraphs."""
    blocks = []
    for t in tables:
        parts = [t.title] if t.title else []
        if t.columns:
            rule = "|" + "|".join("---:" if a == "r" else "---" for a in t.align) + "|"
            rows = ["| " + " | ".join(_cell(c) for c in row) + " |" for row in t.rows]
            parts.append("\n".join(["| " + " | ".join(_cell(c) for c in t.columns) + " |", rule, *rows]))
        parts += t.notes
        blocks.append("\n\n".join(parts))
    return "\n\n".join(blocks) + "\n"


def machine() -> str:
    """``2 cores (AMD EPYC 7B13, AVX2 kernels)``: the CPU count, model name and the vector unit torch's
    kernels use (:func:`rlpad.training.metrics.cpu_kernels`)."""
    from rlpad.training.metrics import cpu_kernels

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores ({cpu}, {cpu_kernels()} kernels)"


def begin_marker(name: str) -> str:
    return f"<!-- rlpad bench {name}: begin -->"


def end_marker(name: str) -> str:
    return f"<!-- rlpad bench {name}: end -->"


def write_markdown(path: str, name: str, tables: Sequence[Table], *, command: str,
                   load: tuple[float, float, float] | None = None, date: str | None = None) -> None:
    """Write ``tables`` into the Markdown file ``path`` as the block of bench ``name``.

    The block replaces the text between its markers when the file has them, else it is appended
    (the file and its folder are created when missing). Above the tables: the command, the date,
    :func:`machine` and ``load`` (the 1/5/15-minute load average when the benchmark started).
    """
    begin, end = begin_marker(name), end_marker(name)
    load_text = f", load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at the start" if load else ""
    header = f"`{command}`, {date or time.strftime('%Y-%m-%d')}, {machine()}{load_text}"
    block = f"{begin}\n{header}\n\n{format_markdown(tables)}{end}"
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    found = [m.start() for m in re.finditer(re.escape(begin), text)], [m.start() for m in re.finditer(re.escape(end), text)]
    if found == ([], []):
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n"
    elif len(found[0]) == 1 and len(found[1]) == 1 and found[0][0] < found[1][0]:
        text = text[:found[0][0]] + block + text[found[1][0] + len(end):]
    else:
        raise ValueError(f"{path}: the markers of bench {name!r} are broken (need one {begin!r} before one {end!r}); "
                         "fix or remove them")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def show(name: str, tables: Sequence[Table], *, markdown: str | None = None, command: str = "",
         load: tuple[float, float, float] | None = None) -> None:
    """Print ``tables``; with ``markdown``, also write them there as bench ``name``'s block."""
    print("\n" + format_text(tables), flush=True)
    if markdown:
        write_markdown(markdown, name, tables, command=command or f"rlpad bench {name}", load=load)
        print(f"wrote the {name} table to {markdown}")


def write_json(result: dict, path: str, *, indent: int = 2) -> None:
    """Write a benchmark's ``result`` as JSON to ``path`` (parent folders created) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
    print(f"wrote {path}", flush=True)
