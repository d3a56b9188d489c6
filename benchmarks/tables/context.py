"""Quality against context length at beta 0.5 (``rfkit eval context`` on the trained hybrid and on
the trained Mamba model): held-out Shakespeare perplexity ratio and passkey retrieval by length.
In the README and docs/trained.md."""

from __future__ import annotations

from tables import load, table
from tables.trained import LEVEL, SINK_RECENT, best, bold, short

HYBRID = "context_smollm2_b05/context.json"
MAMBA = "context_smollm2_mamba_b05/context.json"
BASELINE = f"{SINK_RECENT}, training-free"


def _cells(rows: dict[str, dict], lengths: list[str]) -> dict[str, list[str]]:
    """Each row's PPL-ratio and passkey cells; the best converted model per column in bold."""
    converted = [name for name in rows if name != "original"]
    out = {name: [] for name in rows}
    for measure, fmt, lower, level in (("ppl_ratio", ".3f", True, LEVEL), ("passkey", ".2f", False, 0.0)):
        for n in lengths:
            winner = best({name: rows[name][measure][n] for name in converted}, lower=lower, level=level)
            for name, r in rows.items():
                out[name].append(bold(f"{r[measure][n]:{fmt}}", name == winner))
    return out


def _head(first: str, lengths: list[str]) -> list[str]:
    """``first 1,024 | 2,048 | ... | passkey 1,024 | 2,048 | ...``"""
    rest = [f"{int(n):,}" for n in lengths[1:]]
    return [f"{first} {int(lengths[0]):,}", *rest, f"passkey {int(lengths[0]):,}", *rest]


def _mb(r: dict, n: str) -> str:
    return f"{r['cache_bytes'][n] / 1e6:.1f} MB"


@table("context_summary")
def context_summary() -> str:
    """README: original, trained hybrid, sink_recent(4, 64) and the trained Mamba model."""
    hybrid, mamba = load(HYBRID), load(MAMBA)
    lengths = [str(n) for n in hybrid["lengths"]]
    assert [str(n) for n in mamba["lengths"]] == lengths
    last = lengths[-1]
    rows = {
        "original": hybrid["rows"]["original"],
        "trained hybrid": hybrid["rows"]["converted"],
        f"{short(SINK_RECENT)}, training-free": hybrid["rows"][BASELINE],
        "trained Mamba, the paper's operator": mamba["rows"]["converted"],
    }
    cells = _cells(rows, lengths)
    head = _head("PPL", lengths)
    lines = [
        f"| model (cache at {int(last):,} tokens) | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(head),
    ]
    for name, r in rows.items():
        lines.append(f"| {name} ({_mb(r, last)}) | " + " | ".join(cells[name]) + " |")
    return "\n".join(lines)


@table("context_trained")
def context_trained() -> str:
    """docs/trained.md: original, trained hybrid, the same with its state off, sink_recent(4, 64)."""
    data = load(HYBRID)
    lengths = [str(n) for n in data["lengths"]]
    last = lengths[-1]
    labels = {
        "original": "original",
        "converted": "hybrid, trained",
        "converted, state off": "hybrid, trained, state off",
        BASELINE: f"{short(SINK_RECENT)}, training-free",
    }
    rows = {key: data["rows"][key] for key in labels}
    cells = _cells(rows, lengths)
    head = _head("PPL ratio", lengths)
    lines = [
        f"| model | cache at {int(last):,} tokens | " + " | ".join(head) + " |",
        "|---|---:|" + "---:|" * len(head),
    ]
    for key, r in rows.items():
        cache = f"{_mb(r, last)} ({r['cache_ratio'][last]:.3f})"
        lines.append(f"| {labels[key]} | {cache} | " + " | ".join(cells[key]) + " |")
    return "\n".join(lines)
