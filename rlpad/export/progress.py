"""A progress line for a long write: bytes done of the total, seconds, rate and time left.

On a terminal the line is redrawn in place (at most 10 times a second); elsewhere (a log file, CI) a line
is printed at a tenth of the total at most every 5 seconds, and one at the end, so a log keeps a short trace.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["LOG_EVERY_S", "Progress", "human_bytes"]

LOG_EVERY_S = 5.0  # off a terminal: the least seconds between two progress lines


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    """``label: 1.2 GiB / 2.0 GiB (60%), 3.1 s, 390 MiB/s, ~2 s left``, written to ``stream``."""

    def __init__(self, label: str, total_bytes: int, stream: TextIO | None = None):
        self.label, self.total = label, max(int(total_bytes), 1)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done, self.start, self._tenth = 0, time.perf_counter(), 0
        self._drawn = self.start if not self.tty else 0.0

    def line(self) -> str:
        seconds = time.perf_counter() - self.start
        rate = self.done / seconds if seconds > 0 else 0.0
        left = f", ~{(self.total - self.done) / rate:.0f} s left" if 0 < self.done < self.total and rate > 0 else ""
        return (f"{self.label}: {human_bytes(self.done)} / {human_bytes(self.total)} ({self.done / self.total:.0%}), "
                f"{seconds:.1f} s, {human_bytes(rate)}/s{left}")

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more done; redraw when due."""
        self.done += nbytes
        now = time.perf_counter()
        if self.tty:
            if now - self._drawn >= 0.1:
                self._drawn = now
                self.stream.write("\r" + self.line() + "\033[K")
                self.stream.flush()
        else:
            tenth = min(9, self.done * 10 // self.total)
            if tenth > self._tenth and now - self._drawn >= LOG_EVERY_S:
                self._tenth, self._drawn = tenth, now
                print(self.line(), file=self.stream, flush=True)

    def finish(self) -> float:
        """Print the final line (on a terminal: over the last one); returns the seconds since the start."""
        self.stream.write(("\r" + self.line() + "\033[K\n") if self.tty else self.line() + "\n")
        self.stream.flush()
        return time.perf_counter() - self.start
