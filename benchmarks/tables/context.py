"""Quality against context length (``rfkit eval context``): held-out Shakespeare perplexity ratio
and passkey retrieval by length, for the default recipe's fit (its state decays and is fitted on
long blocks), the state variants that were measured to choose it, beta 0.75, and the runs before
the decay (history). In the README, docs/trained.md and docs/hybrid.md."""

from __future__ import annotations

from tables import load, table
from tables.trained import LEVEL, SINK_RECENT, best, bold, short

# the default recipe's fit (the current `make demo` model, 48 steps): state decay, long blocks in
# transfer and in end-to-end training
DEFAULT = "context_smollm2_b05_current/context.json"
DECAY = "context_smollm2_b05_decay/context.json"  # the same before long blocks in end-to-end training
BETA_075 = "context_smollm2_b075_decay/context.json"
HYBRID = "context_smollm2_b05/context.json"  # before the decay: the state summed every old token
VARIANTS = "context_variants_smollm2_b05"
BASELINE = f"{SINK_RECENT}, training-free"


def _cells(rows: dict[str, dict], lengths: list[str], passkey: bool = True) -> dict[str, list[str]]:
    """Each row's PPL-ratio (and passkey) cells; the best converted model per column in bold."""
    converted = [name for name in rows if name != "original"]
    out = {name: [] for name in rows}
    measures = [("ppl_ratio", ".3f", True, LEVEL)] + ([("passkey", ".2f", False, 0.0)] if passkey else [])
    for measure, fmt, lower, level in measures:
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


def _labelled(data: dict, labels: dict[str, str], first: str) -> str:
    """One row per ``labels`` key of an ``rfkit eval context`` file: cache at the longest length,
    then PPL ratio and (when measured) passkey per length, the best converted row in bold."""
    lengths = [str(n) for n in data["lengths"]]
    last = lengths[-1]
    rows = {labels[key]: data["rows"][key] for key in labels}
    passkey = all(r.get("passkey") for r in rows.values())
    cells = _cells(rows, lengths, passkey)
    head = _head(first, lengths) if passkey else [f"{first} {int(lengths[0]):,}", *[f"{int(n):,}" for n in lengths[1:]]]
    lines = [
        f"| model | cache at {int(last):,} tokens | " + " | ".join(head) + " |",
        "|---|---:|" + "---:|" * len(head),
    ]
    for name, r in rows.items():
        cache = f"{_mb(r, last)} ({r['cache_ratio'][last]:.3f})"
        lines.append(f"| {name} | {cache} | " + " | ".join(cells[name]) + " |")
    return "\n".join(lines)


def _four_rows(path: str, trained: str, baseline_note: str = "") -> str:
    """Original, the trained hybrid (``trained``), its state-off twin and sink_recent(4, 64)."""
    labels = {
        "original": "original",
        "converted": trained,
        "converted, state off": "the same, state off",
        BASELINE: f"{short(SINK_RECENT)}{baseline_note}, training-free",
    }
    return _labelled(load(path), labels, "PPL ratio")


@table("context_summary")
def context_summary() -> str:
    """README and docs/trained.md: the default recipe's fit against the original, its state-off
    twin and sink_recent(4, 64) on the same blocks and prompts."""
    return _four_rows(DEFAULT, "hybrid, trained (default recipe)")


@table("context_b075")
def context_b075() -> str:
    """README and docs/trained.md: beta 0.75, the default recipe's settings, against
    sink_recent(4, 64) on the same head map, at 2,048 and 8,192 tokens."""
    return _four_rows(BETA_075, "hybrid at beta 0.75, trained", " at beta 0.75")


@table("context_variants")
def context_variants() -> str:
    """docs/hybrid.md and the README: the states measured to choose the default, each fit by the
    default recipe with one change, on the same 16,384 held-out tokens per length; the Wikipedia
    column is each fit's own validation ratio (512-token blocks)."""
    variants = {
        "decay128": "hybrid, state decay (horizon 128), transfer on 512-token blocks",
        "decay128_long": "hybrid, state decay, transfer also on 2,048-token blocks",
        "transfer_long2": "the same, transfer on twice the long blocks (16, two a step)",
        "longmix": "hybrid, decay + long transfer, end-to-end training also on a 2,048-token block "
        "after every Wikipedia batch",
        "longmix_e2": "the same with the long block after every 2 Wikipedia batches (the default)",
        "hybrid_mamba": "sink + window + a Mamba state (HybridMambaOperator), its recipe",
    }
    data = {v: load(f"{VARIANTS}/{v}/context.json") for v in variants}
    fits = {v: load(f"{VARIANTS}/{v}/fit_summary.json") for v in variants}
    lengths = [str(n) for n in data["decay128"]["lengths"]]
    for v in variants:
        assert [str(n) for n in data[v]["lengths"]] == lengths and data[v]["blocks"] == data["decay128"]["blocks"]
    rows = {label: data[v]["rows"]["converted"] for v, label in variants.items()}
    rows["window alone (any of them, state off)"] = data["decay128"]["rows"]["converted, state off"]
    cells = _cells(rows, lengths, passkey=False)
    head = ["Wikipedia 512", *(f"{int(n):,}" for n in lengths)]
    lines = ["| state | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    wiki = {label: f"{fits[v]['ppl_ratio']:.3f}" for v, label in variants.items()}
    for name in rows:
        lines.append(f"| {name} | {wiki.get(name, '-')} | " + " | ".join(cells[name]) + " |")
    return "\n".join(lines)


@table("context_trained")
def context_trained() -> str:
    """docs/trained.md (history): original, the hybrid trained before the state decay (its state
    summed every old token; 512-token transfer), the same with its state off, sink_recent(4, 64)."""
    return _four_rows(HYBRID, "hybrid, trained before the decay")


@table("context_decay")
def context_decay() -> str:
    """docs/trained.md (history): the fit with state decay and long-block transfer, before its
    end-to-end training also saw long blocks, on the same blocks and keys as the default's table."""
    return _four_rows(DECAY, "hybrid, trained before long blocks in end-to-end training")
