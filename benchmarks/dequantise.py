"""How long does the first use of the embedded model take to dequantise its GGUF?

    python benchmarks/dequantise.py [--runs 3] [--json benchmarks/results/dequantise/dequantise.json]

The first ``rfkit`` command on the embedded default dequantises ``SmolLM2-135M-Instruct.Q4_1.gguf``
into a safetensors folder in the cache (rfkit.hub._materialise_embedded_model); later ones load
that folder. This times that step into fresh temporary folders, the way it runs now (one parse of
the GGUF serves the tokenizer, the config, the weights and the card's licence:
rfkit.hub._gguf_parsed_once) against each reader parsing the file again (the block replaced by a
no-op, as before), alternating which goes first, medians of ``--runs``. It also checks that the
two folders are the same files, byte for byte, and counts the parses. Nothing in the cache is
touched.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def digest(folder: Path) -> dict[str, str]:
    from rfkit.conversion.headmap import sha256_bytes

    return {p.name: sha256_bytes(p.read_bytes()) for p in sorted(folder.iterdir()) if p.is_file()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the result here (write, then rename)")
    args = parser.parse_args(argv)
    import gguf
    import torch

    from rfkit import hub
    from rfkit.atomic import atomic_write_json
    from rfkit.provenance import command_line, stamp

    parses = []
    init = gguf.GGUFReader.__init__

    def counting(self, path, *a, **k):
        parses.append(path)
        return init(self, path, *a, **k)

    gguf.GGUFReader.__init__ = counting
    once = hub._gguf_parsed_once
    modes = {"one parse": once, "a parse per reader": contextlib.nullcontext}
    started = time.time()
    times: dict[str, list[float]] = {m: [] for m in modes}
    counts: dict[str, list[int]] = {m: [] for m in modes}
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            order = list(modes) if run % 2 == 0 else list(reversed(modes))
            for mode in order:
                hub._gguf_parsed_once = modes[mode]
                folder = Path(tmp) / f"{run}-{len(digests)}"
                parses.clear()
                start = time.perf_counter()
                hub._materialise_embedded_model(folder)
                times[mode].append(round(time.perf_counter() - start, 2))
                counts[mode].append(len(parses))
                digests.setdefault(mode, digest(folder))
                print(f"run {run + 1}, {mode}: {times[mode][-1]:.1f} s, {len(parses)} parse(s)", flush=True)
    hub._gguf_parsed_once = once
    medians = {m: statistics.median(t) for m, t in times.items()}
    result = {
        "kind": "dequantise",
        "gguf": hub.embedded_gguf().name,
        "threads": torch.get_num_threads(),
        "runs": args.runs,
        "seconds": times,
        "median_seconds": medians,
        "parses": counts,
        "speedup": round(medians["a parse per reader"] / medians["one parse"], 3),
        "same_files": digests["one parse"] == digests["a parse per reader"],
        "files": sorted(digests["one parse"]),
    }
    stamp(result, started, command_line(["benchmarks/dequantise.py", *(argv if argv is not None else sys.argv[1:])]))
    print(f"median {medians['a parse per reader']:.1f} s -> {medians['one parse']:.1f} s ({result['speedup']:.2f}x); "
          f"same files: {result['same_files']}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.json), result)
    return 0 if result["same_files"] else 1


if __name__ == "__main__":
    sys.exit(main())
