"""docs/quality.md: what each quality method buys in the same CPU time (``benchmarks/quality.py``)
and where the remaining loss sits (``benchmarks/revert_layers.py``), both on the Mamba recipe."""

from __future__ import annotations

from quality import markdown  # benchmarks/quality.py: the script that measured these
from tables import load, table


def _quality(relpath: str) -> str:
    """The table ``benchmarks/quality.py`` writes into quality.md (its own ``markdown``), with its header line."""
    return markdown(load(relpath))


@table("quality_b05")
def quality_b05() -> str:
    return _quality("quality_smollm2_b05/quality.json")


@table("quality_b025_b075")
def quality_b025_b075() -> str:
    return _quality("quality_smollm2_b025_b075/quality.json")


@table("quality_revert_layers")
def revert_layers(top: int = 6) -> str:
    revert = load("revert_smollm2_b05.json")
    layers = sorted(revert["layers"], key=lambda r: -r["gap_recovered"])
    lines = [
        f"{revert['val_blocks']} validation blocks; PPL ratio {revert['ppl_ratio']:.3f} with nothing reverted; "
        f"the {top} layers that recover most of the gap, of {len(layers)}:",
        "",
        "| layer reverted | heads | PPL ratio | share of the gap recovered | transfer MSE |",
        "|---|---|---|---|---|",
    ]
    for r in layers[:top]:
        lines.append(
            f"| {r['layer']} | {r['replaced_heads']} | {r['ppl_ratio']:.3f} | {r['gap_recovered']:.1%} | {r['transfer_mse']:.3f} |"
        )
    rest = layers[top:]
    lines += [
        "",
        f"The other {len(rest)} layers recover between {rest[-1]['gap_recovered']:.1%} and {rest[0]['gap_recovered']:.1%} each "
        f"(all {len(layers)} layers are in the JSON).",
    ]
    return "\n".join(lines)
