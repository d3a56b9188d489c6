"""Render a run's summary.json as the Markdown table used in the README.

    python benchmarks/summary_table.py benchmarks/results/fit_smollm2_b05/summary.json
"""

import json
import sys


def table(summary: dict) -> str:
    rows = [
        ("perplexity, original (validation blocks)", f"{summary['ppl_original']:.2f}"),
        ("perplexity, converted", f"{summary['ppl_converted']:.2f}"),
        ("perplexity ratio converted / original", f"{summary['ppl_converted'] / summary['ppl_original']:.3f}"),
        ("KV cache bytes per token, original", f"{summary['cache_bytes_per_token_original']:,.0f}"),
        ("KV cache bytes per token, converted", f"{summary['cache_bytes_per_token_converted']:,.0f}"),
        ("state bytes of the replaced heads (constant), converted", f"{summary['cache_state_bytes_converted']:,}"),
        (
            f"cache after a {summary['cache_seq_len']}-token prefill, original / converted",
            f"{summary['cache_peak_bytes_original']:,} / {summary['cache_peak_bytes_converted']:,}",
        ),
        ("query heads replaced", f"{summary['replaced_heads']} of {summary['total_heads']}"),
        ("parameters added / removed", f"{summary['params_added']:,} / {summary['params_removed']:,}"),
        ("training tokens", f"{summary['train_tokens']:,}"),
        ("wall time of the whole fit", f"{summary['wall_seconds'] / 60:.1f} min"),
    ]
    lines = ["| measure | value |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(json.load(f)))
