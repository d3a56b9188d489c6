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


def _long_cells(row: dict, lengths: list[str]) -> list[str]:
    ratios = row.get("long_ppl_ratio") or {}
    return [f"{ratios[k]:.3f}" if k in ratios else "-" for k in lengths]


@table("comparing_policies")
def policies() -> str:
    """The recency ranking against the measured-loss ranking, same operator and bytes, by beta."""
    sweep = load("policies_smollm2/sweep.json")
    rows = sweep["rows"] + load("policies_smollm2_long/sweep.json")["rows"]  # the same blocks, measured on long documents
    lengths = sorted({k for r in rows for k in (r.get("long_ppl_ratio") or {})}, key=lambda k: int(k.rsplit("@", 1)[1]))
    head = "| beta | policy | KV groups replaced | cache bytes/token | Wikipedia 512 | " + " | ".join(
        f"long documents {int(k.rsplit('@', 1)[1]):,}" for k in lengths
    ) + " |"
    lines = [head, "|---:|---|---:|---:|---:|" + "---:|" * len(lengths)]
    names = {"RecencyRatioPolicy": "recency ratio (RA-I)", "streamed_loss": "measured streaming loss, 8 x 512 calibration tokens"}

    def name(policy: str) -> str:
        return names.get(policy, "measured streaming loss, 2 x 2,048 Shakespeare tokens" if "long_source" in policy else policy)

    for r in sorted(rows, key=lambda r: (r["beta"], r["policy"] != "RecencyRatioPolicy", len(r["policy"]))):
        groups = r["replaced_heads"] // 3  # SmolLM2: 3 query heads per KV group
        lines.append(
            f"| {r['beta']:g} | {name(r['policy'])} | {groups} of 90 | {r['cache_bytes_per_token']:,.0f} | "
            f"{r['ppl_ratio']:.3f} | " + " | ".join(_long_cells(r, lengths)) + " |"
        )
    return "\n".join(lines)


@table("comparing_policy_disagreement")
def policy_disagreement() -> str:
    """Where the two rankings part (benchmarks/policy_disagreement.py on the sweep's beta 0.75 map)."""
    d = load("policies_smollm2/disagreement.json")
    lines = [
        "| beta | KV groups replaced | chosen by both | only by measured loss | only by recency | extra loss of the recency choice (nats, first order) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["betas"]:
        lines.append(
            f"| {r['beta']:g} | {r['replaced']} | {r['agree']} | {len(r['only_streamed_loss'])} | {len(r['only_recency'])} | "
            f"{r['extra_loss_of_recency_choice']:.4f} |"
        )
    return "\n".join(lines)
