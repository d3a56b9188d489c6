"""One Mamba block's training step on CPU: the compiled training scan against the PyTorch scan.

    python benchmarks/mamba_train_scan.py [--runs 7] [--threads 1]
        [--output benchmarks/results/mamba_train_scan.json]

Times forward and backward (a squared-output loss) of one ``MambaBlock`` in float32 through
``use_fast_path="auto"`` (the C training scan of ``rfkit/ops/kernels/mamba_cpu.c``) and
``use_fast_path="never"`` (the pure-PyTorch prefix scan), the same weights and input, interleaved
run by run with the order alternating, median of ``--runs`` after two untimed steps each. Shapes:
``mqar`` (the MQAR smoke recipe's block: batch 32, 128 tokens, width 64, d_state 8, expand 1)
and ``smollm2`` (a block the size of SmolLM2's replaced heads at batch 4 and 512 tokens: width
192, d_state 16, expand 2). Also checks that the two paths' input gradients agree. Records the
CPU pressure before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

SHAPES = {
    "mqar": {"batch": 32, "length": 128, "width": 64, "d_state": 8, "expand": 1},
    "smollm2": {"batch": 4, "length": 512, "width": 192, "d_state": 16, "expand": 2},
}


def _pressure() -> str | None:
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return None


def main(argv=None) -> int:
    started = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.runs < 1 or args.threads < 1:
        print("mamba_train_scan: --runs and --threads must be at least 1", file=sys.stderr)
        return 2

    import torch

    from rfkit.atomic import atomic_write_json
    from rfkit.models.mamba import MambaBlock
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        print(f"mamba_train_scan: the CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "runs": args.runs, "pressure_before": _pressure(), "shapes": {}}
    for name, shape in SHAPES.items():
        torch.manual_seed(0)
        width = shape["width"]
        blocks = {
            path: MambaBlock(width, width, d_state=shape["d_state"], expand=shape["expand"], use_fast_path=path)
            for path in ("auto", "never")
        }
        blocks["never"].load_state_dict(blocks["auto"].state_dict())
        x = torch.randn(shape["batch"], shape["length"], width)

        def step(path):
            xs = x.clone().requires_grad_()
            blocks[path](xs).square().mean().backward()
            return xs.grad

        grads = {path: step(path) for path in blocks}
        step("auto"), step("never")
        times = {path: [] for path in blocks}
        for run in range(args.runs):
            for path in (("auto", "never") if run % 2 == 0 else ("never", "auto")):
                t0 = time.perf_counter()
                step(path)
                times[path].append(1e3 * (time.perf_counter() - t0))
        kernel, torch_ms = statistics.median(times["auto"]), statistics.median(times["never"])
        diff = (grads["auto"] - grads["never"]).abs().max().item() / grads["never"].abs().max().item()
        result["shapes"][name] = {
            **shape,
            "kernel_ms": kernel,
            "pytorch_ms": torch_ms,
            "speedup": torch_ms / kernel,
            "kernel_ms_runs": times["auto"],
            "pytorch_ms_runs": times["never"],
            "input_grad_max_rel_diff": diff,
        }
        print(f"{name}: C training scan {kernel:.1f} ms, PyTorch scan {torch_ms:.1f} ms, x{torch_ms / kernel:.2f}; "
              f"input gradients agree to {diff:.1e}")  # fmt: skip
    result["pressure_after"] = _pressure()
    if args.output:
        from rfkit.provenance import stamp

        command = "python benchmarks/mamba_train_scan.py " + " ".join(argv if argv is not None else sys.argv[1:])
        stamp(result, started, command.strip())
        atomic_write_json(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
