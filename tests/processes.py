"""Whether a process is still running, by PID (Linux /proc): the tests that check nothing is left behind."""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    """True once the process is gone, polled every 50 ms for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)
