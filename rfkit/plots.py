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


def heatmap(
    matrix,
    path: str | os.PathLike,
    xlabel: str,
    ylabel: str,
    title: str = "",
    marks: Sequence[tuple[int, int]] | None = None,
    cbar_label: str = "",
    mark_label: str = "",
    xticklabels: Sequence[str] | None = None,
    yticklabels: Sequence[str] | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    cmap: str = "viridis",
) -> Path:
    """A matrix (rows on the y axis, columns on the x axis, row 0 at the top) as coloured cells.

    ``marks`` lists ``(row, col)`` cells to flag with a ring (e.g. replaced heads); ``mark_label``
    names them in a legend below the plot. One tick per row and column (labels default to the
    indices); the figure grows with the matrix so 30 x 9 labels stay readable.
    """
    import numpy as np

    plt = pyplot()
    data = np.asarray(matrix, dtype=float)
    rows, cols = data.shape
    width = min(16.0, max(5.0, 0.34 * cols + 2.2))
    height = min(12.0, max(3.0, 0.34 * rows + 1.8))
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(data, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    bar = fig.colorbar(image, ax=ax, fraction=0.035, pad=0.02)
    if cbar_label:
        bar.set_label(cbar_label)
    ax.set_xticks(range(cols))
    ax.set_xticklabels(list(xticklabels) if xticklabels is not None else [str(c) for c in range(cols)], fontsize=7)
    ax.set_yticks(range(rows))
    ax.set_yticklabels(list(yticklabels) if yticklabels is not None else [str(r) for r in range(rows)], fontsize=7)
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5, alpha=0.6)
    ax.tick_params(which="minor", length=0)
    if marks:
        ys, xs = zip(*marks)
        ax.scatter(xs, ys, s=28, facecolors="none", edgecolors="red", linewidths=1.4, label=mark_label or None)
        if mark_label:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 if rows < 15 else -0.06), fontsize=8, frameon=False)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def attention_panels(
    maps: Sequence,
    titles: Sequence[str],
    path: str | os.PathLike,
    suptitle: str = "",
    first: int = 1,
    log: bool = True,
    floor: float = 1e-4,
    cbar_label: str = "mean attention weight",
) -> Path:
    """Square attention maps ``A[i, j]`` (query i, key j) side by side with one shared colour bar.

    Rows and columns before ``first`` are left out (``first=1`` drops the first token, an
    attention sink that would otherwise dominate the colour scale); axis ticks show the real
    token positions. Entries above the diagonal (not attended) stay blank. With ``log`` the
    colour scale is logarithmic, clipped below at ``floor``.
    """
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    plt = pyplot()
    shown = [np.asarray(m, dtype=float)[first:, first:] for m in maps]
    n = len(shown)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 1.0, 4.4), squeeze=False, constrained_layout=True)
    top = max([float(m.max()) for m in shown if m.size] + [floor * 10])
    norm = LogNorm(vmin=floor, vmax=top) if log else Normalize(vmin=0.0, vmax=top)
    image = None
    for ax, m, title in zip(axes[0], shown, titles):
        size = m.shape[0]
        i, j = np.indices(m.shape)
        masked = np.ma.masked_where(j > i, np.clip(m, floor, None) if log else m)
        extent = (first - 0.5, first + size - 0.5, first + size - 0.5, first - 0.5)
        image = ax.imshow(masked, cmap="magma", norm=norm, interpolation="nearest", extent=extent)
        ax.set_facecolor("#f2f2f2")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes[0]), fraction=0.025, pad=0.01)
        bar.set_label(cbar_label + (" (log scale)" if log else ""))
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    return save_figure(fig, path)
