"""What attention transfer costs for a 7B recipe: a scaled-down run, measured, and the arithmetic that
carries it to the recipe's model.

    python benchmarks/transfer_scale.py --recipe llama2_b09 --json benchmarks/results/transfer_scale/llama2_b09.json

The scaled-down model has the recipe's family, head dim, attention layout (MHA for Llama-2) and
dtype (bf16), with fewer and narrower layers and random weights; it is converted with the recipe's
policy fraction (beta over KV groups), its operator and its transfer settings (fewer steps), all
through the production code (``rfkit.training.transfer.transfer``). Measured on it: the captured
bytes (host memory that transfer holds) and the growth of the process's resident memory over a
capture alone, the mixers' parameters, and seconds per step on this machine (a CPU: the blocks
train on the CPU, where on a GPU they train on the device). The arithmetic uses the same
per-token formula with the recipe's model shape (its config.json, written below as numbers):

- host memory: ``itemsize(model dtype) * (d_in + d_out)`` per token per converted layer, summed
  over layers, times ``samples * data.seq_len`` tokens (plus the long blocks for recipes that
  capture them);
- GPU memory during transfer (before FSDP shards anything, so on every rank): the bf16 model,
  the float32 mixers with their gradients and AdamW's two moments, and one step's uploads;
- time per step: the mixers' FLOPs (forward and backward: 6 per weight and token for the matmuls,
  3 times the forward's scan or window attention) at a stated throughput, and the step's uploads
  at a stated host-to-device bandwidth; the capture is not counted.

The scaled-down run checks the formula: its measured captured bytes must equal the formula's.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent

# The recipes' base models, from their config.json (layers, heads, KV heads, head dim, hidden).
SHAPES = {
    "meta-llama/Llama-2-7b-hf": dict(family="llama", layers=32, heads=32, kv_heads=32, head_dim=128, hidden=4096, params=6.74e9),
    "Qwen/Qwen2-7B": dict(family="qwen2", layers=28, heads=28, kv_heads=4, head_dim=128, hidden=3584, params=7.62e9),
    "Qwen/Qwen2-0.5B": dict(family="qwen2", layers=24, heads=14, kv_heads=2, head_dim=64, hidden=896, params=0.49e9),
}  # fmt: skip
ASSUMED_TFLOPS = 100.0  # sustained float32 (TF32) matmul throughput assumed for the time estimate
ASSUMED_UPLOAD_GBPS = 25.0  # pinned host-to-device copies over PCIe 4.0 x16


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def replaced_per_layer(layers: int, kv_heads: int, beta: float) -> list[int]:
    """KV groups replaced per layer when ``beta`` of all KV groups go (spread evenly: the real
    selection follows RA-I, the totals are what the arithmetic needs)."""
    total = int(beta * layers * kv_heads + 0.5)
    return [total // layers + (1 if i < total % layers else 0) for i in range(layers)]


def mixer_params(operator: dict, d_in: int, d_out: int, head_dim: int, kv: int, q: int) -> int:
    """Parameters of one layer's mixer for the recipe's operator (``class_path`` + ``init_args``)."""
    args, name = operator.get("init_args", {}), operator["class_path"].rsplit(".", 1)[-1]
    if name == "MambaOperator":
        expand, n, conv = args.get("expand", 2), args.get("d_state", 16), args.get("d_conv", 4)
        rank = args.get("dt_rank", "auto")
        rank = -(-d_in // 16) if rank == "auto" else rank
        inner = expand * d_in
        return 2 * inner * d_in + inner * (conv + 1) + inner * (rank + 2 * n) + (rank + 1) * inner + inner * d_out + inner * (n + 1)
    if name == "HybridOperator":
        return kv * head_dim * args.get("feature_dim", 16) // 2 + 2 * q + (kv if args.get("decay_horizon") else 0)
    raise SystemExit(f"--recipe: operator {name} is not covered by this script")


def mixing_flops(operator: dict, d_in: int, q: int, head_dim: int) -> int:
    """Forward FLOPs a token of one layer's mixer spends outside its weights' matmuls: the Mamba
    scan (about 9 per state number: decay, input, read-out) or the window attention over sink +
    window keys plus the feature-map read of the state (4 per key and query dimension each)."""
    args, name = operator.get("init_args", {}), operator["class_path"].rsplit(".", 1)[-1]
    if name == "MambaOperator":
        return 9 * args.get("expand", 2) * d_in * args.get("d_state", 16)
    return 4 * q * head_dim * (args.get("sink", 4) + args.get("window", 56) + args.get("feature_dim", 16))


def capture_numbers(operator: dict, kv: int, q: int, head_dim: int) -> tuple[int, int]:
    """(d_in, d_out) of a layer's mixer: values of its KV heads (plus the queries and keys for
    operators that keep attending), and its query heads' outputs."""
    qkv = operator["class_path"].rsplit(".", 1)[-1] != "MambaOperator"
    return ((q + 2 * kv) if qkv else kv) * head_dim, q * head_dim


def arithmetic(recipe: dict, shape: dict) -> dict:
    """The recipe's transfer at full scale, from the per-token formula."""
    model, data = recipe["model"], recipe["data"]
    transfer, operator = model["transfer"], model["operator"]
    beta = model["policy"]["init_args"]["beta"]
    per_kv = shape["heads"] // shape["kv_heads"]
    itemsize = 2 if model.get("dtype") == "bfloat16" else 4
    numbers, params, mixing = 0, 0, 0
    for kv in replaced_per_layer(shape["layers"], shape["kv_heads"], beta):
        if kv:
            d_in, d_out = capture_numbers(operator, kv, kv * per_kv, shape["head_dim"])
            numbers += d_in + d_out
            params += mixer_params(operator, d_in, d_out, shape["head_dim"], kv, kv * per_kv)
            mixing += mixing_flops(operator, d_in, kv * per_kv, shape["head_dim"])
    tokens = transfer["samples"] * data["seq_len"]
    long_tokens = transfer.get("long_samples", 0) * transfer.get("long_seq_len", 0) if transfer.get("long_source") else 0
    step_tokens = transfer["batch_size"] * min(transfer.get("seq_len") or data["seq_len"], data["seq_len"])
    step_tokens += transfer.get("long_batch_size", 0) * transfer.get("long_seq_len", 0) if long_tokens else 0
    flops = (6 * params + 3 * mixing) * step_tokens  # forward + backward: weights' matmuls, scan / window
    return {
        "bytes_per_token": itemsize * numbers,
        "host_bytes": itemsize * numbers * (tokens + long_tokens),
        "captured_tokens": tokens + long_tokens,
        "mixer_params": params,
        "gpu_bytes": {
            "model_bf16": int(2 * shape["params"]),
            "mixers_fp32_with_grads_and_adam": 16 * params,  # weights, gradients, two AdamW moments
            "step_uploads": itemsize * numbers * step_tokens,
        },
        "step_tokens": step_tokens,
        "step_seconds_at_assumed_tflops": flops / (ASSUMED_TFLOPS * 1e12),
        "step_upload_seconds_at_assumed_bandwidth": itemsize * numbers * step_tokens / (ASSUMED_UPLOAD_GBPS * 1e9),
        "steps": transfer["steps"],
        "assumed_tflops": ASSUMED_TFLOPS,
        "assumed_upload_gbps": ASSUMED_UPLOAD_GBPS,
    }


def measured(recipe: dict, shape: dict, layers: int, hidden_heads: int, samples: int, steps: int, seq_len: int) -> dict:
    """Transfer of the recipe on a scaled-down model of its family (module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from rfkit.models.modeling import to_recurformer
    from rfkit.models.operators import ReplacementOperator
    from rfkit.training.transfer import TransferConfig, capture, captured_bytes, transfer

    model_cfg = recipe["model"]
    hd, per_kv = shape["head_dim"], shape["heads"] // shape["kv_heads"]
    kv_heads = max(1, hidden_heads // per_kv)
    heads = kv_heads * per_kv
    kw = dict(vocab_size=512, hidden_size=heads * hd, intermediate_size=2 * heads * hd, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4 * seq_len)  # fmt: skip
    torch.manual_seed(0)
    if shape["family"] == "llama":
        base = LlamaForCausalLM(LlamaConfig(**kw, head_dim=hd))
    else:
        base = Qwen2ForCausalLM(Qwen2Config(**kw, use_sliding_window=False))
    base = base.to(torch.bfloat16 if model_cfg.get("dtype") == "bfloat16" else torch.float32).eval()
    counts = replaced_per_layer(layers, kv_heads, model_cfg["policy"]["init_args"]["beta"])
    selected = [[g * per_kv + j for g in range(count) for j in range(per_kv)] for count in counts]
    model = to_recurformer(base, selected, ReplacementOperator.from_dict(model_cfg["operator"]))
    settings = dict(model_cfg["transfer"], steps=steps, samples=samples, long_source=None)
    config = TransferConfig(**settings)
    blocks = torch.randint(0, 512, (samples, seq_len), generator=torch.Generator().manual_seed(1))
    before = rss_bytes()
    held = capture(model, blocks, batch_size=config.batch_size, progress=False)  # what transfer keeps
    rss_growth, held_bytes = rss_bytes() - before, captured_bytes(held)
    del held
    started = time.time()
    report = transfer(model, blocks, config, progress=False)
    per_kv_numbers = 0
    for count in counts:
        if count:
            d_in, d_out = capture_numbers(model_cfg["operator"], count, count * per_kv, hd)
            per_kv_numbers += d_in + d_out
    itemsize = next(model.parameters()).element_size()
    params = sum(p.numel() for n, p in model.named_parameters() if ".mixer." in n)
    return {
        "model": {"family": shape["family"], "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": hd,
                  "dtype": str(next(model.parameters()).dtype)},  # fmt: skip
        "replaced_kv_heads_per_layer": counts,
        "samples": samples,
        "seq_len": seq_len,
        "steps_run": report["steps_run"],
        "captured_bytes": report["captured_bytes"],
        "formula_bytes": itemsize * per_kv_numbers * samples * seq_len,
        "capture_rss_growth_bytes": rss_growth,  # the process's resident memory over a capture alone
        "capture_held_bytes": held_bytes,
        "mixer_params": params,
        "formula_mixer_params": sum(
            mixer_params(model_cfg["operator"], *capture_numbers(model_cfg["operator"], c, c * per_kv, hd), hd, c, c * per_kv)
            for c in counts if c
        ),  # fmt: skip
        "transfer_seconds": round(time.time() - started, 2),
        "seconds_per_step": round(len(report["losses"]) and (report["seconds"] / max(1, report["steps_run"])), 2),
        "mixer_dtypes": sorted({str(p.dtype) for n, p in model.named_parameters() if ".mixer." in n}),
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "mse": [report["mean_mse_before"], report["mean_mse_after"]],
    }


def main(argv: list[str] | None = None) -> int:
    from rfkit.atomic import atomic_write_json
    from rfkit.provenance import stamp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="llama2_b09")
    parser.add_argument("--layers", type=int, default=4, help="layers of the scaled-down model")
    parser.add_argument("--heads", type=int, default=8, help="query heads of the scaled-down model")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    started = time.time()
    recipe = yaml.safe_load((ROOT / "recipes" / f"{args.recipe}.yaml").read_text())
    shape = SHAPES[recipe["model"]["base_model"]]
    result = {
        "recipe": args.recipe,
        "base_model": recipe["model"]["base_model"],
        "full_scale": arithmetic(recipe, shape),
        "scaled_down": measured(recipe, shape, args.layers, args.heads, args.samples, args.steps, recipe["data"]["seq_len"]),
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, stamp(result, started=started))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
