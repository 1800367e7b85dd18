"""The docs stay true: relative links in README.md and docs/*.md resolve (file and heading anchor), no
Markdown table appears twice, and the tables of docs/performance.md are the blocks the benchmarks write."""

from __future__ import annotations

import re
from pathlib import Path

from rlpad.bench.table import begin_marker

ROOT = Path(__file__).resolve().parent.parent
SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MARKER = re.compile(r"^<!-- rlpad bench (.+?): (begin|end) -->$")


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The file's lines with fenced code blocks blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def _cells(line: str) -> tuple[str, ...]:
    inner = line.strip().removeprefix("|").removesuffix("|")
    return tuple(" ".join(c.split()) for c in re.split(r"(?<!\\)\|", inner))


def tables(text: str) -> list[tuple[int, tuple[str, ...], tuple[tuple[str, ...], ...]]]:
    """Pipe tables: (1-based line of the header, header cells, body rows), outside code fences."""
    lines, found, i = prose_lines(text), [], 0
    while i < len(lines) - 1:
        if lines[i].lstrip().startswith("|") and SEPARATOR.match(lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            found.append((i + 1, _cells(lines[i]), tuple(_cells(line) for line in lines[i + 2:j])))
            i = j
        else:
            i += 1
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown file (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    for line in prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            seen[base if base not in seen else f"{base}-{seen[base]}"] = 0
            seen[base] = seen.get(base, 0) + 1
    return set(seen)


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """'file:line: target (why)' for each relative link whose file or heading anchor does not exist."""
    problems = []
    for path in files:
        for n, line in enumerate(prose_lines(path.read_text(encoding="utf-8")), 1):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(root)}:{n}"
                if not dest.exists():
                    problems.append(f"{where}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                    problems.append(f"{where}: {target} (no heading #{anchor} in {dest.name})")
    return problems


def duplicate_tables(files: list[Path], root: Path = ROOT) -> list[str]:
    """'a:line and b:line' for each table (same header and rows) that appears more than once."""
    first: dict[tuple, str] = {}
    problems = []
    for path in files:
        for line, header, rows in tables(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(root)}:{line}"
            key = (header, rows)
            if key in first:
                problems.append(f"{first[key]} and {where}: the same table ({' | '.join(header)})")
            else:
                first[key] = where
    return problems


def tables_outside_bench_blocks(text: str) -> list[int]:
    """Header lines of tables that are not inside a `<!-- rlpad bench NAME: begin/end -->` block."""
    inside, spans = None, []
    for n, line in enumerate(text.splitlines(), 1):
        m = MARKER.match(line)
        if m and m.group(2) == "begin":
            assert inside is None, f"line {n}: block {m.group(1)!r} begins inside another"
            inside = (m.group(1), n)
        elif m:
            assert inside and inside[0] == m.group(1), f"line {n}: block {m.group(1)!r} ends without its begin"
            spans.append((inside[1], n))
            inside = None
    assert inside is None, f"block {inside} never ends"
    return [line for line, _, _ in tables(text) if not any(a < line < b for a, b in spans)]


# ---------- the repository's docs ----------

def test_relative_links_resolve():
    assert broken_links(doc_files()) == []


def test_no_table_appears_twice():
    assert duplicate_tables(doc_files()) == []


def test_performance_tables_are_bench_blocks():
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert tables_outside_bench_blocks(text) == [], "type no table in docs/performance.md: a bench writes it"
    assert begin_marker("all") in text and begin_marker("prefix") in text


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    first_screen = "\n".join(lines[:25])
    assert "make demo" in first_screen and "make test" in first_screen and "make test-gpu" in first_screen
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert all(f"\n{target}:" in makefile for target in ("demo", "test", "test-gpu"))
    assert not (ROOT / "docs" / "bench.md").exists()  # the hand copy of a table is gone


# ---------- the checkers can fail (negative controls) ----------

def test_checkers_find_a_broken_link_a_bad_anchor_and_a_repeated_table(tmp_path):
    (tmp_path / "docs").mkdir()
    table = "| a | b |\n|---|---:|\n| 1 | 2 |\n"
    (tmp_path / "README.md").write_text(
        "# Top\n\n[ok](docs/x.md#a-heading-here) [ok](#top) [web](https://example.com/nowhere)\n"
        "`[in code](missing.md)`\n\n```\n[fenced](missing.md)\n| a | b |\n|---|---:|\n| 1 | 2 |\n```\n\n"
        f"{table}\n[gone](docs/missing.md) [bad anchor](docs/x.md#nowhere)\n")
    (tmp_path / "docs" / "x.md").write_text(
        f"## A heading: `here`\n\n{table}\n| a | b |\n|---|---:|\n| 1 | 3 |\n\n![img](../README.md#top)\n")
    files = doc_files(tmp_path)
    assert broken_links(files, tmp_path) == ["README.md:17: docs/missing.md (no such file)",
                                   "README.md:17: docs/x.md#nowhere (no heading #nowhere in x.md)"]
    assert duplicate_tables(files, tmp_path) == ["README.md:13 and docs/x.md:3: the same table (a | b)"]  # not the 1 | 3 one


def test_anchors_follow_github():
    text = "# Sharded initialisation: `python -m workers.init_bench`\n## On a GPU: `--device cuda`\n## Notes\n## Notes\n"
    assert anchors(text) == {"sharded-initialisation-python--m-workersinit_bench", "on-a-gpu---device-cuda",
                             "notes", "notes-1"}


def test_a_typed_table_in_performance_is_found():
    block = f"{begin_marker('prefix')}\nheader\n\n| x |\n|---|\n| 1 |\n<!-- rlpad bench prefix: end -->\n"
    assert tables_outside_bench_blocks(block) == []
    assert tables_outside_bench_blocks(block + "\n| typed |\n|---|\n| 2 |\n") == [9]


LEARNING_FIGURE = re.compile(r"validation(?: reward)?\W*\d\.\d+\W*->\W*\d\.\d+")


def test_learning_figures_name_their_cpu():
    """A learning trajectory is the CPU's (float results depend on the vector unit torch's kernels use:
    0.280 -> 0.510 on AVX2, 0.160 -> 0.480 on AVX-512 for the same demo), so every "validation
    reward A -> B" in the docs names the vector unit in its table row or paragraph."""
    found = []
    for path in doc_files():
        lines = prose_lines(path.read_text())
        paragraphs = "\n".join(line if line.strip() and not line.lstrip().startswith("|") else "\n" + line + "\n"
                               for line in lines).split("\n\n")
        for block in paragraphs:
            for m in LEARNING_FIGURE.finditer(block):
                found.append(path.name)
                assert "AVX" in block, f"{path.name}: {m.group(0)!r} does not name its CPU (AVX2 / AVX-512): {block!r}"
    assert found.count("README.md") >= 2 and "performance.md" in found  # the check sees the figures


def test_no_learning_test_pins_a_trajectory():
    """The tests that check learning ask for a margin (reward up by more than X), never the figures of one
    CPU's trajectory quoted in the docs."""
    figures = set()
    for path in doc_files():
        for m in LEARNING_FIGURE.finditer(path.read_text()):
            figures.update(re.findall(r"\d\.\d{3}", m.group(0)))  # 3 decimals: a run's figure, not a round one
    assert {"0.280", "0.510", "0.160", "0.480"} <= figures
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "test_docs.py":
            continue
        text = path.read_text()
        pinned = [f for f in figures if re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", text)]
        assert not pinned, f"{path.relative_to(ROOT)} pins a learning figure of the docs: {pinned}"
