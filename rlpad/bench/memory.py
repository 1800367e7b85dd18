"""This process's resident memory from /proc (Linux): current RSS, peak RSS (VmHWM), and a reset
of the peak. The one reader every memory measurement uses (LM head, weight sync, sharded init).

VmHWM is this process's own peak; ``resource.getrusage().ru_maxrss`` would carry the parent's
peak over fork + exec, which is why the measurements read /proc.
"""

from __future__ import annotations

__all__ = ["peak_rss_bytes", "reset_peak_rss", "rss_bytes"]


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field} line")


def rss_bytes() -> int:
    """Resident set size now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or the last :func:`reset_peak_rss` (VmHWM)."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS (``/proc/self/clear_refs`` = 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
