"""How long does the first use of the embedded model take to dequantise its GGUF?

    python benchmarks/dequantise.py [--runs 3] [--json benchmarks/results/dequantise/name_map_once.json]

The first ``rfkit`` command on the embedded default dequantises ``SmolLM2-135M-Instruct.Q4_1.gguf``
into a safetensors folder in the cache (rfkit.hub._materialise_embedded_model); later ones load
that folder. This times that step into fresh temporary folders three ways, rotating which goes
first, medians of ``--runs``: as it runs now (one parse of the GGUF serves the tokenizer, the
config, the weights and the card's licence: rfkit.hub._gguf_parsed_once; one tensor-name map
serves every module of the model: rfkit.hub._gguf_name_map_once), with the name map built again
for every module (the second block replaced by a no-op), and with neither (each reader parsing the
file again too: the dequantising before both). It also checks that the three folders are the same
files, byte for byte, and counts the parses and the name maps built. Nothing in the cache is
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

    parses, maps = [], []
    init = gguf.GGUFReader.__init__
    build_map = gguf.get_tensor_name_map

    def counting(self, path, *a, **k):
        parses.append(path)
        return init(self, path, *a, **k)

    def counting_map(arch, n_blocks):
        maps.append((arch, n_blocks))
        return build_map(arch, n_blocks)

    gguf.GGUFReader.__init__ = counting
    gguf.get_tensor_name_map = counting_map  # what _gguf_name_map_once wraps: it counts the maps built
    parse_once, map_once, none = hub._gguf_parsed_once, hub._gguf_name_map_once, contextlib.nullcontext
    modes = {
        "now": (parse_once, map_once),
        "a name map per module": (parse_once, none),
        "a parse per reader, a name map per module": (none, none),
    }
    started = time.time()
    times: dict[str, list[float]] = {m: [] for m in modes}
    counts: dict[str, list[int]] = {m: [] for m in modes}
    map_counts: dict[str, list[int]] = {m: [] for m in modes}
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            order = list(modes)[run % len(modes) :] + list(modes)[: run % len(modes)]
            for mode in order:
                hub._gguf_parsed_once, hub._gguf_name_map_once = modes[mode]
                folder = Path(tmp) / f"{run}-{mode}".replace(" ", "_").replace(",", "")
                parses.clear()
                maps.clear()
                start = time.perf_counter()
                hub._materialise_embedded_model(folder)
                times[mode].append(round(time.perf_counter() - start, 2))
                counts[mode].append(len(parses))
                map_counts[mode].append(len(maps))
                digests.setdefault(mode, digest(folder))
                seconds, n_parses, n_maps = times[mode][-1], len(parses), len(maps)
                print(f"run {run + 1}, {mode}: {seconds:.1f} s, {n_parses} parse(s), {n_maps} name map(s)", flush=True)
    hub._gguf_parsed_once, hub._gguf_name_map_once = parse_once, map_once
    gguf.GGUFReader.__init__, gguf.get_tensor_name_map = init, build_map
    medians = {m: statistics.median(t) for m, t in times.items()}
    before = "a parse per reader, a name map per module"
    result = {
        "kind": "dequantise",
        "gguf": hub.embedded_gguf().name,
        "threads": torch.get_num_threads(),
        "runs": args.runs,
        "seconds": times,
        "median_seconds": medians,
        "parses": counts,
        "name_maps": map_counts,
        "speedup": {m: round(medians[before] / medians[m], 3) for m in modes if m != before},
        "same_files": all(d == digests["now"] for d in digests.values()),
        "files": sorted(digests["now"]),
    }
    stamp(result, started, command_line(["benchmarks/dequantise.py", *(argv if argv is not None else sys.argv[1:])]))
    each = ", ".join(f"{m} {t:.1f} s" for m, t in medians.items())
    print(f"medians: {each}; same files: {result['same_files']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.json), result)
    return 0 if result["same_files"] else 1


if __name__ == "__main__":
    sys.exit(main())
