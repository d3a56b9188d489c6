"""Issue 49's lines, seed by seed: ``benchmarks/seed_lines.py``'s ``lines.json`` as a table (a row
per line, a column per seed, each cell the value and whether it is met). The same function writes
the script's ``lines.md``. Used by docs/results.md."""

from __future__ import annotations

from . import load, table


def markdown(result: dict) -> str:
    """The lines as one table: a row per line, a column per seed."""
    seeds = result["seeds"]
    names = list(dict.fromkeys(line["line"] for s in seeds for line in s["lines"]))
    head = f"| beta {result['beta']}, `{result['recipe']}` | " + " | ".join(f"seed {s['seed']}" for s in seeds) + " |"
    out = [head, "|---|" + "---:|" * len(seeds)]
    for name in names:
        cells = []
        for s in seeds:
            line = next((x for x in s["lines"] if x["line"] == name), None)
            cells.append("-" if line is None else f"{line['value']} {'met' if line['ok'] else '**missed**'}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    speeds = result["speed"]  # one entry per machine and dtype measured (a single dict before 2026-12-02)
    for speed in [speeds] if isinstance(speeds, dict) else speeds:
        for line in speed["lines"]:
            cell = f"{line['value']} {'met' if line['ok'] else '**missed**'}"
            out.append(f"| {line['line']} ({speed['model']}) | {cell} |" + " - |" * (len(seeds) - 1))
    verdict = "every line met" if result["all_met"] else "not every line met"
    if result["shipped"]:
        return (
            "\n".join(out)
            + f"\n\n{verdict}; read from the result files behind the README's beta {result['beta']} table"
            " (measured where each file's provenance says; this check measures nothing)\n"
        )
    return "\n".join(out) + f"\n\n{verdict}; the recipe's fits with `{result['overrides'] or 'no overrides'}`\n"


@table("lines_b075")
def lines_b075() -> str:
    return markdown(load("seed_lines/shipped_b075/lines.json")).rstrip()


@table("lines_b09")
def lines_b09() -> str:
    return markdown(load("seed_lines/shipped_b09/lines.json")).rstrip()
