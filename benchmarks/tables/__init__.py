"""The renderers of every table of measured numbers in README.md and docs/ (``benchmarks/render.py``).

A renderer is a function that reads result files with :func:`load` and returns a Markdown table::

    @table("speed_b05")
    def speed_b05() -> str:
        speed = load("speed_smollm2_b05_fast/speed.json")
        ...

:func:`render` runs one and appends, for every file it read, the command that wrote the file, its
wall time, date and commit (the file's ``provenance`` block, :mod:`rfkit.provenance`). A file
without one is an error: a number on a page must name the command that measured it.

Each module of this package holds the tables of one subject; they are imported on first use.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
ROOT = RESULTS.parent.parent
TABLES: dict[str, Callable[[], str]] = {}
_read: list[Path] = []


class RenderError(Exception):
    """A renderer that cannot run: a missing file, or a file without provenance."""


def table(name: str):
    """Register a renderer under the name pages write in ``<!-- rendered: NAME -->``."""

    def register(fn: Callable[[], str]) -> Callable[[], str]:
        if name in TABLES:
            raise RenderError(f"two renderers are named {name!r}")
        TABLES[name] = fn
        return fn

    return register


def load(relpath: str) -> dict:
    """A result file under ``benchmarks/results``, recorded as a source of the table being rendered."""
    path = RESULTS / relpath
    if not path.is_file():
        raise RenderError(f"{path.relative_to(ROOT)}: no such result file")
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("provenance"), dict):
        raise RenderError(f"{path.relative_to(ROOT)}: no provenance block (command, date, commit, wall time)")
    if path not in _read:
        _read.append(path)
    return data


def provenance(data: dict) -> dict:
    return data["provenance"]


def _minutes(seconds) -> str:
    if seconds is None:
        return "wall time not recorded"
    seconds = float(seconds)
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def source_lines(paths: list[Path]) -> list[str]:
    """One line per file: where it is and what wrote it."""
    lines = []
    for path in paths:
        p = json.loads(path.read_text())["provenance"]
        commit = (p.get("commit") or "no commit")[:7]
        when = (p.get("date") or "")[:10]
        note = "; provenance backfilled" if p.get("backfilled") else ""
        note += f"; {p['machine']}" if p.get("machine") else ""  # recorded since 2026-11-27
        lines.append(f"- `{path.relative_to(ROOT)}`: `{p['command']}` ({_minutes(p.get('wall_seconds'))}, {when}, {commit}{note})")
    return lines


def _import_all() -> None:
    if getattr(_import_all, "done", False):
        return
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__name__}.{info.name}")
    _import_all.done = True


def names() -> list[str]:
    _import_all()
    return sorted(TABLES)


def render(name: str) -> tuple[str, list[Path]]:
    """The block's text (table, blank line, sources) and the files it read."""
    _import_all()
    if name not in TABLES:
        raise RenderError(f"no renderer named {name!r} (known: {', '.join(sorted(TABLES))})")
    _read.clear()
    body = TABLES[name]().rstrip("\n")
    paths = list(_read)
    if not paths:
        raise RenderError(f"renderer {name!r} read no result file")
    text = body + "\n\nMeasured by (result file: command, wall time, date, commit):\n" + "\n".join(source_lines(paths))
    return text, paths
