"""Attention transfer's output-space loss per step, its Gram product in float32 against bf16, at a
head map's shapes: what ``rfkit.training.transfer.train_blocks`` runs for every converted layer of
every step (``rfkit.training.output_loss.mapped_mse``, forward and backward), once on the short
batch and once on the long block.

    python benchmarks/transfer_gram.py \\
        --head-map benchmarks/results/levers_smollm2_b09_rank2k8k/beta_0.9/head_map.json \\
        --skip-layers 5,6,7,20,21 [--batches 4x512,1x4096] [--hidden 576] [--head-dim 64] \\
        [--runs 5] --output benchmarks/results/transfer_gram/b09.json

Per layer of the head map, the error ``d`` is ``(batch, tokens, replaced heads x head_dim)``
float32 and ``W_O``'s columns of those heads a random ``(d_out, hidden)`` matrix (the time does not
depend on the values); ``--skip-layers`` leaves out layers whose blocks transfer does not train (a
recipe's ``stateless_layers``: sink + window alone, no weights). Both dtypes run
interleaved, the order alternating, after one untimed run each; medians of ``--runs`` per step
(every layer, every batch). Also reports how far the bf16 loss and gradient are from float32's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _batches(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(b) != 2 or min(b) < 1 for b in out):
        raise SystemExit(f"transfer_gram.py: error: --batches: expected BATCHxTOKENS[,BATCHxTOKENS], got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    from rfkit.atomic import atomic_write_json
    from rfkit.provenance import command_line, stamp
    from rfkit.training.output_loss import mapped_mse

    parser = argparse.ArgumentParser(prog="transfer_gram.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-map", type=Path, required=True, help="a head map: the replaced heads per layer")
    parser.add_argument("--batches", default="4x512,1x4096", help="a step's batches (default: 4 short blocks, 1 long)")
    parser.add_argument("--hidden", type=int, default=576, help="the model's width (W_O's rows)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--skip-layers", default="", help="comma separated: layers whose blocks are not trained")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    batches = _batches(args.batches)
    started = time.time()
    skip = {int(x) for x in args.skip_layers.split(",") if x.strip()}
    selected = json.loads(args.head_map.read_text())["selected"]
    widths = [len(heads) * args.head_dim for i, heads in enumerate(selected) if heads and i not in skip]
    generator = torch.Generator().manual_seed(0)
    layers = []
    for width in widths:
        proj = torch.randn(width, args.hidden, generator=generator) / args.hidden**0.5
        errors = [torch.randn(b, n, width, generator=generator) * 0.1 for b, n in batches]
        layers.append((proj, proj @ proj.T, errors))
    grams = {"float32": lambda g: g, "bfloat16": lambda g: g.bfloat16()}
    cast = [{name: to(gram) for name, to in grams.items()} for _, gram, _ in layers]

    def step(name: str) -> tuple[float, list[float], list[torch.Tensor]]:
        values, grads = [], []
        t0 = time.perf_counter()
        for (proj, _, errors), gram in zip(layers, cast):
            for d in errors:
                d = d.detach().requires_grad_(True)
                loss = mapped_mse(d, gram[name], proj)
                loss.backward()
                values.append(float(loss.detach()))
                grads.append(d.grad)
        return time.perf_counter() - t0, values, grads

    outputs = {name: step(name) for name in grams}  # untimed warm-up, and the values compared
    times = {name: [] for name in grams}
    for run in range(args.runs):
        for name in list(grams) if run % 2 == 0 else list(grams)[::-1]:
            times[name].append(step(name)[0])
    medians = {name: statistics.median(t) for name, t in times.items()}
    (_, v32, g32), (_, v16, g16) = outputs["float32"], outputs["bfloat16"]
    result = {
        "head_map": str(args.head_map), "skipped_layers": sorted(skip), "layers": len(widths), "widths": widths, "batches": batches,
        "hidden": args.hidden, "runs": args.runs, "threads": torch.get_num_threads(),
        "seconds": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
        "median_s": {name: round(m, 4) for name, m in medians.items()},
        "speedup": round(medians["float32"] / medians["bfloat16"], 2),
        "loss_max_rel_difference": max(abs(a - b) / abs(a) for a, b in zip(v32, v16)),
        "grad_max_rel_difference": max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(g32, g16)),
    }  # fmt: skip
    stamp(result, started, command_line([__file__, *(argv if argv is not None else sys.argv[1:])]))
    atomic_write_json(args.output, result)
    print(json.dumps({k: result[k] for k in ("median_s", "speedup", "loss_max_rel_difference", "grad_max_rel_difference")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
