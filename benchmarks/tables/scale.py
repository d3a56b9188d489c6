"""What attention transfer costs for the GPU recipes (``benchmarks/transfer_scale.py``: a scaled-down
run measured on this CPU, and the per-token arithmetic carried to the recipe's model), in docs/scale.md."""

from __future__ import annotations

from tables import load, table

RECIPES = ("llama2_b09", "llama2_b09_hybrid", "qwen2_7b_b09", "qwen2_7b_b09_hybrid", "qwen2_05b_b05", "qwen2_05b_b05_hybrid")


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} billion" if n >= 1e9 else f"{n / 1e6:.2f} million"


@table("transfer_scale")
def transfer_scale() -> str:
    lines = [
        "| recipe | captures in host RAM (per rank) | per token | GPU: bf16 model + new weights (float32, grads, AdamW) + one step's uploads | new weights | a step: compute at 100 TFLOP/s, uploads at 25 GB/s (x steps) | scaled-down run: captured = formula, s/step on this CPU |",
        "|---|---:|---:|---|---:|---:|---|",
    ]  # fmt: skip
    for name in RECIPES:
        data = load(f"transfer_scale/{name}.json")
        full, small = data["full_scale"], data["scaled_down"]
        gpu = full["gpu_bytes"]
        total = sum(gpu.values())
        check = "yes" if small["captured_bytes"] == small["formula_bytes"] and small["mixer_params"] == small["formula_mixer_params"] else "NO"
        lines.append(
            f"| `{name}` | {_gb(full['host_bytes'])} ({full['captured_tokens']:,} tokens) | {full['bytes_per_token']:,} B "
            f"| {_gb(gpu['model_bf16'])} + {_gb(gpu['mixers_fp32_with_grads_and_adam'])} + {_gb(gpu['step_uploads'])} = {_gb(total)} "
            f"| {_count(full['mixer_params'])} | {full['step_seconds_at_assumed_tflops'] * 1e3:,.0f} ms, "
            f"{full['step_upload_seconds_at_assumed_bandwidth'] * 1e3:,.0f} ms (x {full['steps']:,}) "
            f"| {check}: {_gb(small['captured_bytes'])} on {small['model']['layers']} layers x {small['model']['heads']} heads, "
            f"{small['seconds_per_step']:.1f} s |"
        )  # fmt: skip
    return "\n".join(lines)


#: README "Convert your own model": the recipe to start from, what it suits, where it runs
OWN_MODEL = (
    ("qwen2_05b_b05_hybrid", "up to about 1B parameters, MHA or GQA", "one GPU"),
    ("qwen2_7b_b09_hybrid", "7B GQA (Qwen2, Mistral, Llama 3)", "one GPU or a node (FSDP)"),
    ("llama2_b09_hybrid", "7B MHA (Llama 2)", "one GPU or a node (FSDP)"),
)


@table("own_model")
def own_model() -> str:
    """The hybrid recipes' attention-transfer costs (the transfer_scale files), for a reader
    choosing where to start."""
    lines = [
        "| start from | for | runs on | transfer: GPU memory before activations | host RAM (captures) | transfer time |",
        "|---|---|---|---:|---:|---:|",
    ]
    for name, suits, where in OWN_MODEL:
        full = load(f"transfer_scale/{name}.json")["full_scale"]
        step = full["step_seconds_at_assumed_tflops"] + full["step_upload_seconds_at_assumed_bandwidth"]
        minutes = step * full["steps"] / 60
        lines.append(
            f"| `{name}` | {suits} | {where} | {_gb(sum(full['gpu_bytes'].values()))} | {_gb(full['host_bytes'])} "
            f"| {minutes:.1f} min ({full['steps']:,} steps) |"
        )  # fmt: skip
    return "\n".join(lines)
