"""What ``make demo`` shows on a terminal, kept as a result file for the README.

    python benchmarks/demo_screen.py [--log FILE] [--output benchmarks/results/demo_smollm2_b05_screen]

Runs ``make demo`` (or reads the output of one already captured with ``make demo > FILE 2>&1``)
and writes ``screen.txt``, the screen as a terminal leaves it, and ``summary.json``, the run's
own summary (with the command, date, commit and wall time: :mod:`rfkit.provenance`). Captured
through a pipe, a progress bar prints one line per update; on a terminal it redraws one line, so
consecutive updates of the same bar are kept as their last state, and the bars that clear
themselves when done (Lightning's validation bar) are left out, as a terminal shows neither.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BAR = re.compile(r"^(.{1,60}?):\s+(\d+%\||\|)")  # "desc: 45%|..." or "desc: |..."
TRANSIENT = ("Validation", "Sanity Checking")


def screen(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    lines: list[str] = []
    for raw in text.split("\n"):
        parts = [p for p in raw.split("\r") if p.strip()]
        line = parts[-1].rstrip() if parts else ""
        bar = BAR.match(line)
        if bar and bar.group(1).startswith(TRANSIENT):
            continue
        previous = next((x for x in reversed(lines) if x), "")
        if bar and (prev := BAR.match(previous)) and prev.group(1) == bar.group(1):
            while lines and not lines[-1]:
                lines.pop()
            lines[-1] = line  # the same bar redrawn
            continue
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", type=Path, default=None, help="output of a make demo already run (default: run it)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "demo_smollm2_b05_screen")
    args = parser.parse_args(argv)
    if args.log is None:
        # one stream, as a terminal interleaves them (the step bar writes to stdout, the rest to stderr)
        done = subprocess.run(["make", "demo"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        text = done.stdout
        if done.returncode != 0:
            sys.stderr.write(text[-3000:])
            return done.returncode
    else:
        text = args.log.read_text(errors="replace")
    found = re.search(r"summary\s+(\S+summary\.json)", text)
    if not found:
        raise SystemExit("no 'summary .../summary.json' line in the output: did the run finish?")
    from rfkit.atomic import atomic_write_text

    args.output.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.output / "screen.txt", screen(text))
    atomic_write_text(args.output / "summary.json", (ROOT / found.group(1)).read_text())
    print(f"screen.txt, summary.json -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
