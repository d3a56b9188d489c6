"""Torch calls and wall time of one attention layer's decode step, original against converted, on
both decode paths of the converted model: the compiled C step (CPU, float32) and the PyTorch step
that every other device runs (here forced on CPU with the C step switched off).

    python benchmarks/decode_ops.py --model runs/smollm2_b05/lightning_logs/version_0/model \
        --contexts 2048,8192 --output benchmarks/results/decode_step/decode_ops.json

Counts come from ``rfkit bench speed --layer-step``'s counter (``TorchFunctionMode``: every torch
function, tensor method and tensor attribute read); times are medians over the converted layers
and 8 steps, measured in one process.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a converted model directory")
    parser.add_argument("--contexts", default="2048,8192", help="context lengths, comma separated")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args()

    from rfkit.atomic import atomic_write_json
    from rfkit.experiments.bench import load_pair
    from rfkit.experiments.speed import layer_step
    from rfkit.models.window import WindowAttention
    from rfkit.provenance import stamp

    started = time.time()
    device = torch.device("cpu")
    pair = load_pair(args.model, device)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        row = {"context": context, "original": layer_step(pair.original, context, 0, device)}
        for name, kernel in (("converted_cpu_kernel", True), ("converted_device_path", False)):
            WindowAttention.use_kernel = kernel
            row[name] = layer_step(pair.converted, context, 0, device)
        WindowAttention.use_kernel = True
        rows.append(row)
        print(context, {k: v for k, v in row.items() if k != "context"}, flush=True)
    result = {"kind": "decode_ops", "model": args.model, "threads": torch.get_num_threads(), "rows": rows}
    atomic_write_json(args.output, stamp(result, started, "python benchmarks/decode_ops.py " + " ".join(
        f"--{k} {v}" for k, v in (("model", args.model), ("contexts", args.contexts), ("output", args.output)))))


if __name__ == "__main__":
    main()
