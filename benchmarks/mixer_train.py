"""The window mixers' training forward and backward: the compiled kernel
(``kernels/hybrid_train_cpu.c``, :func:`rfkit.ops.cpu_kernels.window_train_cpu`) against its PyTorch
twin (the tiled path, ``WindowAttention.use_kernel = False``), on the default recipe's blocks.

    python benchmarks/mixer_train.py [--groups 1,2,3] [--shapes 4x512,1x2048] [--runs 7]
        [--dtype bfloat16] [--output benchmarks/results/demo_smollm2_b05_amx_train_kernel/mixer_train.json]

One hybrid block as the default recipe builds it on SmolLM2 (head width 64, three query heads per
KV head, sink 4, window 56, 16 features, the decay, gates open) per number of replaced KV heads in a
layer (``--groups``: the recipe replaces one to three of a layer's three); every attention-transfer
step and every training step runs one forward and backward of such a block per converted layer on
a 4 x 512 Wikipedia batch and a 1 x 2,048 Shakespeare block. The activations are bf16 (a bf16-true
fit's), the loss a fixed weighted sum of the output. The two run interleaved, the order
alternating, after one untimed run each; medians of ``--runs``. Also records the largest
difference of the output and of every gradient between the two, relative to the largest value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def block(groups: int):
    from rfkit.models.hybrid import HybridWindowAttention

    b = HybridWindowAttention([g for g in range(groups) for _ in range(3)], 64, window=56, sink=4, feature_dim=16, decay_horizon=128.0)
    with torch.no_grad():
        b.gate.copy_(torch.linspace(0.2, 1.0, b.num_heads))
    return b.train()


def step(b, q, k, v) -> tuple[float, list[torch.Tensor]]:
    """Seconds for one forward and backward, and the output and gradients."""
    b.zero_grad(set_to_none=True)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    t0 = time.perf_counter()
    y = b.attend(q, k, v)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    seconds = time.perf_counter() - t0
    return seconds, [y.detach(), q.grad, k.grad, v.grad, *(p.grad for p in b.parameters())]


def main(argv: list[str] | None = None) -> int:
    from rfkit.atomic import atomic_write_json
    from rfkit.models.window import WindowAttention
    from rfkit.ops import cpu_kernels
    from rfkit.provenance import command_line, stamp

    parser = argparse.ArgumentParser(prog="mixer_train.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", default="1,2,3", help="replaced KV heads per layer, comma-separated")
    parser.add_argument("--shapes", default="4x512,1x2048", help="BATCHxLENGTH, comma-separated")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/demo_smollm2_b05_amx_train_kernel/mixer_train.json"))
    args = parser.parse_args(argv)
    if not cpu_kernels.available():
        print(f"mixer_train.py: the CPU kernel did not build: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    started = time.time()
    dtype = getattr(torch, args.dtype)
    rows = []
    for groups in (int(g) for g in args.groups.split(",")):
        b = block(groups)
        for shape in args.shapes.split(","):
            B, L = (int(x) for x in shape.lower().split("x"))
            gen = torch.Generator().manual_seed(B * L + groups)
            q, k, v = (torch.randn(B, h, L, 64, generator=gen).to(dtype) for h in (3 * groups, groups, groups))
            times = {"pytorch": [], "compiled": []}
            results = {}

            def run(name: str, timed: bool) -> None:
                WindowAttention.use_kernel = name == "compiled"
                seconds, results[name] = step(b, q, k, v)
                if timed:
                    times[name].append(seconds)

            try:
                for name in times:
                    run(name, timed=False)
                for r in range(args.runs):
                    for name in list(times) if r % 2 == 0 else list(times)[::-1]:
                        run(name, timed=True)
            finally:
                WindowAttention.use_kernel = True
            diff = max(float((a.float() - c.float()).abs().max() / c.float().abs().max().clamp_min(1e-30)) for a, c in zip(results["compiled"], results["pytorch"]))
            medians = {name: statistics.median(ts) for name, ts in times.items()}
            rows.append({
                "kv_heads": groups, "query_heads": 3 * groups, "shape": [B, L],
                "seconds": {name: [round(t, 5) for t in ts] for name, ts in times.items()},
                "median_ms": {name: round(1e3 * m, 2) for name, m in medians.items()},
                "speedup": round(medians["pytorch"] / medians["compiled"], 2),
                "max_relative_difference": diff,
            })  # fmt: skip
            print(json.dumps({k: rows[-1][k] for k in ("kv_heads", "shape", "median_ms", "speedup", "max_relative_difference")}))
    result = {"dtype": args.dtype, "runs": args.runs, "threads": torch.get_num_threads(), "rows": rows}
    total = {name: sum(r["median_ms"][name] for r in rows) for name in ("pytorch", "compiled")}
    result["all_rows_ms"] = total
    result["speedup_all_rows"] = round(total["pytorch"] / total["compiled"], 2)
    stamp(result, started, command_line([__file__, *(argv if argv is not None else sys.argv[1:])]))
    atomic_write_json(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
