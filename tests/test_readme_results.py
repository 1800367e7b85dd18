"""README's results table stays true: every row names its machine and the day it was measured, and every
figure a row cites is held by the page the row links to (or by a GPU report under docs/gpu/), as
written or rounded from a figure written there with more digits; the day is on that page too."""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

from test_docs import tables

ROOT = Path(__file__).resolve().parent.parent
HEADER = ("what", "result", "machine", "command", "measured")
NUMBER = re.compile(r"(?<![\w.\-])-?\d+(?:\.\d+)?(?:e-?\d+)?")  # not inside a word, a date or a range's end
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def results_rows(readme: str) -> tuple[tuple[str, ...], ...]:
    found = [rows for _, header, rows in tables(readme) if header == HEADER]
    assert len(found) == 1, f"README.md has {len(found)} results tables with the columns {HEADER}"
    return found[0]


def figures(cell: str) -> list[str]:
    """The numbers a result cell cites (dates and code spans left out)."""
    text = DATE.sub(" ", re.sub(r"`[^`]*`", " ", cell))
    return NUMBER.findall(text)


def _places(figure: str) -> int:
    """The exponent of a figure's last written digit: 1.66 -> -2, 4.0e-5 -> -6, 61 -> 0."""
    return Decimal(figure).as_tuple().exponent


def holds(text: str, figure: str) -> bool:
    """``text`` writes ``figure``, or a number with more digits that rounds to it (4.02e-05 holds 4.0e-5,
    1.217 holds 1.22; 1.2 does not hold 1.22)."""
    value, places = Decimal(figure), _places(figure)
    half = Decimal(1).scaleb(places) / 2
    for written in NUMBER.findall(text):
        if _places(written) <= places and abs(Decimal(written) - value) <= half:
            return True
    return False


def page_of(what: str, root: Path) -> Path:
    link = re.search(r"\]\(([^)#]+)", what)
    assert link, f"the row {what[:60]!r} links no page"
    return root / link.group(1)


def problems(readme: str, root: Path = ROOT) -> list[str]:
    reports = "\n".join(p.read_text(encoding="utf-8") for p in sorted((root / "docs" / "gpu").glob("*.md")))
    out = []
    for what, result, machine, _command, measured in results_rows(readme):
        name = re.sub(r"\]\(.*", "", what).lstrip("[")
        if not machine.strip():
            out.append(f"{name}: no machine")
        days = DATE.findall(measured)
        if not days:
            out.append(f"{name}: no date measured")
        page = page_of(what, root)
        text = page.read_text(encoding="utf-8")
        out += [f"{name}: {page.name} does not say {day}" for day in days if day not in text + reports]
        out += [f"{name}: no doc holds {figure}" for figure in figures(result) if not holds(text + "\n" + reports, figure)]
    return out


def test_every_row_is_held_by_its_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(results_rows(readme)) >= 15
    assert problems(readme) == []


def test_the_check_finds_a_figure_no_page_holds(tmp_path):
    (tmp_path / "docs" / "gpu").mkdir(parents=True)
    (tmp_path / "docs" / "page.md").write_text("Measured 2026-11-23: step 1.217 s, error 4.02e-05, 61 s.\n")
    (tmp_path / "docs" / "gpu" / "report.md").write_text("2026-11-27: 2.39 GiB\n")
    row = "| [x](docs/page.md) | {} | a CPU | `cmd` | {} |"
    head = "| " + " | ".join(HEADER) + " |\n|---|---|---|---|---|\n"
    good = head + row.format("1.22 s, 4.0e-5, 61 s, 2.39 GiB", "2026-11-23") + "\n"
    assert problems(good, tmp_path) == []
    bad = head + row.format("1.2 s and 1.23 s, 5.0e-5, 62 s", "2026-11-24") + "\n"
    assert problems(bad, tmp_path) == ["x: page.md does not say 2026-11-24", "x: no doc holds 1.23",
                                       "x: no doc holds 5.0e-5", "x: no doc holds 62"]
    no_machine = head + row.format("1.22 s", "2026-11-23").replace("a CPU", " ") + "\n"
    assert problems(no_machine, tmp_path) == ["x: no machine"]
