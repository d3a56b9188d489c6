"""The GPU path's precision work measured on the embedded default (issue 35), in docs/scale.md: the
float32 default before and after (quality, speed, beam search), and bf16 against float32 for the same
steps."""

from __future__ import annotations

from tables import load, table

FOLDER = "precision_smollm2_b05"


def _speed(data: dict) -> dict[int, dict]:
    return {r["context"]: r for r in data["rows"] if r["batch"] == 1}


@table("precision_before_after")
def before_after() -> str:
    fits = {k: load(f"{FOLDER}/fit_{k}_summary.json") for k in ("before", "after")}
    speeds = {k: _speed(load(f"{FOLDER}/speed_{k}.json")) for k in ("before", "after")}
    beams = {k: load(f"{FOLDER}/beams_{k}.json") for k in ("before", "after")}
    commit = {k: fits[k]["provenance"]["commit"][:7] for k in fits}
    lines = [
        f"| the float32 default (`smollm2_b05`) | before ({commit['before']}) | after ({commit['after']}) |",
        "|---|---:|---:|",
        "| perplexity ratio to the original, validation blocks | "
        + " | ".join(f"{fits[k]['ppl_ratio']:.4f} ({fits[k]['ppl_converted']:.6f} / {fits[k]['ppl_original']:.6f})" for k in fits) + " |",
        "| attention transfer, mean relative MSE after (short / long blocks) | "
        + " | ".join(f"{fits[k]['transfer']['mean_mse_after']:.6f} / {fits[k]['transfer']['mean_mse_after_long']:.6f}" for k in fits) + " |",
    ]  # fmt: skip
    again = {k: _speed(load(f"{FOLDER}/speed_{k}_8k_runs5.json")) for k in ("before", "after")}  # a second pair
    for label, runs in (("3 runs", speeds), ("5 runs, a second pair", again)):
        for context in sorted(runs["after"]):
            for phase in ("prefill", "decode"):
                cells = []
                for k in ("before", "after"):
                    r = runs[k][context]
                    cells.append(f"{r[f'{phase}_tps_original']:.1f} -> {r[f'{phase}_tps_converted']:.1f} tok/s ({r[f'{phase}_ratio']:.2f}x)")
                lines.append(f"| {phase} at {context:,} tokens ({label}), original -> converted | " + " | ".join(cells) + " |")
    b = beams["after"]
    lines.append(
        f"| beam search ({b['beams']} beams, {b['new_tokens']} new tokens after {b['prompt_tokens']}): largest gap to a full forward | "
        + " | ".join(f"{beams[k]['max_abs_diff_nats']:.3g} nats" for k in ("before", "after")) + " |"
    )  # fmt: skip
    return "\n".join(lines)


@table("precision_bf16")
def bf16_against_float32() -> str:
    runs = {k: load(f"{FOLDER}/pair_{k}_summary.json") for k in ("float32", "bfloat16")}
    mamba = load(f"{FOLDER}/mamba_bf16_summary.json")
    lines = [
        "| run (same steps, CPU) | perplexity, original | perplexity, converted | ratio | wall time |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, run in runs.items():
        lines.append(
            f"| `smollm2_b05` (hybrid), {k} | {run['ppl_original']:.3f} | {run['ppl_converted']:.3f} | {run['ppl_ratio']:.4f} "
            f"| {run['wall_seconds'] / 60:.1f} min |"
        )  # fmt: skip
    gap = runs["bfloat16"]["ppl_ratio"] - runs["float32"]["ppl_ratio"]
    lines.append(f"| bf16 ratio minus float32 ratio | | | {gap:+.4f} | |")
    lines.append(
        f"| `smollm2_mamba_b05`, bf16, 2 transfer + 2 training steps (the command that crashed) | {mamba['ppl_original']:.3f} "
        f"| {mamba['ppl_converted']:.3f} | {mamba['ppl_ratio']:.3f} | {mamba['wall_seconds'] / 60:.1f} min |"
    )  # fmt: skip
    return "\n".join(lines)
