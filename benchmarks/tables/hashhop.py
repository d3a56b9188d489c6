"""HashHop after fine-tuning (the paper's Table 3 analogue): ``rfkit eval hashhop`` on the three
HashHop fine-tunes, with each fit's ``summary.json``. In the README and docs/trained.md."""

from __future__ import annotations

from tables import load, table

FOLDER = "hashhop_smollm2"
MODELS = {
    "b0": "original, fine-tuned",
    "hybrid_b05": "hybrid at beta 0.5, fine-tuned",
    "mamba_b05": "Mamba (the paper's) at beta 0.5, fine-tuned",
}


@table("hashhop_summary")
def hashhop_summary() -> str:
    lines = ["| model | h_gq (hop 1 / hop 2) |", "|---|---:|"]
    for run, label in MODELS.items():
        h = load(f"{FOLDER}/{run}/hashhop.json")
        hops = " / ".join(f"{a:.2f}" for a in h["per_hop"])
        lines.append(f"| {label} | {h['h_gq']:.2f} ({hops}) |")
    return "\n".join(lines)


@table("hashhop_trained")
def hashhop_trained() -> str:
    results = {run: load(f"{FOLDER}/{run}/hashhop.json") for run in MODELS}
    summaries = {run: load(f"{FOLDER}/{run}/summary.json") for run in MODELS}
    hops = len(next(iter(results.values()))["per_hop"])
    lines = [
        "| model | KV cache bytes/token | h_gq | "
        + " | ".join(f"hop {i + 1}" for i in range(hops))
        + " | Wikipedia PPL after |",
        "|---|---:|---:|" + "---:|" * hops + "---:|",
    ]
    for run, label in MODELS.items():
        h, s = results[run], summaries[run]
        cells = [
            f"{s['cache_bytes_per_token_converted']:,.0f}",
            f"{h['h_gq']:.2f}",
            *(f"{a:.2f}" for a in h["per_hop"]),
            f"{s['ppl_converted']:.2f}",
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


LONG_FOLDER = "hashhop_long_smollm2"
LONG_MODELS = {
    "b0": "original, fine-tuned",
    "hybrid_b05": "trained default hybrid at beta 0.5, fine-tuned",
    "sink_recent_b05": "sink_recent(4, 64) at beta 0.5, fine-tuned",
}
LONG_SETTINGS = {"2x2048": "2 hops in 2,048 chars", "4x1024": "4 hops in 1,024 chars"}


@table("hashhop_long")
def hashhop_long() -> str:
    """Issue 26's HashHop at longer prompts: recipes/smollm2_hashhop_long_b05.yaml for the three
    models (same fine-tune, matched bytes for the two converted ones), each scored on both settings."""
    header = "| model | KV cache bytes/token | " + " | ".join(f"{s}: h_gq (per hop)" for s in LONG_SETTINGS.values())
    lines = [header + " | Wikipedia PPL after |", "|---|---:|" + "---:|" * len(LONG_SETTINGS) + "---:|"]
    for run, label in LONG_MODELS.items():
        s = load(f"{LONG_FOLDER}/{run}/summary.json")
        cells = [f"{s['cache_bytes_per_token_converted']:,.0f}"]
        for setting in LONG_SETTINGS:
            h = load(f"{LONG_FOLDER}/{run}/hashhop_{setting}.json")
            cells.append(f"{h['h_gq']:.2f} ({' / '.join(f'{a:.2f}' for a in h['per_hop'])})")
        cells.append(f"{s['ppl_converted']:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
