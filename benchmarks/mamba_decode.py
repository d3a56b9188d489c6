"""Decode step of the paper's Mamba operator on SmolLM2, to compare two versions of rfkit.

    python benchmarks/mamba_decode.py --head-map DIR/head_map.json [--context 2048] [--runs 3]
        [--output FILE.json]

Converts the embedded SmolLM2 with ``MambaOperator`` on the head map's selection (untrained:
weights do not change the speed), prefills ``--context`` random tokens and times 30 single-token
forwards through the cache, median per run. Run it once per checkout, with ``PYTHONPATH`` set to
the checkout to measure (the JSON records which rfkit was imported), on the same idle machine:

    PYTHONPATH=/path/to/old/checkout python benchmarks/mamba_decode.py --head-map ... --output old.json
    python benchmarks/mamba_decode.py --head-map ... --output new.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    run_started = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-map", required=True, help="head_map.json whose selection to convert")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)

    import torch

    import rfkit
    from rfkit.atomic import atomic_write_json
    from rfkit.conversion.convert import load_base_model
    from rfkit.models.cache import cache_kwargs, output_cache
    from rfkit.models.modeling import to_recurformer
    from rfkit.models.operators import MambaOperator

    selected = json.loads(Path(args.head_map).read_text())["selected"]
    model = to_recurformer(load_base_model("embedded:smollm2-135m-instruct"), selected, MambaOperator()).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.context + 40), generator=torch.Generator().manual_seed(0))
    medians = []
    with torch.no_grad():
        for _ in range(args.runs):
            cache = output_cache(model(input_ids=ids[:, : args.context], use_cache=True, logits_to_keep=1))
            times = []
            for t in range(30):
                token = ids[:, args.context + t : args.context + t + 1]
                start = time.perf_counter()
                model(input_ids=token, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times[5:]))
    root = Path(rfkit.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "rfkit": str(root),
        "commit": commit,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "decode_step_ms_runs": [1e3 * m for m in medians],
        "decode_step_ms": 1e3 * statistics.median(medians),
        "command": "python benchmarks/mamba_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(json.dumps(result, indent=1))
    if args.output:
        from rfkit.provenance import stamp

        stamp(result, run_started, result["command"])
        atomic_write_json(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
