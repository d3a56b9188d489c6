"""Give a result file written before result files carried provenance its ``provenance`` block.

    python benchmarks/backfill_provenance.py FILE [FILE ...] --command "rfkit ..." [--wall-seconds S]
        [--source "where the command and time were read"]

Commands write the block themselves (:mod:`rfkit.provenance`); this is only for older files. The
date and commit are those of the oldest commit that holds the file as it is now (the code that
measured it was at or before that commit); the command and wall time are the ones the pages quoted next to the
numbers. The block says so in ``backfilled``. A file that already has a block is left alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rfkit.atomic import atomic_write_json

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def added_in(path: Path) -> tuple[str, str]:
    """``(commit, ISO date)`` of the oldest commit at which ``path`` already had its committed
    content (the commit that added the file, or that last rewrote it)."""
    rel = str(path.resolve().relative_to(ROOT))
    try:
        head = _git("rev-parse", f"HEAD:{rel}").strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"{path}: not committed; commit it first, or re-run the command that writes it") from None
    found = None
    for line in _git("log", "--format=%H %cI", "--", rel).splitlines():  # newest first
        commit, date = line.split()
        try:
            blob = _git("rev-parse", f"{commit}:{rel}").strip()
        except subprocess.CalledProcessError:
            break
        if blob != head:
            break
        found = (commit, date)
    if found is None:
        raise SystemExit(f"{path}: no commit holds its current content")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--command", required=True, help="the command that wrote the file, as the pages quoted it")
    parser.add_argument("--wall-seconds", type=float, default=None)
    parser.add_argument("--source", default="command and wall time as quoted beside the numbers; date and commit of the commit that added the file")
    args = parser.parse_args(argv)
    for path in args.files:
        data = json.loads(path.read_text())
        if "provenance" in data:
            print(f"{path}: has provenance, left alone")
            continue
        commit, date = added_in(path)
        data["provenance"] = {
            "command": args.command,
            "date": date,
            "commit": commit,
            "dirty": None,
            "wall_seconds": args.wall_seconds if args.wall_seconds is not None else data.get("wall_seconds"),
            "backfilled": "backfilled: " + args.source if not args.source.startswith("backfilled") else args.source,
        }
        atomic_write_json(path, data)
        print(f"{path}: provenance from {commit[:7]} ({date[:10]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
