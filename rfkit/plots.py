"""Matplotlib figures as PNG files (Agg backend: no display needed), written atomically.

Shared by ``rfkit profile`` (head pictures), ``rfkit eval mqar`` and ``rfkit sweep``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: ``import rfkit`` stays light)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save ``fig`` as PNG through a temporary file and a rename, then close it."""
    from rfkit.atomic import atomic_write

    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight"))
    pyplot().close(fig)
    return path


def line_plot(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | os.PathLike,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    annotate: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """One line per series ``{label: (xs, ys)}``; ``annotate`` puts a text label on each point."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
        for x, y, text in zip(xs, ys, (annotate or {}).get(label, ())):
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return save_figure(fig, path)
