"""The GPU path's precision work measured on the embedded default (issue 35), in docs/scale.md: the
float32 default before and after (quality, speed, beam search), and bf16 against float32 for the same
steps."""

from __future__ import annotations

from tables import load, table
from tables.front import baseline_row

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


def _machine(data: dict) -> str:
    return data["provenance"].get("machine") or "machine not recorded"


@table("precision_auto_demo")
def auto_demo() -> str:
    """``make demo`` under ``model.dtype: auto`` (bf16 on a CPU with native bf16) against the float32
    demo before it: quality on the validation blocks and on long documents, and the fit's time."""
    fits = {"float32": load(f"{FOLDER}/demo_float32_summary.json"), "bf16": load("demo_smollm2_b05_screen/summary.json")}
    contexts = {"float32": load("context_smollm2_b05_current/context.json"), "bf16": load("context_smollm2_b05_bf16/context.json")}
    lengths = [str(n) for n in contexts["bf16"]["lengths"]]
    keys = list(fits)

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(k) for k in keys) + " |"

    def ratios(r: dict) -> str:
        return " / ".join(f"{r['ppl_ratio'][n]:.3f}" for n in lengths)

    def passkey(r: dict) -> str:
        return " / ".join(f"{r['passkey'][n]:.2f}" for n in lengths)

    span = " / ".join(f"{int(n):,}" for n in lengths)
    lines = [
        "| `rfkit fit --config recipes/smollm2_b05.yaml` | " + " | ".join(f"{k} ({fits[k]['provenance']['date'][:10]}; {_machine(fits[k])})" for k in keys) + " |",
        "|---|---:|---:|",
        row("perplexity, original / converted (validation blocks)", lambda k: f"{fits[k]['ppl_original']:.3f} / {fits[k]['ppl_converted']:.3f}"),
        row("perplexity ratio", lambda k: f"{fits[k]['ppl_ratio']:.4f}"),
        row(f"long documents, perplexity ratio at {span} tokens", lambda k: ratios(contexts[k]["rows"]["converted"])),
        row(f"passkey at {span} tokens, original", lambda k: passkey(contexts[k]["rows"]["original"])),
        row(f"passkey at {span} tokens, converted", lambda k: passkey(contexts[k]["rows"]["converted"])),
        row("training-free baseline at the same bytes", lambda k: baseline_row(contexts[k]["rows"])[0]),
        row(f"its long-document ratio at {span} tokens", lambda k: ratios(baseline_row(contexts[k]["rows"])[1])),
        row("KV cache bytes per token, original -> converted", lambda k: f"{fits[k]['cache_bytes_per_token_original']:,.0f} -> {fits[k]['cache_bytes_per_token_converted']:,.0f}"),
        row("fit wall time (transfer / training)", lambda k: f"{fits[k]['wall_seconds'] / 60:.1f} min ({fits[k]['phases']['transfer'] / 60:.1f} / {fits[k]['phases']['train'] / 60:.1f} min)"),
    ]  # fmt: skip
    return "\n".join(lines)


@table("precision_auto_same_machine")
def auto_same_machine() -> str:
    """bf16 against float32 on one machine: a short fit's phases and steps (``fit_phases.py``) and
    decode / prefill ratios to the original in the same dtype (``rfkit bench speed``)."""
    phases = {k: load(f"{FOLDER}/phases_{k}.json") for k in ("float32", "bfloat16")}
    speeds = {"float32": _speed(load("speed_bf16/converted_as_float32.json")), "bfloat16": _speed(load("speed_bf16/converted.json"))}
    keys = list(phases)

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(k) for k in keys) + " |"

    def step(k: str, n: str) -> str:
        s = phases[k]["train"]["by_block_length"][n]
        return f"{s['forward_s'] + s['backward_s']:.1f} s ({s['forward_s']:.1f} + {s['backward_s']:.1f})"

    lines = [
        "| one machine (" + _machine(load("speed_bf16/converted.json")) + ") | float32 | bf16 |",
        "|---|---:|---:|",
        row("short fit (6 transfer + 8 training steps): wall time", lambda k: f"{phases[k]['wall_s'] / 60:.1f} min"),
        row("its perplexity ratio", lambda k: f"{phases[k]['ppl_ratio']:.4f}"),
        row("measuring both models' perplexity", lambda k: f"{phases[k]['phases_s']['measure']:.0f} s"),
        row("attention transfer: capture / training (6 steps)", lambda k: f"{phases[k]['transfer']['capture_s']:.0f} s / {phases[k]['transfer']['training_s']:.0f} s"),
        row("training step, 4 x 512 tokens (forward + backward)", lambda k: step(k, "512")),
        row("training step, 1 x 2,048 tokens (forward + backward)", lambda k: step(k, "2048")),
    ]
    for context in sorted(speeds["bfloat16"]):
        for phase in ("decode", "prefill"):
            lines.append(row(
                f"{phase} at {context:,} tokens, original -> converted (same dtype)",
                lambda k: f"{speeds[k][context][f'{phase}_tps_original']:.1f} -> {speeds[k][context][f'{phase}_tps_converted']:.1f} tok/s ({speeds[k][context][f'{phase}_ratio']:.2f}x)",
            ))  # fmt: skip
    return "\n".join(lines)


@table("precision_step_profile")
def step_profile() -> str:
    """One bf16 training step through torch.profiler: where its time goes, by region and by operator kind."""
    run = load(f"{FOLDER}/profile_bfloat16.json")
    p = run["profile"]
    total = sum(p["by_kind_s"].values())
    lines = [
        f"| one training step of the default recipe, {p['length']}-token blocks, {p['tokens']:,} tokens, bf16 ({_machine(run)}) | seconds | share of the operators' time |",
        "|---|---:|---:|",
    ]
    regions = (
        ("teacher forward", "the teacher's forward"),
        ("mixer forward", "the replacement mixers' forwards"),
        ("loss on the logits", "the loss on the logits, CE and KL (forward)"),
    )
    lines += [f"| inside {label} | {p['regions_s'][key]:.2f} | {p['regions_s'][key] / total:.0%} |" for key, label in regions]
    lines += [f"| operators, {kind} (forward and backward) | {s:.2f} | {s / total:.0%} |" for kind, s in p["by_kind_s"].items()]
    rows = load(f"{FOLDER}/loss_rows.json")  # the lever it named, timed alone on the same shape
    shape = "x".join(str(n) for n in rows["shape"])
    for name, label in (("plain", "the plain expressions (before)"), ("rowwise", "`rowwise_loss` in PyTorch ops (before the compiled loss)")):
        lines.append(f"| CE + KL on {shape} {rows['dtype']} logits, forward and backward: {label}, median of {rows['runs']} | {rows['median_s'][name]:.2f} | - |")
    return "\n".join(lines)


AMX = "demo_smollm2_b05_amx"


def _fit_rows(fits: dict, phases: tuple[str, ...]) -> list[str]:
    """Rows of fits side by side (one column each): precision, perplexity ratio, wall time and
    the time of each phase."""

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(f) for f in fits.values()) + " |"

    lines = [
        row("precision", lambda f: f["precision"].split(",")[0]),
        row("perplexity ratio, validation blocks", lambda f: f"{f['ppl_ratio']:.4f}"),
        row("fit wall time", lambda f: f"{f['wall_seconds'] / 60:.1f} min"),
    ]
    return lines + [row(f"of which {phase}", lambda f, phase=phase: f"{f['phases'][phase] / 60:.1f} min") for phase in phases]


@table("precision_amx")
def amx() -> str:
    """``make demo`` on a CPU with AMX, before and after the compiled loss (the first run also
    profiled the heads and measured the original: caches of a fresh machine), and the loss on the
    logits timed alone there."""
    fits = {"before": load(f"{AMX}_before_kernel/summary.json"), "after": load(f"{AMX}/summary.json")}
    rows = load(f"{AMX}/loss_rows.json")
    lines = [
        f"| `rfkit fit --config recipes/smollm2_b05.yaml` on {_machine(fits['after'])} | first run, before the compiled loss | caches warm, compiled loss |",
        "|---|---:|---:|",
    ]  # fmt: skip
    lines += _fit_rows(fits, ("profile", "measure", "transfer", "train"))
    shape = "x".join(str(n) for n in rows["shape"])
    lines += ["", f"| CE + KL on {shape} {rows['dtype']} logits, forward and backward, median of {rows['runs']} (same machine) | seconds |", "|---|---:|"]
    for name, label in (("plain", "the plain expressions"), ("rowwise_pytorch", "`rowwise_loss` in PyTorch ops"), ("rowwise", "`rowwise_loss`, compiled")):
        lines.append(f"| {label} | {rows['median_s'][name]:.2f} |")
    return "\n".join(lines)


KERNEL = "demo_smollm2_b05_amx_train_kernel"


@table("precision_amx_kernel")
def amx_kernel() -> str:
    """``make demo`` on the AMX machine before and after the window mixers' compiled training
    kernel; the new fit's quality against the float32 fit issue 48 measures against; and the
    mixer's forward and backward alone, kernel against its PyTorch twin."""
    fits = {"before": load(f"{AMX}/summary.json"), "after": load(f"{KERNEL}/summary.json")}
    reference = {"fit": load(f"{FOLDER}/demo_float32_summary.json"), "context": load("context_smollm2_b05_current/context.json")}
    context = load(f"{KERNEL}/context.json")
    twin = {"fit": load(f"{KERNEL}/summary_pytorch_path.json"), "context": load(f"{KERNEL}/context_pytorch_path.json")}
    mixer = load(f"{KERNEL}/mixer_train.json")
    lengths = [str(n) for n in context["lengths"]]
    span = " / ".join(f"{int(n):,}" for n in lengths)

    def joined(row: dict, key: str, digits: int) -> str:
        return " / ".join(f"{row[key][n]:.{digits}f}" for n in lengths)

    lines = [
        f"| `rfkit fit --config recipes/smollm2_b05.yaml` on {_machine(fits['after'])} | mixers in PyTorch | compiled training kernel |",
        "|---|---:|---:|",
    ]  # fmt: skip
    lines += _fit_rows(fits, ("transfer", "train"))
    after, ref, pair = context["rows"], reference["context"]["rows"], twin["context"]["rows"]
    lines += [
        "",
        f"| quality | float32 fit ({reference['fit']['provenance']['date'][:10]}) | bf16 fit, PyTorch mixers (same code, `RFKIT_CPU_KERNEL=0`) | bf16 fit, compiled kernel |",
        "|---|---:|---:|---:|",
        f"| perplexity ratio, validation blocks | {reference['fit']['ppl_ratio']:.4f} | {twin['fit']['ppl_ratio']:.4f} | {fits['after']['ppl_ratio']:.4f} |",
        f"| long documents, perplexity ratio at {span} tokens | {joined(ref['converted'], 'ppl_ratio', 3)} | {joined(pair['converted'], 'ppl_ratio', 3)} | {joined(after['converted'], 'ppl_ratio', 3)} |",
        f"| passkey at {span} tokens, original | {joined(ref['original'], 'passkey', 2)} | {joined(pair['original'], 'passkey', 2)} | {joined(after['original'], 'passkey', 2)} |",
        f"| passkey at {span} tokens, converted | {joined(ref['converted'], 'passkey', 2)} | {joined(pair['converted'], 'passkey', 2)} | {joined(after['converted'], 'passkey', 2)} |",
        "",
        f"| one hybrid block's forward + backward, {mixer['dtype']} activations, median of {mixer['runs']} (same machine) | PyTorch tiled path | compiled | speedup |",
        "|---|---:|---:|---:|",
    ]  # fmt: skip
    for r in mixer["rows"]:
        B, L = r["shape"]
        lines.append(
            f"| {r['kv_heads']} KV head{'s' if r['kv_heads'] > 1 else ''} ({r['query_heads']} query heads), {B} x {L:,} tokens "
            f"| {r['median_ms']['pytorch']:.1f} ms | {r['median_ms']['compiled']:.1f} ms | {r['speedup']:.1f}x |"
        )
    return "\n".join(lines)
