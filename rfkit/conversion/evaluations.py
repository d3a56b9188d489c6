"""What was measured on a saved converted model, kept with it: ``evaluations.json`` and a
section of its model card (``README.md``).

``rfkit eval`` and ``rfkit bench`` run on a converted model directory add their numbers here
(``--no-record`` leaves the directory alone), so a shared model carries the evidence for it.
One *record* is one evaluation at fixed settings (``key``): a table whose rows are measures
("passkey accuracy, 2,048 tokens") and whose columns are the models measured ("original",
"converted", a baseline). Running the same evaluation again at the same settings updates its
cells and keeps the others, so ``rfkit eval passkey --model DIR`` and the same command with
``--original`` fill the two columns of one table. Each column keeps the command that measured it.

The card's section sits between two HTML comments (:data:`START`, :data:`END`) before
``## Recipe``; it is rewritten from ``evaluations.json`` whenever a record changes, so the
card never disagrees with the file.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from rfkit.atomic import atomic_write_text

FILE = "evaluations.json"
CARD = "README.md"
START = "<!-- rfkit:evaluations -->"
END = "<!-- /rfkit:evaluations -->"
FIRST_COLUMNS = ("original", "converted")  # shown first, and the ratio column compares them


def load(model_dir: str | Path) -> dict:
    """``{key: record}`` of a model directory (empty when nothing was recorded)."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("records", {})


def record(
    model_dir: str | Path,
    key: str,
    title: str,
    rows: dict[str, dict[str, float | None]],
    commands: dict[str, str] | None = None,
    formats: dict[str, str] | None = None,
) -> Path:
    """Add or update one record and rewrite the card's section; returns the card's path.

    Args:
        model_dir: A converted model directory (its ``README.md`` is the card).
        key: The evaluation and the settings that make its numbers comparable; the same key
            updates the same table.
        title: The table's heading in the card.
        rows: ``{measure: {column: value}}``; a column absent here keeps its old value.
        commands: ``{column: command line}`` that measured each column.
        formats: ``{measure: format spec}`` for the card (default ``.4g``).
    """
    model_dir = Path(model_dir)
    records = load(model_dir)
    entry = records.setdefault(key, {"title": title, "rows": {}, "commands": {}, "measured": {}, "formats": {}})
    entry["title"] = title
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    for measure, cells in rows.items():
        entry["rows"].setdefault(measure, {}).update({c: v for c, v in cells.items() if v is not None})
        for column in cells:
            entry["measured"][column] = today
    entry["commands"].update(commands or {})
    entry["formats"].update(formats or {})
    atomic_write_text(model_dir / FILE, json.dumps({"records": records}, indent=2) + "\n")
    return rewrite_card(model_dir)


def rewrite_card(model_dir: str | Path) -> Path:
    """Rewrite the card's section from ``evaluations.json``; returns the card's path."""
    card = Path(model_dir) / CARD
    text = card.read_text() if card.is_file() else ""
    atomic_write_text(card, splice(text, section(load(model_dir))))
    return card


def _columns(entry: dict) -> list[str]:
    seen = [c for c in FIRST_COLUMNS if any(c in cells for cells in entry["rows"].values())]
    for cells in entry["rows"].values():
        seen += [c for c in cells if c not in seen]
    return seen


def _cell(value, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def section(records: dict) -> str:
    """The card's section for ``records`` (markers included)."""
    lines = [
        START,
        "## Evaluations of this model",
        "",
        f"Measured on this directory by rfkit's commands; the numbers are also in `{FILE}`.",
        "",
    ]
    for entry in records.values():
        columns = _columns(entry)
        ratio = all(c in columns for c in FIRST_COLUMNS)
        lines += [f"### {entry['title']}", ""]
        lines.append("| measure | " + " | ".join(columns) + (" | converted / original |" if ratio else " |"))
        lines.append("|---|" + "---:|" * (len(columns) + ratio))
        for measure, cells in entry["rows"].items():
            spec = entry.get("formats", {}).get(measure, ".4g")
            row = [_cell(cells.get(c), spec) for c in columns]
            if ratio:
                before, after = cells.get("original"), cells.get("converted")
                numeric = isinstance(before, (int, float)) and isinstance(after, (int, float)) and before
                row.append(f"{after / before:.3f}" if numeric else "-")
            lines.append(f"| {measure} | " + " | ".join(row) + " |")
        lines.append("")
        credits: dict[tuple, list[str]] = {}  # columns measured by one command on one day share a line
        for column in columns:
            if entry["commands"].get(column):
                credits.setdefault((entry["commands"][column], entry["measured"].get(column, "?")), []).append(column)
        for (command, day), names in credits.items():
            lines.append(f"- {', '.join(names)} ({day}): `{command}`")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def splice(card: str, new_section: str) -> str:
    """``card`` with its evaluations section replaced by ``new_section`` (inserted before
    ``## Recipe``, or at the end, when the card has none yet)."""
    if START in card and END in card:
        head, rest = card.split(START, 1)
        tail = rest.split(END, 1)[1]
        return head + new_section + tail
    marker = "\n## Recipe"
    if marker in card:
        head, tail = card.split(marker, 1)
        return head.rstrip("\n") + "\n\n" + new_section + "\n" + marker + tail
    return (card.rstrip("\n") + "\n\n" if card.strip() else "") + new_section + "\n"


def is_converted_dir(spec: str | Path) -> bool:
    """Whether ``spec`` is a saved converted model (a directory with a head map)."""
    return Path(spec).is_dir() and (Path(spec) / "head_map.json").is_file()


def add_to_model(
    spec: str | Path,
    key: str,
    title: str,
    rows: dict[str, dict[str, float | None]],
    command: str | None,
    formats: dict[str, str] | None = None,
) -> Path | None:
    """:func:`record` when ``spec`` is a converted model directory, every column of ``rows``
    credited to ``command``, and one line on stderr saying so; returns the card's path, or None
    when nothing was written (not a converted directory, or one this process cannot write: a
    warning says so)."""
    import logging
    import sys

    if not is_converted_dir(spec):
        return None
    columns = {c for cells in rows.values() for c in cells}
    try:
        card = record(spec, key, title, rows, {c: command for c in columns} if command else None, formats)
    except OSError as err:  # a read-only shared model: the results are still printed and in --json
        logging.getLogger(__name__).warning("could not add the results to %s/%s: %s", spec, CARD, err)
        return None
    print(f"added to the model card: {card}", file=sys.stderr)
    return card
