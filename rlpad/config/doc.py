"""Every config key with its value, type and meaning, read from the comments of the schema (the modules
of rlpad/config/ in :data:`SCHEMA_MODULES`).

The dataclasses are the one source: a field's meaning is its trailing ``# ...`` comment and/or the
comment lines right above it, a section's meaning is its class docstring (parsed with ``ast`` and
``tokenize``, so nothing is written twice). ``rlpad config [recipe] [overrides]`` prints
:func:`format_console`; ``rlpad config --markdown docs/configuration.md`` writes :func:`markdown`
(tests/test_config_doc.py fails when the committed file is stale or a field has no meaning).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import shutil
import sys
import textwrap
import tokenize
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import rlpad.config.checkpoint
import rlpad.config.code
import rlpad.config.distillation
import rlpad.config.rewards
import rlpad.config.rollout
import rlpad.config.schema
import rlpad.config.streaming
import rlpad.config.vision
from rlpad.config.schema import Config

__all__ = ["Key", "Section", "describe", "format_console", "format_value", "markdown", "missing_meanings",
           "parse_source"]

MARKDOWN_COMMAND = "rlpad config --markdown docs/configuration.md"


@dataclass(frozen=True)
class Key:
    """One leaf key: its dotted name, value, declared type (as written) and meaning."""

    name: str
    value: Any
    default: Any
    type: str
    meaning: str


@dataclass(frozen=True)
class Section:
    """A section (one dataclass instance) at a dotted path, with its leaf keys in declaration order."""

    path: str
    cls: str
    meaning: str
    keys: tuple[Key, ...]


# The modules whose dataclasses make up the schema: their comments are the keys' meanings.
SCHEMA_MODULES = (rlpad.config.schema, rlpad.config.rewards, rlpad.config.rollout, rlpad.config.code,
                  rlpad.config.distillation, rlpad.config.checkpoint, rlpad.config.vision, rlpad.config.streaming)


def _one_line(text: str) -> str:
    """Whitespace collapsed; reST ``code`` becomes Markdown `code`."""
    return " ".join(text.split()).replace("``", "`")


@cache
def _parsed() -> tuple[dict[str, dict[str, tuple[str, str]]], dict[str, str]]:
    """:func:`parse_source` of the schema's modules (:data:`SCHEMA_MODULES`), merged."""
    fields: dict[str, dict[str, tuple[str, str]]] = {}
    docs: dict[str, str] = {}
    for module in SCHEMA_MODULES:
        more_fields, more_docs = parse_source(inspect.getsource(module))
        fields.update(more_fields)
        docs.update(more_docs)
    return fields, docs


def parse_source(source: str) -> tuple[dict[str, dict[str, tuple[str, str]]], dict[str, str]]:
    """``({class: {field: (type as written, meaning)}}, {class: docstring})`` of the classes in ``source``.

    A field's meaning: the block of comment lines right above it (no blank line between) and its
    trailing comment, joined into one line; "" when it has neither.
    """
    comments: dict[int, tuple[str, bool]] = {}  # line -> (comment text, whole line is the comment)
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.start[0] not in code_lines)
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    fields: dict[str, dict[str, tuple[str, str]]] = {}
    docs: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = _one_line(ast.get_docstring(node) or "")
        fields[node.name] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            line = stmt.lineno - 1
            while line in comments and comments[line][1]:  # the comment block right above the field
                above.insert(0, comments[line][0])
                line -= 1
            trailing = [comments[n][0] for n in range(stmt.lineno, stmt.end_lineno + 1)
                        if n in comments and not comments[n][1]]
            meaning = _one_line(" ".join(above + trailing))
            fields[node.name][stmt.target.id] = (ast.get_source_segment(source, stmt.annotation) or "", meaning)
    return fields, docs


def describe(config: Config | None = None, choices: Mapping[str, Sequence[str]] | None = None) -> list[Section]:
    """Every section of ``config`` (default: the defaults), depth first in declaration order. ``choices``:
    dotted key -> the names a registry above this package holds (rlpad.recipe.checks.registry_choices),
    appended to the key's meaning."""
    config = config if config is not None else Config()
    choices = choices or {}
    fields, docs = _parsed()
    sections: list[Section] = []

    def walk(obj: Any, default: Any, path: str, meaning: str) -> None:
        cls = type(obj).__name__
        keys: list[Key] = []
        nested: list[tuple[Any, Any, str, str]] = []
        for f in dataclasses.fields(obj):
            value, dflt = getattr(obj, f.name), getattr(default, f.name)
            tp, text = next(fields[c.__name__][f.name] for c in type(obj).__mro__  # an inherited field: its base's
                            if f.name in fields.get(c.__name__, {}))
            name = f"{path}.{f.name}" if path else f.name
            if dataclasses.is_dataclass(value):
                doc = docs[type(value).__name__]
                nested.append((value, dflt, name, f"{text}. {doc}" if text and doc else text or doc))
            else:
                if name in choices:
                    text = f"{text}; one of: {' | '.join(choices[name])}"
                keys.append(Key(name, value, dflt, tp, text))
        sections.append(Section(path, cls, meaning, tuple(keys)))
        for args in nested:
            walk(*args)

    walk(config, Config(), "", docs["Config"])
    return [s for s in sections if s.keys]


def missing_meanings() -> list[str]:
    """Fields of the schema without a comment, and dataclasses without a docstring (should be []).
    A section field (its type is a dataclass) needs no comment: its class docstring says what it is."""
    fields, docs = _parsed()
    out = [f"{cls} (class docstring)" for cls, doc in docs.items() if not doc]
    out += [f"{cls}.{name}" for cls, fs in fields.items() for name, (tp, meaning) in fs.items()
            if not meaning and tp not in docs]
    return out


def format_value(value: Any) -> str:
    """A value as a recipe writes it: null, true/false, [a, b], strings bare ("" when empty)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, str):
        return value or '""'
    return repr(value)


def format_console(sections: list[Section], width: int | None = None) -> str:
    """The keys as aligned text, section by section: ``key  value  type  meaning``, the meaning wrapped
    to ``width`` (default: the terminal's; 0: never); ``*`` marks a value that is not the default."""
    if width is None:  # a terminal: wrap to it; a pipe: one line per key (for grep)
        width = max(shutil.get_terminal_size().columns, 80) if sys.stdout.isatty() else 0
    out: list[str] = []
    for s in sections:
        out += ["", f"# {s.path}: {s.meaning}"]
        values = [format_value(k.value) + ("*" if k.value != k.default else "") for k in s.keys]
        w_key = max(len(k.name) for k in s.keys)
        w_val = min(max(map(len, values)), 24)
        w_type = max(len(k.type) for k in s.keys)
        indent = w_key + w_val + w_type + 6
        for k, value in zip(s.keys, values):
            head = f"{k.name:<{w_key}}  {value:<{w_val}}  {k.type:<{w_type}}  "
            if width and len(head) > indent:  # a long value: the meaning starts on the next line
                out.append(head.rstrip())
                head = " " * indent
            wrapped = (textwrap.wrap(k.meaning, max(width - indent, 30)) if width else [k.meaning]) or [""]
            out.append(head + wrapped[0])
            out += [" " * indent + line for line in wrapped[1:]]
    out += ["", "* = not the default"]
    return "\n".join(out[1:])


def _cell(text: str) -> str:
    """``text`` safe in a Markdown table cell: pipes escaped, and ``<``/``>`` outside `code` too."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def markdown(sections: list[Section] | None = None, *, value_label: str = "default") -> str:
    """docs/configuration.md: one section per dataclass instance, a table of key | default | type | meaning."""
    sections = sections if sections is not None else describe()
    lines = ["# Configuration", "",
             f"Generated by `{MARKDOWN_COMMAND}` from the field comments and docstrings of the schema,",
             f"`rlpad/config/` ({', '.join(m.__name__.rsplit('.', 1)[1] + '.py' for m in SCHEMA_MODULES)}); do not edit by hand",
             "(tests/test_config_doc.py fails when it is stale).",
             "A recipe sets any of these keys in YAML; `a.b.c=value` on the command line overrides it;",
             "`rlpad config <recipe> [overrides]` prints the resolved values.", ""]
    for s in sections:
        title = s.path or "top level"
        lines += [f"## `{title}`", "", f"{s.cls}: {_cell(s.meaning)}" if s.meaning else s.cls, "",
                  f"| key | {value_label} | type | meaning |", "|---|---|---|---|"]
        for k in s.keys:
            lines.append(f"| `{k.name}` | `{_cell(format_value(k.value))}` | `{_cell(k.type)}` | {_cell(k.meaning)} |")
        lines.append("")
    return "\n".join(lines)
