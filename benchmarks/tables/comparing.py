"""docs/comparing.md: operators and head policies at matched cache (``rfkit sweep`` over policies x
operators x beta, Mamba blocks after a short attention transfer)."""

from __future__ import annotations

from tables import load, table


@table("comparing_operators")
def operators() -> str:
    sweep = load("sweep_smollm2_operators/sweep.json")
    betas = sorted({r["beta"] for r in sweep["rows"]})
    cells: dict[tuple[str, str], dict[float, dict]] = {}
    for r in sweep["rows"]:
        cells.setdefault((r["policy"], r["operator"]), {})[r["beta"]] = r
    lines = ["| policy | operator | " + " | ".join(f"β {b:g}" for b in betas) + " |", "|---|---|" + "---:|" * len(betas)]
    for (policy, operator), by_beta in cells.items():
        row = [
            f"{by_beta[b]['ppl_ratio']:.3f} ({by_beta[b]['cache_bytes_per_token']:,.0f})" if b in by_beta else "-" for b in betas
        ]
        lines.append(f"| {policy} | {operator} | " + " | ".join(row) + " |")
    return "\n".join(lines)
