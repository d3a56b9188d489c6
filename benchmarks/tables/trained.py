"""The trained conversions' quality: the frontier over beta (``rfkit sweep --trained`` on the four
fits of docs/trained.md), each fit's own summary, and the dated history of runs they superseded.
Used by the README, docs/trained.md, docs/results.md and docs/mamba_recipe.md."""

from __future__ import annotations

import re

from tables import load, provenance, table

FRONTIER = "frontier_smollm2_trained/sweep.json"  # the four trained models and sink_recent(4, 64), 2026-11-25
MATCHED = "sweep_smollm2_hybrid/sweep.json"  # the same blocks; its sliding_window(68) rows are measured nowhere else
FITS = "trained_smollm2"  # the fits whose models every table of docs/trained.md measures
LEVEL = 0.005  # a PPL ratio within this of the best other row's is level: no bold

HYBRID, STATE_OFF, MAMBA = "hybrid trained", "hybrid trained, state off", "mamba trained"
SINK_RECENT, SLIDING = "sink_recent(sink=4,window=64)", "sliding_window(window=68)"


def short(operator: str) -> str:
    """``sink_recent(sink=4,window=64)`` -> ``sink_recent(4, 64)``."""
    return re.sub(r"\w+=", "", operator).replace(",", ", ")


def by_beta(sweep: dict) -> dict[float, dict[str, dict]]:
    rows: dict[float, dict[str, dict]] = {}
    for r in sweep["rows"]:
        rows.setdefault(r["beta"], {})[r["operator"]] = r
    return rows


def columns(sweep: dict) -> list[tuple[str, object]]:
    """``(title, getter)`` of the PPL-ratio columns: the validation blocks, then each long length."""
    cols = [(f"Wikipedia {sweep['seq_len']:,}", lambda r: r["ppl_ratio"])]
    for length in sweep["long"]["lengths"]:
        key = f"shakespeare@{length}"
        cols.append((f"Shakespeare {length:,}", lambda r, k=key: r["long_ppl_ratio"][k]))
    return cols


def best(values: dict[str, float], lower: bool = True, level: float = LEVEL) -> str | None:
    """The key whose value beats every other by more than ``level``, if one does."""
    if len(values) < 2:
        return None
    sign = 1 if lower else -1
    ranked = sorted(values, key=lambda k: sign * values[k])
    return ranked[0] if sign * (values[ranked[1]] - values[ranked[0]]) > level else None


def bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def _frontier_table(rows: dict[float, dict[str, dict]], cols, betas, operators, labels) -> str:
    lines = [
        "| beta | operator | cache bytes/token | " + " | ".join(t for t, _ in cols) + " |",
        "|---:|---|---:|" + "---:|" * len(cols),
    ]
    for beta in betas:
        shown = {op: rows[beta][op] for op in operators if op in rows[beta]}
        winners = [best({op: get(r) for op, r in shown.items()}) for _, get in cols]
        for op, r in shown.items():
            cells = [bold(f"{get(r):.3f}", w == op) for (_, get), w in zip(cols, winners)]
            lines.append(f"| {beta:g} | {labels[op]} | {r['cache_bytes_per_token']:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@table("frontier_trained")
def frontier_trained() -> str:
    """docs/trained.md: every row of the frontier sweep."""
    sweep = load(FRONTIER)
    labels = {
        HYBRID: "**hybrid, trained**",
        STATE_OFF: "hybrid, trained, state off",
        SINK_RECENT: f"{short(SINK_RECENT)}, training-free",
        MAMBA: "Mamba (the paper's operator), trained",
    }
    rows = by_beta(sweep)
    return _frontier_table(rows, columns(sweep), sorted(rows), list(labels), labels)


@table("frontier_matched")
def frontier_matched() -> str:
    """docs/results.md: the trained hybrid against both training-free baselines at matched bytes."""
    sweep = load(FRONTIER)
    matched = load(MATCHED)
    rows = by_beta(sweep)
    for r in matched["rows"]:
        if r["operator"] == SLIDING:  # the same 16 + 8 blocks as the frontier sweep
            rows.setdefault(r["beta"], {})[SLIDING] = r
    labels = {
        HYBRID: "**hybrid, trained**",
        STATE_OFF: "hybrid, trained, state off",
        SINK_RECENT: f"{short(SINK_RECENT)}, training-free",
        SLIDING: f"{short(SLIDING)}, training-free",
    }
    betas = sorted(b for b in rows if SLIDING in rows[b])
    return _frontier_table(rows, columns(sweep), betas, list(labels), labels)


@table("frontier_summary")
def frontier_summary() -> str:
    """README: one row per beta, each cell Wikipedia / Shakespeare."""
    sweep = load(FRONTIER)
    rows = by_beta(sweep)
    cols = columns(sweep)
    ops = [HYBRID, SINK_RECENT, MAMBA]
    lines = [
        f"| beta | cache bytes/token | trained hybrid | {short(SINK_RECENT)}, training-free | trained Mamba (paper) |",
        "|---:|---:|---:|---:|---:|",
        f"| 0 (original) | {sweep['original']['cache_bytes_per_token']:,.0f} | "
        + " / ".join("1.000" for _ in cols) + " | - | - |",
    ]  # fmt: skip
    for beta in sorted(rows):
        shown = {op: rows[beta][op] for op in ops if op in rows[beta]}
        winners = [best({op: get(r) for op, r in shown.items()}) for _, get in cols]
        cells = []
        for op in ops:
            if op not in shown:
                cells.append("-")
                continue
            r = shown[op]
            parts = [(f"{get(r):.3f}", w == op) for (_, get), w in zip(cols, winners)]
            if all(on for _, on in parts):
                cell = bold(" / ".join(t for t, _ in parts), True)
            else:
                cell = " / ".join(bold(t, on) for t, on in parts)
            if op == MAMBA:
                cell += f" ({r['cache_bytes_per_token']:,.0f} B)"
            cells.append(cell)
        lines.append(f"| {beta:g} | {shown[HYBRID]['cache_bytes_per_token']:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit_rows(s: dict, state: str) -> list[tuple[str, str]]:
    """The rows of ``benchmarks/summary_table.py``, less the wall time (the source line gives it)."""
    return [
        ("perplexity, original (validation blocks)", f"{s['ppl_original']:.2f}"),
        ("perplexity, converted", f"{s['ppl_converted']:.2f}"),
        ("perplexity ratio converted / original", f"{s['ppl_converted'] / s['ppl_original']:.3f}"),
        ("KV cache bytes per token, original", f"{s['cache_bytes_per_token_original']:,.0f}"),
        ("KV cache bytes per token, converted", f"{s['cache_bytes_per_token_converted']:,.0f}"),
        (f"{state} (constant), converted", f"{s['cache_state_bytes_converted']:,}"),
        (
            f"cache after a {s['cache_seq_len']}-token prefill, original / converted",
            f"{s['cache_peak_bytes_original']:,} / {s['cache_peak_bytes_converted']:,}",
        ),
        ("query heads replaced", f"{s['replaced_heads']} of {s['total_heads']}"),
        ("parameters added / removed", f"{s['params_added']:,} / {s['params_removed']:,}"),
    ]


def measure_table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["| measure | value |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows])


@table("fit_b05")
def fit_b05() -> str:
    """docs/results.md: the default recipe's fit at beta 0.5 (its own 32 validation blocks)."""
    s = load(f"{FITS}/hybrid_b05/summary.json")
    rows = fit_rows(s, "state bytes of the replaced heads")
    return measure_table(rows + [("training tokens", f"{s['train_tokens']:,}")])


@table("fit_mamba_b05")
def fit_mamba_b05() -> str:
    """docs/mamba_recipe.md: the Mamba-only recipe's fit at beta 0.5 (the model of docs/trained.md)."""
    s = load(f"{FITS}/mamba_b05/summary.json")
    t = s["transfer"]
    captured = f"training tokens (end to end; transfer captured {t['tokens_captured']:,} more)"
    mse = f"attention transfer, mean relative MSE of the {len(t['layers'])} layers"
    teacher = f"{s['teacher_bytes']:,} / {s['full_copy_bytes']:,} bytes"
    return measure_table(
        fit_rows(s, "Mamba state bytes")
        + [
            (captured, f"{s['train_tokens']:,}"),
            (mse, f"{t['mean_mse_before']:.3f} -> {t['mean_mse_after']:.3f}"),
            ("teacher memory beyond the student / a full copy", teacher),
        ]
    )


def _run(data: dict) -> str:
    p = provenance(data)
    return f"{(p.get('date') or '')[:10]}, {(p.get('commit') or '')[:7]}"


def _ratio(s: dict) -> str:
    return f"{s['ppl_converted'] / s['ppl_original']:.3f}"


def _passkey(data: dict, lengths) -> str:
    acc = {r["length"]: r["accuracy"] for r in data["by_length"]}
    return " / ".join(f"{acc[n]:.2f}" for n in lengths)


@table("history_trained")
def history_trained() -> str:
    """docs/results.md: earlier runs of measurements whose current value is on another page (or above)."""
    trained_md = "[trained.md](trained.md#3-quality-against-context-length)"
    fits = "[trained.md](trained.md#the-four-trained-models)"
    lines = [
        "| measurement | earlier run (date, commit) | value then | value now | now from |",
        "|---|---|---:|---:|---|",
    ]
    for old, new, what, where in (
        ("fit_smollm2_b05", "hybrid_b05", "default recipe at beta 0.5: fit's PPL ratio (32 Wikipedia blocks)",
         "the table above"),
        ("fit_smollm2_b075", "hybrid_b075", "default recipe at beta 0.75: fit's PPL ratio", fits),
        ("fit_smollm2_mamba_b05", "mamba_b05", "Mamba recipe at beta 0.5: fit's PPL ratio",
         "[mamba_recipe.md](mamba_recipe.md)"),
    ):
        then, now = load(f"{old}/summary.json"), load(f"{FITS}/{new}/summary.json")
        lines.append(f"| {what} | {_run(then)} | {_ratio(then)} | {_ratio(now)} | {where} |")
    context = load("context_smollm2_b05/context.json")
    for old, row, who in (
        ("passkey_smollm2_b05_conv.json", "converted", "trained hybrid"),
        ("passkey_smollm2_b05_orig.json", "original", "original"),
    ):
        then = load(old)
        lengths = [r["length"] for r in then["by_length"]]
        now = " / ".join(f"{context['rows'][row]['passkey'][str(n)]:.2f}" for n in lengths)
        lines.append(
            f"| passkey of the {who} at {' / '.join(f'{n:,}' for n in lengths)} tokens (6 keys each) | {_run(then)} "
            f"| {_passkey(then, lengths)} | {now} | {trained_md} |"
        )
    then = load("sweep_smollm2_hybrid_8k/sweep.json")
    (length,) = then["long"]["lengths"]
    key, rows = f"shakespeare@{length}", by_beta(then)[0.5]
    blocks = then["long"]["blocks"][key]
    old = " / ".join(f"{rows[op]['long_ppl_ratio'][key]:.3f}" for op in (HYBRID, STATE_OFF, SINK_RECENT))
    now_rows = context["rows"]
    now = " / ".join(
        f"{now_rows[name]['ppl_ratio'][str(length)]:.3f}"
        for name in ("converted", "converted, state off", f"{SINK_RECENT}, training-free")
    )
    lines.append(
        f"| Shakespeare PPL ratio at {length:,} tokens: trained hybrid / state off / {short(SINK_RECENT)} "
        f"| {_run(then)}, {blocks} blocks | {old} | {now} ({context['blocks'][str(length)]} block) | {trained_md} |"
    )
    return "\n".join(lines)
