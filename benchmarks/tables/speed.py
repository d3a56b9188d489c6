"""The trained default's speed and memory (``rfkit bench speed`` / ``rfkit bench cache`` on the
fit of ``recipes/smollm2_b05.yaml``), in the README and docs/trained.md."""

from __future__ import annotations

from tables import load, table

FOLDER = "speed_smollm2_b05_fast"


def _pair(a: float, b: float, fmt: str) -> str:
    return f"{a:{fmt}} -> {b:{fmt}} ({b / a:.2f}x)"


@table("speed_b05")
def speed_table() -> str:
    speed = load(f"{FOLDER}/speed.json")
    batch4 = load(f"{FOLDER}/speed_batch4.json")
    contexts = [r["context"] for r in speed["rows"]]
    head = "| tokens/s, original -> converted (ratio) | " + " | ".join(f"{c:,} tokens" for c in contexts) + " |"
    lines = [head, "|---|" + "---:|" * len(contexts)]
    for phase in ("prefill", "decode"):
        cells = [_pair(r[f"{phase}_tps_original"], r[f"{phase}_tps_converted"], ".1f" if phase == "prefill" else ".2f") for r in speed["rows"]]
        lines.append(f"| trained hybrid, {phase}, batch 1 | " + " | ".join(cells) + " |")
    by_context = {r["context"]: r for r in batch4["rows"]}
    cells = [
        _pair(by_context[c]["decode_tps_original"], by_context[c]["decode_tps_converted"], ".2f") if c in by_context else "-"
        for c in contexts
    ]
    lines.append("| trained hybrid, decode, batch 4 | " + " | ".join(cells) + " |")
    baseline = {r["context"]: r for r in load(f"{FOLDER}/speed_sink_recent.json")["rows"]}
    for phase in ("prefill", "decode"):
        fmt = ".1f" if phase == "prefill" else ".2f"
        cells = [
            _pair(baseline[c][f"{phase}_tps_original"], baseline[c][f"{phase}_tps_converted"], fmt) if c in baseline else "-"
            for c in contexts
        ]
        lines.append(f"| sink_recent(4, 64), training-free, same bytes: {phase}, batch 1 | " + " | ".join(cells) + " |")
    steps = {s["context"]: s for s in speed.get("layer_step", [])}
    cells = [
        f"{steps[c]['step_us_original']:.0f} -> {steps[c]['step_us_converted']:.0f} µs "
        f"({steps[c]['torch_calls_original']:.0f} -> {steps[c]['torch_calls_converted']:.0f} calls)"
        if c in steps else "-"
        for c in contexts
    ]  # fmt: skip
    lines.append("| trained hybrid, one attention layer's decode step | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@table("memory_b05")
def memory_table() -> str:
    cache = load(f"{FOLDER}/cache.json")
    budget = load(f"{FOLDER}/speed_budget.json")
    mib = 2**20
    lines = ["| measure | original | converted | ratio |", "|---|---:|---:|---:|"]
    for r in cache["rows"]:
        if r["l_g"] in (1024, 10240):
            a, b = r["cache_bytes_original"] / mib, r["cache_bytes_converted"] / mib
            lines.append(f"| cache after {r['l_g']:,} tokens (MiB) | {a:,.2f} | {b:,.2f} | {b / a:.3f} |")
    for r in cache["rows"]:
        a, b = r["prefill_peak_bytes_original"] / mib, r["prefill_peak_bytes_converted"] / mib
        lines.append(f"| prefill peak of {r['l_g']:,} tokens (MiB) | {a:,.2f} | {b:,.2f} | {b / a:.3f} |")
    mi = cache["max_input"]
    a, b = mi["original"]["max_input"], mi["converted"]["max_input"]
    lines.append(f"| longest prompt within a {cache['max_input_budget_bytes'] / mib:.0f} MiB prefill peak (tokens) | {a:,} | {b:,} | {b / a:.2f} |")
    for r in budget["budget"]:
        a, b = r["batch_fits_original"], r["batch_fits_converted"]
        lines.append(
            f"| sequences of {r['context']:,} tokens whose cache fits {r['budget_bytes'] / mib:.0f} MiB | {a} | {b} | {b / a:.2f} |"
        )
        lines.append(
            f"| decode tokens/s at that batch ({r['batch_original']} vs {r['batch_converted']}) | "
            f"{r['decode_tps_original']:.2f} | {r['decode_tps_converted']:.2f} | {r['throughput_ratio']:.2f} |"
        )
    return "\n".join(lines)


@table("speed_decay_check")
def speed_decay_check() -> str:
    """docs/hybrid.md: the default recipe's fit before the state decay and after it (decay + long
    transfer), each against the original in its own process, one after the other, same code."""
    runs = {"before the decay": load("speed_smollm2_b05_decay/before.json"),
            "with the decay": load("speed_smollm2_b05_decay/after.json")}  # fmt: skip
    lines = ["| fit | context | prefill, original -> converted | decode, original -> converted |", "|---|---:|---:|---:|"]
    for name, data in runs.items():
        for r in data["rows"]:
            prefill = _pair(r["prefill_tps_original"], r["prefill_tps_converted"], ".1f")
            decode = _pair(r["decode_tps_original"], r["decode_tps_converted"], ".2f")
            lines.append(f"| {name} | {r['context']:,} | {prefill} | {decode} |")
    return "\n".join(lines)
