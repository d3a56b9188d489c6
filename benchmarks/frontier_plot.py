"""The frontier: cache against long-document perplexity, every operator and policy of several sweeps.

    python benchmarks/frontier_plot.py SWEEP.json [SWEEP.json ...] [--length 2048] [--output DIR]
                                       [--skip-model TEXT ...]

Each ``rfkit sweep`` result (run with ``--long``) gives points: its rows (policy x operator x beta,
trained models and their state-off twins included), at their cache ratio (cache bytes per token
after the sweep's ``--cache-length`` tokens, over the original's) and their perplexity ratio on
the long documents of ``--length`` tokens. Points of the same policy and operator across betas
are joined; a row that a later file measures again (same label and beta) is taken from the first.
A sweep that scored several trained models of one label (lever fits) gives the first of them;
``--skip-model TEXT`` leaves out the trained rows whose model path contains TEXT, so that the one
wanted comes first. Sweeps must measure the same long documents (source, lengths and blocks), or
their ratios are not comparable: the script refuses to mix them.

Writes ``frontier.png`` and ``frontier.json`` (every point, its source file, and provenance) into
``--output`` (default ``benchmarks/results/frontier``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rfkit.atomic import atomic_write_json
from rfkit.plots import pyplot, save_figure
from rfkit.provenance import stamp


def _label(row: dict) -> str:
    trained = " (trained)" if row.get("trained") and "trained" not in row["operator"] else ""
    return f"{row['policy']} + {row['operator']}{trained}"


def points(paths: list[Path], length: int, skip: tuple[str, ...] = ()) -> tuple[list[dict], dict]:
    """Every row with a long-document ratio at ``length`` (none of a model whose path contains a
    ``skip`` text), and the long-document settings shared by all."""
    key, shared, out = f"@{length}", None, []
    for path in paths:
        sweep = json.loads(Path(path).read_text())
        long = sweep.get("long") or {}
        settings = {"source": long.get("source"), "blocks": {k: v for k, v in (long.get("blocks") or {}).items() if k.endswith(key)}}
        if not settings["blocks"]:
            raise SystemExit(f"{path}: no long documents of {length} tokens (run the sweep with --long ... --long-lengths {length})")
        if shared is None:
            shared = settings
        elif settings != shared:
            raise SystemExit(f"{path}: long documents {settings} differ from the first file's {shared}; ratios would not compare")
        for row in sweep["rows"]:
            ratio = next((v for k, v in (row.get("long_ppl_ratio") or {}).items() if k.endswith(key)), None)
            if ratio is None or row.get("cache_ratio") is None or any(t in row.get("model", "") for t in skip):
                continue
            if any(p["label"] == _label(row) and p["beta"] == row["beta"] for p in out):
                continue  # the same row measured again by a later sweep (the first file's is kept)
            out.append({"label": _label(row), "beta": row["beta"], "cache_ratio": row["cache_ratio"], "ppl_ratio": ratio,
                        "wikipedia_ratio": row.get("ppl_ratio"), "source": str(path)})  # fmt: skip
    return out, shared


def plot(pts: list[dict], length: int, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))  # the legend goes to the right, outside the axes
    ax.scatter([1.0], [1.0], marker="*", s=120, color="black", label="original", zorder=3)
    by_label: dict[str, list[dict]] = {}
    for p in pts:
        by_label.setdefault(p["label"], []).append(p)
    for label, group in by_label.items():
        group.sort(key=lambda p: p["cache_ratio"])
        style = "--" if "training-free" in label or "sink_recent" in label else "-"
        ax.plot([p["cache_ratio"] for p in group], [p["ppl_ratio"] for p in group], style, marker="o", label=label)
        for p in group:
            ax.annotate(f"{p['beta']:g}", (p["cache_ratio"], p["ppl_ratio"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("cache ratio (bytes per token, converted / original)")
    ax.set_ylabel(f"perplexity ratio, long documents of {length:,} tokens")
    ax.set_title("Frontier: cache against long-document perplexity (labels: beta)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/frontier"))
    parser.add_argument("--skip-model", action="append", default=[], help="leave out trained models whose path contains this (repeatable)")
    args = parser.parse_args(argv)
    started = time.time()
    pts, long = points(args.sweeps, args.length, tuple(args.skip_model))
    args.output.mkdir(parents=True, exist_ok=True)
    plot(pts, args.length, args.output / "frontier.png")
    sources = [str(p) for p in args.sweeps]
    result = stamp({"length": args.length, "long": long, "sources": sources, "skipped": args.skip_model, "points": pts}, started)
    atomic_write_json(args.output / "frontier.json", result)
    print(f"{len(pts)} points from {len(args.sweeps)} sweeps -> {args.output / 'frontier.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
