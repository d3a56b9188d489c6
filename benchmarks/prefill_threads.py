"""Wall time of one hybrid layer's compiled prefill (the CPU kernel) on one thread and on all of
PyTorch's threads, with the work on PyTorch's OpenMP pool (this build) and on a Python thread
pool (what a build without OpenMP uses, and what every build used before), in one process.

    python benchmarks/prefill_threads.py --length 2048 \
        --output benchmarks/results/prefill_threads/prefill_threads.json

The layer has the default recipe's shape (head width 64, sink 4, window 56, 16 features, decay
horizon 128, open gates) and 1, 2 or 3 replaced KV heads of 3 query heads each, batch 1: the
replaced layers of the default SmolLM2 model. Medians of 9 runs after 2 warm-ups.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_ms(block, q, k, v, runs: int = 9) -> float:
    times = []
    with torch.no_grad():
        for _ in range(runs + 2):
            started = time.perf_counter()
            block.attend(q, k, v)
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args()

    from rfkit.atomic import atomic_write_json
    from rfkit.models.hybrid import HybridWindowAttention
    from rfkit.ops import cpu_kernels
    from rfkit.provenance import stamp

    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    started = time.time()
    threads = torch.get_num_threads()
    built_with_openmp = cpu_kernels.openmp()
    rows = []
    for kv_heads in (1, 2, 3):
        kvq = [h for h in range(kv_heads) for _ in range(3)]
        block = HybridWindowAttention(kvq, 64, window=56, sink=4, feature_dim=16, decay_horizon=128.0).eval()
        with torch.no_grad():
            block.gate.fill_(0.5)
        g = torch.Generator().manual_seed(kv_heads)
        q = torch.randn(1, len(kvq), args.length, 64, generator=g)
        k, v = (torch.randn(1, kv_heads, args.length, 64, generator=g) for _ in range(2))
        row = {"kv_heads": kv_heads, "query_heads": len(kvq)}
        try:
            torch.set_num_threads(1)
            row["one_thread_ms"] = median_ms(block, q, k, v)
            torch.set_num_threads(threads)
            cpu_kernels._state["openmp"] = False
            row["python_pool_ms"] = median_ms(block, q, k, v)
            cpu_kernels._state["openmp"] = built_with_openmp
            row["openmp_ms"] = median_ms(block, q, k, v) if built_with_openmp else None
        finally:
            torch.set_num_threads(threads)
            cpu_kernels._state["openmp"] = built_with_openmp
        row["jobs"] = cpu_kernels.prefill_jobs(kv_heads, args.length, threads, *cpu_kernels._prefill_costs(block, True))
        rows.append(row)
        print(row, flush=True)
    result = {"kind": "prefill_threads", "length": args.length, "threads": threads, "openmp": built_with_openmp, "rows": rows}
    command = f"python benchmarks/prefill_threads.py --length {args.length} --output {args.output}"
    atomic_write_json(args.output, stamp(result, started, command))


if __name__ == "__main__":
    main()
