"""docs/evaluations.md: the paper's evaluations on untrained conversions of the embedded default
(sweep over beta, first-token contribution, MQAR smoke) and the history of the cache and
speed benches on the untrained Mamba conversion."""

from __future__ import annotations

from tables import load, provenance, table


def _dated(data: dict) -> str:
    p = provenance(data)
    return f"{(p.get('date') or '')[:10]}, commit {(p.get('commit') or 'unknown')[:7]}"


@table("eval_sweep_untrained")
def sweep_untrained() -> str:
    sweep = load("sweep_smollm2_b05/sweep.json")
    o = sweep["original"]
    lines = [
        "| beta | heads replaced | kept KV | cache bytes | cache ratio | PPL | PPL ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| original | 0 | {o['kept_kv_fraction']:.1%} | {o['cache_bytes']:,} | 1.000 | {o['ppl']:.2f} | 1.000 |",
    ]
    for r in sweep["rows"]:
        lines.append(
            f"| {r['beta']:g} | {r['replaced_heads']}/{r['total_heads']} | {r['kept_kv_fraction']:.1%} | {r['cache_bytes']:,} "
            f"| {r['cache_ratio']:.3f} | {r['ppl']:.2f} | {r['ppl_ratio']:.3f} |"
        )
    return "\n".join(lines)


# (label, key of the first token, key of the other tokens, format of each, format of the ratio)
_FIRST_TOKEN_ROWS = [
    ("attention weight, per token", "weight_first", "weight_other", ".3f", ".4f", ".1f"),
    ("value norm L2", "value_first_l2", "value_other_l2", ".2f", ".2f", ".2f"),
    ("contribution L2, per token", "first_l2", "other_per_token_l2", ".3f", ".4f", ".1f"),
    ("contribution L2, other tokens summed", "first_l2", "other_sum_l2", ".3f", ".3f", ".2f"),
]


@table("eval_first_token")
def first_token() -> str:
    report = load("head_report_smollm2/first_token_contribution.json")
    heads = report["overall"]["all heads"]
    lines = ["| quantity | first token | other tokens | first / other |", "|---|---:|---:|---:|"]
    for label, first, other, f_first, f_other, f_ratio in _FIRST_TOKEN_ROWS:
        a, b = heads[first]["mean"], heads[other]["mean"]
        lines.append(f"| {label} | {a:{f_first}} | {b:{f_other}} | {a / b:{f_ratio}} |")
    return "\n".join(lines)


@table("eval_mqar_smoke")
def mqar_smoke() -> str:
    result = load("mqar_smoke/results.json")
    lengths = result["lengths"]
    lines = ["| beta | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for beta, acc in result["accuracy"].items():
        lines.append(f"| {beta} | " + " | ".join(f"{acc[str(n)]:.3f}" for n in lengths) + " |")
    return "\n".join(lines)


@table("eval_mqar_seeds")
def mqar_seeds() -> str:
    runs = [load("mqar_smoke/results.json"), load("mqar_smoke/seed1/results.json"), load("mqar_smoke/seed2/results.json")]
    betas = list(runs[0]["accuracy"])
    length = str(runs[0]["lengths"][0])
    lines = [
        f"| seed (accuracy at length {length}) | " + " | ".join(f"beta {b}" for b in betas) + " |",
        "|---|" + "---:|" * len(betas),
    ]
    for run in runs:
        seed = run["settings"]["seed"]
        lines.append(f"| {seed} | " + " | ".join(f"{run['accuracy'][b][length]:.3f}" for b in betas) + " |")
    return "\n".join(lines)


@table("eval_cache_history")
def cache_history() -> str:
    cache = load("cache_smollm2_b05_cpu.json")
    mib = 2**20
    lines = [
        f"History ({_dated(cache)}): the paper's Mamba operator converted untrained, then the default.",
        "",
        "| l_g | cache original (MiB) | cache converted (MiB) | cs measured | cs analytic | rel. diff "
        "| prefill peak original (MiB) | prefill peak converted (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in cache["rows"]:
        lines.append(
            f"| {r['l_g']:,} | {r['cache_bytes_original'] / mib:,.2f} | {r['cache_bytes_converted'] / mib:,.2f} "
            f"| {r['cs']:.4f} | {r['cs_analytic']:.4f} | {r['cs_rel_diff']:.2%} "
            f"| {r['prefill_peak_bytes_original'] / mib:,.2f} | {r['prefill_peak_bytes_converted'] / mib:,.2f} |"
        )
    mi = cache["max_input"]
    a, b = mi["original"]["max_input"], mi["converted"]["max_input"]
    lines += [
        "",
        f"Longest prompt within a {cache['max_input_budget_bytes'] / mib:.0f} MiB prefill peak (l_m): "
        f"original {a:,} tokens, converted {b:,} tokens ({b / a:.1f}x).",
    ]
    return "\n".join(lines)


@table("eval_speed_history")
def speed_history() -> str:
    speed = load("speed_smollm2_b05_cpu.json")
    lines = [
        f"History ({_dated(speed)}): the paper's Mamba operator converted untrained, then the default; "
        f"medians of {speed['runs']} runs, {speed['threads']} threads.",
        "",
        "| context | prefill tok/s original | prefill tok/s converted | ratio | decode tok/s original | decode tok/s converted | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in speed["rows"]:
        lines.append(
            f"| {r['context']:,} | {r['prefill_tps_original']:.1f} | {r['prefill_tps_converted']:.1f} | {r['prefill_ratio']:.2f}x "
            f"| {r['decode_tps_original']:.2f} | {r['decode_tps_converted']:.2f} | {r['decode_ratio']:.2f}x |"
        )
    return "\n".join(lines)
