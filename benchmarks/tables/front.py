"""The README's one results table: the default recipe's trained model against its original and
against the strongest training-free baseline at the same cache bytes, for quality, cache and speed.
docs/results.md keeps every table behind it, with the same files."""

from __future__ import annotations

from . import load, table

DEMO = "demo_smollm2_b05_screen/summary.json"
# the make demo fit (the same model as DEMO) and, on the same blocks and head map, the training-free rows
# (make demo trains in bf16 on a CPU that computes it natively: every file here is that bf16 model,
# the baseline sized to the same bytes in bf16, sink 4 + window 72)
CONTEXT = BASELINE = "context_smollm2_b05_bf16/context.json"
SPEED = "speed_bf16/converted.json"
SPEED_BASELINE = "speed_bf16/sink_recent.json"
LENGTHS = ("2048", "8192")


def baseline_row(rows: dict) -> tuple[str, dict]:
    """A context result's training-free row: its operator, as ``sink_recent(4, 72)``, and the row."""
    name, row = next((n, r) for n, r in rows.items() if n.startswith("sink_recent"))
    spec = name.removesuffix(", training-free")
    return spec.replace("sink=", "").replace("window=", "").replace(",", ", "), row


def _ratios(speed: dict, phase: str) -> str:
    by_context = {str(r["context"]): r for r in speed["rows"]}
    return " / ".join(f"{by_context[n][f'{phase}_ratio']:.2f}x" for n in LENGTHS)


@table("front_summary")
def front_summary() -> str:
    demo = load(DEMO)
    context = load(CONTEXT)["rows"]
    baseline_name, baseline = baseline_row(load(BASELINE)["rows"])
    speed, speed_baseline = load(SPEED), load(SPEED_BASELINE)
    hybrid = context["converted"]
    original_bytes = int(demo["cache_bytes_per_token_original"])

    def per_token(value: float) -> str:
        return f"{int(value):,} ({value / original_bytes:.3f})"

    def ppl(row: dict) -> str:
        return " / ".join(f"{row['ppl_ratio'][n]:.3f}" for n in LENGTHS)

    lines = [
        f"| SmolLM2-135M, beta 0.5, 2-core CPU, {demo_precision(demo)} | original | trained hybrid (default recipe) | {baseline_name}, training-free |",
        "|---|---:|---:|---:|",
        f"| KV cache bytes per token | {original_bytes:,} | {per_token(demo['cache_bytes_per_token_converted'])} "
        f"| {per_token(baseline['kv_bytes_per_token'])} |",
        f"| perplexity ratio, Wikipedia, 512-token blocks | 1.000 | {demo['ppl_ratio']:.3f} | - |",
        f"| perplexity ratio, long documents, 2,048 / 8,192 tokens | 1.000 / 1.000 | {ppl(hybrid)} | {ppl(baseline)} |",
        f"| decode speed, 2,048 / 8,192 tokens, batch 1 | 1 / 1 | {_ratios(speed, 'decode')} | {_ratios(speed_baseline, 'decode')} |",
        f"| prefill speed, 2,048 / 8,192 tokens | 1 / 1 | {_ratios(speed, 'prefill')} | {_ratios(speed_baseline, 'prefill')} |",
        f"| `make demo`: the whole fit on the 2-core CPU | - | {demo['wall_seconds'] / 60:.1f} min | none |",
    ]
    return "\n".join(lines)


def demo_precision(demo: dict) -> str:
    """``bf16`` or ``float32``: the weights the demo's fit trained and saved."""
    return "bf16" if str(demo.get("precision", "")).startswith("bf16") else "float32"

