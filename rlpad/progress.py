"""One line of progress for a long step on the console: ``label: k/K (p%), elapsed, ETA, note``; in bytes
(``unit="bytes"``, an export's write): ``label: 1.2 GiB / 2.0 GiB (60%), 3s, 390 MiB/s, ETA 2s``.

On a terminal the line is rewritten in place (at most every ``min_interval_s`` seconds); elsewhere (a
log file, a CI job) a line is printed at every tenth of the work and at the end, so a log holds ten
lines, not thousands. Nothing is printed until the first :meth:`Progress.update`: a step that finds
its result cached stays silent. Written to stderr, beside the warnings, never into the metrics.

    with Progress("warm start of embedded:toy", total=300) as progress:
        train(..., callback=progress.on_step)   # callback(step, loss) after each step
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "format_seconds", "human_bytes"]


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_seconds(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """A progress line for ``total`` units of work (see the module docstring); a context manager that
    ends the line (``done in ...``) when the work started."""

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None, min_interval_s: float = 0.5,
                 unit: str = "steps"):
        if unit not in ("steps", "bytes"):
            raise ValueError(f"Progress unit {unit!r}: steps or bytes")
        self.label, self.total, self.unit = label, max(1, int(total)), unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval_s = min_interval_s
        self.start: float | None = None
        self.done = 0
        self._shown_at = 0.0
        self._tenth = -1
        self._width = 0

    def line(self, note: str = "") -> str:
        """The current line: label, k/K, percentage, elapsed seconds, the ETA at the mean rate so far."""
        elapsed = 0.0 if self.start is None else time.perf_counter() - self.start
        share = f"({100 * self.done / self.total:.0f}%)"
        if self.unit == "bytes":
            parts = [f"{self.label}: {human_bytes(self.done)} / {human_bytes(self.total)} {share}", format_seconds(elapsed)]
            if elapsed > 0:
                parts.append(f"{human_bytes(self.done / elapsed)}/s")
        else:
            parts = [f"{self.label}: {self.done}/{self.total} {share}", format_seconds(elapsed)]
        if 0 < self.done < self.total:
            parts.append(f"ETA {format_seconds(elapsed / self.done * (self.total - self.done))}")
        if note:
            parts.append(note)
        return ", ".join(parts)

    def update(self, done: int, note: str = "") -> None:
        """``done`` units of the total are finished (``note``: a short detail, e.g. the loss)."""
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        self.done = min(max(0, int(done)), self.total)
        if self.tty:
            if now - self._shown_at >= self.min_interval_s or self.done == self.total:
                self._write("\r" + self._padded(self.line(note)))
                self._shown_at = now
        else:
            tenth = self.done * 10 // self.total
            if tenth > self._tenth:
                self._tenth = tenth
                self._write(self.line(note) + "\n")

    def advance(self, units: int, note: str = "") -> None:
        """``units`` more are finished (bytes written, steps done)."""
        self.update(self.done + int(units), note)

    def on_step(self, step: int, loss: float | None = None) -> None:
        """A training loop's ``callback(step, loss)`` (step counted from 0)."""
        self.update(step + 1, "" if loss is None else f"loss {loss:.4f}")

    def close(self, note: str = "") -> None:
        """End the line: ``label: done in <elapsed>`` (nothing if the work never started)."""
        if self.start is None:
            return
        text = f"{self.label}: done in {format_seconds(time.perf_counter() - self.start)}" + (f", {note}" if note else "")
        self._write(("\r" + self._padded(text) if self.tty else text) + "\n")
        self.start = None

    def _padded(self, text: str) -> str:
        self._width = max(self._width, len(text))
        return text.ljust(self._width)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        elif self.start is not None:  # failed: end the line, say where it stopped
            self._write(("\n" if self.tty else "") + f"{self.label}: stopped at {self.done}/{self.total}\n")
            self.start = None
