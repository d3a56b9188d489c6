"""A default fit's saved folder loaded where rfkit cannot be imported (``benchmarks/standalone_check.py``),
in docs/recipes.md."""

from __future__ import annotations

from tables import load, table

RUNS = (
    ("default_fit", "saved by `rfkit fit --config recipes/smollm2_b05.yaml` (this release)"),
    ("fit_saved_before_then_exported", "the same fit saved before folders carried their code (same weights), then `rfkit export`"),
)


@table("sharing_default")
def sharing_default() -> str:
    lines = [
        "| folder | loaded without rfkit as | validation blocks | perplexity without rfkit | perplexity the fit reported | relative difference |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, what in RUNS:
        data = load(f"sharing_smollm2_b05/{name}.json")
        assert data["exported_first"] == name.endswith("exported"), name
        lines.append(
            f"| {what} | `{data['model_class'].rsplit('.', 1)[-1]}` (`trust_remote_code=True`) "
            f"| {data['validation_blocks']} x {data['seq_len']} tokens | {data['ppl_without_rfkit']:.4f} "
            f"| {data['ppl_converted_fit']:.4f} | {data['relative_difference']:.1e} |"
        )  # fmt: skip
    return "\n".join(lines)
