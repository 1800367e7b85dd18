"""The timeline picture of ``rlpad bench stream``: who is busy when, in the synchronous loop and in streaming.

Streaming: the run's ``stream_timeline.json`` (written by rlpad.training.streaming: each engine's busy
intervals, the trainer's waits, the weight loads, the steps' ends, seconds since the loop started). The
synchronous loop measures no intervals, only each step's stage seconds, so its lanes are rebuilt from them:
a step is its generation (``timing_s/gen``, every engine) then the trainer's stages (the rest of
``timing_s/step_wall``). Lanes: one per engine, then the trainer (busy = not waiting for rollouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["complement", "draw", "sync_lanes", "stream_lanes"]

Spans = list[tuple[float, float]]


def complement(spans: Sequence[Sequence[float]], start: float, end: float) -> Spans:
    """[start, end] minus the (sorted, non-overlapping) ``spans``."""
    out, t = [], start
    for a, b in spans:
        if b <= start or a >= end:
            continue
        if a > t:
            out.append((t, a))
        t = max(t, b)
    return out + ([(t, end)] if t < end else [])


def sync_lanes(history: Sequence[dict[str, Any]], engines: int, skip: int) -> tuple[dict[str, Spans], float]:
    """Lanes of the synchronous loop's steps after ``skip`` (rebuilt from stage seconds), and their span."""
    t, busy, trainer = 0.0, [], []
    for r in [r for r in history if "timing_s/step_wall" in r][skip:]:
        wall, gen = r["timing_s/step_wall"], r.get("timing_s/gen", 0.0)
        busy.append((t, t + gen))
        trainer.append((t + gen, t + wall))
        t += wall
    return {**{f"engine {i}": busy for i in range(engines)}, "trainer": trainer}, t


def stream_lanes(timeline: dict[str, Any], skip: int) -> tuple[dict[str, Spans], float, Spans]:
    """Lanes of the streaming run from the end of step ``skip``, shifted to start at 0; their span; the loads."""
    ends = timeline["step_ends"]
    start, end = (ends[skip - 1] if skip else 0.0), ends[-1]

    def clip(spans: Sequence[Sequence[float]]) -> Spans:
        return [(max(a, start) - start, min(b, end) - start) for a, b in spans if b > start and a < end]

    lanes = {f"engine {i}": clip(b) for i, b in enumerate(timeline["engines"])}
    lanes["trainer"] = clip(complement(timeline["trainer_wait"], start, end))
    return lanes, end - start, clip(timeline["loads"])


def draw(path: str, panels: Sequence[tuple[str, dict[str, Spans], float, Spans]], seconds: float) -> str | None:
    """One panel per (title, lanes, span, weight loads), the first ``seconds`` of each on one time scale; a PNG at
    ``path`` (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.1 + 0.55 * sum(len(p[1]) for p in panels)), sharex=True)
    for ax, (title, lanes, _span, loads) in zip(list(getattr(axes, "flat", [axes])), panels):
        names = list(lanes)
        for y, name in enumerate(reversed(names)):
            spans = [(a, b - a) for a, b in lanes[name] if a < seconds]
            ax.broken_barh(spans, (y + 0.15, 0.7), color="tab:orange" if name == "trainer" else "tab:blue")
        for a, b in loads:
            if a < seconds:
                ax.axvspan(a, b, color="tab:red", alpha=0.25, lw=0)
        ax.set_yticks([y + 0.5 for y in range(len(names))], list(reversed(names)))
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlim(0, seconds)
    axes_list = list(getattr(axes, "flat", [axes]))
    axes_list[-1].set_xlabel("seconds (busy: engine = requests in flight, trainer = not waiting; red: weight loads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
