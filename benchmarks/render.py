"""Render every table of measured numbers in README.md and docs/*.md from benchmarks/results.

    python benchmarks/render.py            rewrite the rendered blocks of every page
    python benchmarks/render.py --check    change nothing; exit 1 naming each block that differs

A page holds a rendered block as::

    <!-- rendered: NAME -->
    | the table ... |

    Measured by (result file: command, wall time, date, commit):
    - `benchmarks/results/...json`: `rfkit ...` (9.6 min, 2026-11-25, 050d752)
    <!-- /rendered -->

``NAME`` is a renderer in ``benchmarks/tables/`` (it reads result files, each of which carries
the command that wrote it: :mod:`rfkit.provenance`). Everything between the two markers is
replaced. A table that holds no measurement (options, messages, settings) is marked by the line
``<!-- static table -->`` right above it; ``tests/test_rendered_pages.py`` fails on any other
table that is not rendered, and on any block that differs from its files.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from rfkit.atomic import atomic_write_text

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tables import ROOT, render  # noqa: E402

START = re.compile(r"^<!-- rendered: ([A-Za-z0-9_.-]+) -->$")
END = "<!-- /rendered -->"
STATIC = "<!-- static table -->"


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


class PageError(Exception):
    pass


def blocks(text: str, where: str) -> list[tuple[str, int, int]]:
    """``(name, first line, end marker line)`` of every rendered block (0-based line numbers)."""
    lines = text.split("\n")
    found, i = [], 0
    while i < len(lines):
        m = START.match(lines[i])
        if m:
            try:
                end = lines.index(END, i + 1)
            except ValueError:
                raise PageError(f"{where}:{i + 1}: '{lines[i]}' has no '{END}'") from None
            found.append((m.group(1), i, end))
            i = end
        i += 1
    return found


def rendered_page(text: str, where: str) -> str:
    """The page with every block replaced by its renderer's output."""
    lines = text.split("\n")
    out, last = [], 0
    for name, start, end in blocks(text, where):
        body, _ = render(name)
        out += lines[last : start + 1] + body.split("\n")
        last = end
    out += lines[last:]
    return "\n".join(out)


def unrendered_tables(text: str) -> list[int]:
    """1-based line numbers of tables that are neither inside a rendered block nor marked static."""
    lines = text.split("\n")
    inside = set()
    for _, start, end in blocks(text, "page"):
        inside.update(range(start, end + 1))
    bad = []
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")) and i not in inside:
            if i == 0 or lines[i - 1].strip() != STATIC:
                bad.append(i + 1)
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page differs from its files")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = rendered_page(text, str(page.relative_to(ROOT)))
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                atomic_write_text(page, new)
    verb = "differ from their result files" if args.check else "rewritten"
    print(f"{len(stale)} page(s) {verb}" + (": " + ", ".join(stale) if stale else ""))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
