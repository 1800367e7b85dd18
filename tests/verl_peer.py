"""verl 0.9.1 as the parity tests' peer: where a Python with verl is, and what one of scripts/verl_*.py
prints, from its recorded fixture (always) or run live in verl's own interpreter (where verl is at hand:
``$RLPAD_VERL_PYTHON``, or verl importable here)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

from paths import ROOT

__all__ = ["RecordedPeer", "verl_python"]


def verl_python() -> str | None:
    """``$RLPAD_VERL_PYTHON``, or this Python if it has verl, else None."""
    if os.environ.get("RLPAD_VERL_PYTHON"):
        return os.environ["RLPAD_VERL_PYTHON"]
    return sys.executable if importlib.util.find_spec("verl") is not None else None


class RecordedPeer:
    """The output of ``scripts/<recorder>`` (a JSON object): ``tests/fixtures/<fixture>`` or a live run."""

    def __init__(self, fixture: str, recorder: str):
        self.fixture, self.recorder = Path(ROOT) / "tests" / "fixtures" / fixture, Path(ROOT) / "scripts" / recorder

    @cache
    def recorded(self) -> dict:
        return json.loads(self.fixture.read_text())

    @cache
    def live(self) -> dict:
        """The recorder run by verl's Python (no PYTHONPATH: its own packages, not this checkout's)."""
        out = subprocess.run([verl_python(), str(self.recorder)], capture_output=True, text=True, timeout=600,
                             cwd=Path(ROOT) / "tests", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    def record(self, source: str) -> dict:
        """``"recorded"`` or ``"live"``."""
        return self.recorded() if source == "recorded" else self.live()

    @staticmethod
    def sources() -> list[str]:
        """The sources to compare: the recorded one always, the live one where verl is at hand."""
        return ["recorded"] + (["live"] if verl_python() else [])
