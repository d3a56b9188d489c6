"""How long does one training step of a converted model take, window mixers tiled vs rank-masked?

    python benchmarks/train_block.py --model runs/smollm2_b05/lightning_logs/version_0/model
        [--shapes 4x512,1x2048,1x4096,1x8192] [--runs 3] [--old-max-len 4096]
        [--output benchmarks/results/train_block/train_block.json]

Loads a converted model folder, puts it in training mode and freezes all but the mixers' weights
(the recipes' ``freeze: pretrained``), then times one training step (forward with labels, the
next-token CE loss, backward) on random token blocks of each shape ``BATCHxLENGTH``: with the
window mixers' tiled path (``WindowAttention.fast = True``, new) and through the general
rank-masked path (``fast = False``, old), interleaved run by run (the order alternating), median
of ``--runs``. Every mixer uses its full window (``--window full``, the default: the tiled path's
costliest case, the same for both paths) or draws as in training (``--window drawn``: one draw
per step, the same draws for both paths). The old path is skipped for lengths above
``--old-max-len`` (its scores grow as L^2) and the skip recorded. One untimed step per path on
a 1x256 block comes first. Also records the growth of the process's peak RSS over a step
(Linux: VmHWM after resetting it through /proc/self/clear_refs; null where that is not possible)
and /proc/pressure/cpu before and after (the machine may be shared). The JSON is rewritten
(write, then rename) after every shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        batch, length = part.lower().split("x")
        shapes.append((int(batch), int(length)))
    return shapes


def main(argv=None) -> int:
    run_started = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a converted model folder")
    p.add_argument("--shapes", default="4x512,1x2048,1x4096,1x8192", help="BATCHxLENGTH, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="timed steps per path and shape (median reported)")
    p.add_argument("--old-max-len", type=int, default=4096, help="skip the old path above this length")
    p.add_argument("--window", choices=("full", "drawn"), default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/train_block/train_block.json")
    args = p.parse_args(argv)
    command = "python benchmarks/train_block.py " + " ".join(argv if argv is not None else sys.argv[1:])

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    import rfkit  # noqa: F401  (registers the converted classes)
    from rfkit.atomic import atomic_write_json
    from rfkit.models.mixer import draw_for_batch
    from rfkit.models.window import WindowAttention
    from rfkit.provenance import cpu_pressure, stamp
    from rfkit.training.freeze import apply_freeze

    pressure_before = cpu_pressure()
    model = AutoModelForCausalLM.from_pretrained(args.model)
    apply_freeze(model, "pretrained")
    model.train()
    mixers = [m for m in model.modules() if isinstance(m, WindowAttention)]
    if not mixers:
        p.error(f"{args.model} has no window mixers (WindowAttention and its hybrids)")
    if args.window == "full":
        for m in mixers:
            m.train_window = lambda m=m: m.window
    trainable = sum(t.numel() for t in model.parameters() if t.requires_grad)
    shapes = parse_shapes(args.shapes)
    vocab = model.config.vocab_size

    def step(ids, fast: bool, draw_seed: int) -> tuple[float, float | None]:
        """One training step: seconds, peak RSS growth in MiB (None where unknown)."""
        WindowAttention.fast = fast
        if args.window == "drawn":
            torch.manual_seed(draw_seed)  # the mixers' own streams are seeded from the global one
            for m in mixers:
                m._generator = None
            draw_for_batch(model)
        model.zero_grad(set_to_none=True)
        base = _status_kib("VmRSS") if reset_peak_rss() else None
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM")
        return seconds, None if base is None or peak is None else (peak - base) / 1024

    result = {
        "model": args.model,
        "command": command,
        "window": args.window,
        "runs": args.runs,
        "threads": torch.get_num_threads(),
        "trainable_parameters": trainable,
        "mixers": len(mixers),
        "cpu_pressure_before": pressure_before,
        "shapes": [],
    }
    steps = sum(args.runs * (1 if length > args.old_max_len else 2) for _, length in shapes)
    warm = torch.randint(0, vocab, (1, 256), generator=torch.Generator().manual_seed(args.seed))
    for fast in (True, False):  # first calls (allocator, lazy set-up) stay out of the timings
        step(warm, fast, draw_seed=args.seed)
    with tqdm(total=steps, desc="train steps", unit="step") as bar:
        for batch, length in shapes:
            ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(args.seed))
            paths = {"new": True} if length > args.old_max_len else {"new": True, "old": False}
            times = {name: [] for name in paths}
            peaks = {name: [] for name in paths}
            for run in range(args.runs):
                order = list(paths) if run % 2 == 0 else list(reversed(paths))
                for name in order:
                    bar.set_postfix_str(f"{batch}x{length} {name}")
                    seconds, peak = step(ids, paths[name], draw_seed=args.seed * 1000 + run)
                    times[name].append(seconds)
                    peaks[name].append(peak)
                    bar.update(1)
            row = {"shape": f"{batch}x{length}", "batch": batch, "length": length}
            for name in ("new", "old"):
                if name not in paths:
                    row[name] = {"skipped": f"length {length} > --old-max-len {args.old_max_len}"}
                    continue
                known = [x for x in peaks[name] if x is not None]
                row[name] = {
                    "median_s": statistics.median(times[name]),
                    "seconds": times[name],
                    "peak_rss_growth_mib": max(known) if known else None,
                }
            if "old" in paths:
                row["speedup"] = row["old"]["median_s"] / row["new"]["median_s"]
            result["shapes"].append(row)
            result["cpu_pressure_after"] = cpu_pressure()
            stamp(result, run_started, command, time.time() - run_started, replace=True)
            atomic_write_json(args.output, result)
    WindowAttention.fast = True

    print(f"{'shape':>8} {'new s':>8} {'old s':>8} {'speedup':>8} {'new MiB':>8} {'old MiB':>8}")
    for row in result["shapes"]:
        new, old = row["new"], row["old"]
        cell = lambda d, key, fmt: "-" if d.get(key) is None else format(d[key], fmt)  # noqa: E731
        print(
            f"{row['shape']:>8} {cell(new, 'median_s', '.2f'):>8} {cell(old, 'median_s', '.2f'):>8} "
            f"{cell(row, 'speedup', '.2f'):>8} {cell(new, 'peak_rss_growth_mib', '.0f'):>8} {cell(old, 'peak_rss_growth_mib', '.0f'):>8}"
        )
    print(f"cpu pressure before: {pressure_before}\ncpu pressure after:  {result['cpu_pressure_after']}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
