"""The trained default's speed and memory (``rfkit bench speed`` / ``rfkit bench cache`` on the
fit of ``recipes/smollm2_b05.yaml``), in the README and docs/trained.md."""

from __future__ import annotations

from tables import load, table

FOLDER = "speed_smollm2_b05_fast"
NOW = "speed_issue36"  # the issue-36 fit measured before and after the packed projection and new step
CURRENT = "speed_current"  # the make demo fit (48 steps) on the current code, and the baseline beside it


def _pair(a: float, b: float, fmt: str) -> str:
    return f"{a:{fmt}} -> {b:{fmt}} ({b / a:.2f}x)"


@table("speed_b05")
def speed_table() -> str:
    speed = load(f"{CURRENT}/converted.json")
    batch4 = load(f"{CURRENT}/batch4.json")
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
    baseline = {r["context"]: r for r in load(f"{CURRENT}/sink_recent.json")["rows"]}
    for phase in ("prefill", "decode"):
        fmt = ".1f" if phase == "prefill" else ".2f"
        cells = [
            _pair(baseline[c][f"{phase}_tps_original"], baseline[c][f"{phase}_tps_converted"], fmt) if c in baseline else "-"
            for c in contexts
        ]
        lines.append(f"| sink_recent(4, 64), training-free, same bytes: {phase}, batch 1 | " + " | ".join(cells) + " |")
    lines.append("| trained hybrid, one attention layer's decode step | " + " | ".join(_step_cells(speed, contexts)) + " |")
    return "\n".join(lines)


def _step_cells(speed: dict, contexts: list[int]) -> list[str]:
    steps = {s["context"]: s for s in speed.get("layer_step", [])}
    return [
        f"{steps[c]['step_us_original']:.0f} -> {steps[c]['step_us_converted']:.0f} µs "
        f"({steps[c]['torch_calls_original']:.0f} -> {steps[c]['torch_calls_converted']:.0f} calls)"
        if c in steps else "-"
        for c in contexts
    ]  # fmt: skip


@table("speed_issue36")
def speed_issue36() -> str:
    """docs/hybrid.md: the default fit's model before and after the packed projection and the
    device-independent decode step, each against the original in its own process, one after the
    other on the same machine."""
    runs = {"before (c8f94e5)": load(f"{NOW}/before.json"), "after": load(f"{NOW}/after.json")}
    lines = ["| code | context | prefill, original -> converted | decode, original -> converted | one layer's step |", "|---|---:|---:|---:|---:|"]
    for name, data in runs.items():
        steps = dict(zip([r["context"] for r in data["rows"]], _step_cells(data, [r["context"] for r in data["rows"]])))
        for r in data["rows"]:
            prefill = _pair(r["prefill_tps_original"], r["prefill_tps_converted"], ".1f")
            decode = _pair(r["decode_tps_original"], r["decode_tps_converted"], ".2f")
            lines.append(f"| {name} | {r['context']:,} | {prefill} | {decode} | {steps[r['context']]} |")
    return "\n".join(lines)


@table("decode_ops")
def decode_ops() -> str:
    """docs/hybrid.md: one attention layer's decode step on both of the converted model's paths."""
    ops = load(f"{CURRENT}/decode_ops.json")
    lines = ["| context | original | converted, C step (CPU float32) | converted, PyTorch step (every other device) |", "|---:|---:|---:|---:|"]
    for r in ops["rows"]:
        cells = [f"{r[k]['step_us']:.0f} µs, {r[k]['torch_calls']:.0f} calls" for k in ("original", "converted_cpu_kernel", "converted_device_path")]
        lines.append(f"| {r['context']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@table("decode_layers")
def decode_layers() -> str:
    """docs/hybrid.md: one decode token's time inside the running model, against the bound the
    head map allows (every replaced head free beyond its projections)."""
    data = load("decode_layers/decode_layers.json")
    lines = [
        "| context | original step | converted step | ratio | head-map bound | bound ratio | attention layers, original -> converted | the rest |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['context']:,} | {r['step_ms_original']:.1f} ms | {r['step_ms_converted']:.1f} ms | {r['decode_ratio']:.2f}x | "
            f"{r['head_map_bound_step_ms']:.1f} ms | {r['head_map_bound_ratio']:.2f}x | "
            f"{r['attention_ms_original']:.1f} -> {r['attention_ms_converted']:.1f} ms | {r['rest_ms_original']:.1f} -> {r['rest_ms_converted']:.1f} ms |"
        )
    return "\n".join(lines)


@table("speed_2k_quiet")
def speed_2k_quiet() -> str:
    """docs/hybrid.md: 2,048 tokens through generate(), 15 interleaved runs on a quiet machine,
    the trained hybrid and the training-free baseline at the same bytes."""
    lines = ["| model (against the original in its own process) | prefill, original -> converted | decode, original -> converted |", "|---|---:|---:|"]
    for name, label in (("converted", "trained hybrid"), ("sink_recent", "sink_recent(4, 64), training-free, same bytes")):
        (r,) = load(f"speed_2k_quiet/{name}.json")["rows"]
        lines.append(f"| {label} | {_pair(r['prefill_tps_original'], r['prefill_tps_converted'], '.1f')} | {_pair(r['decode_tps_original'], r['decode_tps_converted'], '.2f')} |")
    return "\n".join(lines)


@table("fit_paths")
def fit_paths() -> str:
    """docs/hybrid.md: the default recipe's phases with the training forwards on the rank-masked
    path and on the tiled path, same code otherwise."""
    old, new = load("fit_paths/rank_masked_summary.json"), load("fit_paths/tiled_summary.json")
    command = new["provenance"]["command"].split()
    train_steps = command[command.index("--trainer.max_steps") + 1]
    steps = f"{new['transfer']['steps_run']} transfer + {train_steps} training steps, {new['train_tokens']:,} training tokens"
    lines = ["| phase (" + steps + ") | rank-masked (before) | tiled (now) | speedup |", "|---|---:|---:|---:|"]
    for phase, label in (("transfer", "attention transfer"), ("train", "end-to-end training"), ("measure", "perplexity, original and converted")):
        a, b = old["phases"][phase], new["phases"][phase]
        lines.append(f"| {label} | {a:.1f} s | {b:.1f} s | {a / b:.2f}x |")
    a, b = old["wall_seconds"], new["wall_seconds"]
    lines.append(f"| whole fit | {a:.1f} s | {b:.1f} s | {a / b:.2f}x |")
    lines.append(f"| perplexity ratio | {old['ppl_ratio']:.6f} | {new['ppl_ratio']:.6f} | |")
    return "\n".join(lines)


@table("train_block")
def train_block() -> str:
    """docs/hybrid.md: one training step of the default fit's model, tiled vs rank-masked."""
    data = load("train_block/train_block_quiet.json")
    lines = ["| block | tiled (now), median s | rank-masked (before), median s | ratio | peak RSS growth, tiled / rank-masked |", "|---|---:|---:|---:|---:|"]
    for r in data["shapes"]:
        old = r.get("old", {})
        old_s = f"{old['median_s']:.1f}" if "median_s" in old else "not run"
        ratio = f"{old['median_s'] / r['new']['median_s']:.1f}x" if "median_s" in old else "-"
        rss = f"{r['new']['peak_rss_growth_mib'] / 1024:.1f} / " + (f"{old['peak_rss_growth_mib'] / 1024:.1f} GiB" if "median_s" in old else "- GiB")
        lines.append(f"| {r['batch']} x {r['length']:,} | {r['new']['median_s']:.1f} | {old_s} | {ratio} | {rss} |")
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
