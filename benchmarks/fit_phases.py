"""Where a fit's time goes: the run's phases, attention transfer split into capture and training,
and every training step split into its forward, backward and optimizer parts, short and long blocks
apart.

    python benchmarks/fit_phases.py --output benchmarks/results/fit_phases/bf16.json -- \
        fit --config recipes/smollm2_b05.yaml --trainer.default_root_dir /tmp/fit_phases

Runs the rfkit command as given in this process with one more callback (:class:`StepTimer`, read
from this file) and hooks on attention transfer's capture; then reads the run's ``summary.json``.
Writes one JSON with the provenance of the command, and prints a table. Timings on a shared machine
are noisy: say whether anything else ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the callback's class path: fit_phases.StepTimer


class StepTimer(pl.Callback):
    """Wall time of each training step's forward (batch start to backward), backward and the rest
    (optimizer step, logging), keyed by the block length of its batch."""

    steps: list = []  # class-level: the instance Lightning builds from the class path fills it

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        ids = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        self._now = {"start": time.perf_counter(), "tokens": int(ids.numel()), "length": int(ids.shape[-1])}

    def on_before_backward(self, trainer, module, loss):
        self._now["forward"] = time.perf_counter()

    def on_after_backward(self, trainer, module):
        self._now["backward"] = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        n, end = self._now, time.perf_counter()
        StepTimer.steps.append({
            "length": n["length"], "tokens": n["tokens"],
            "forward_s": n["forward"] - n["start"], "backward_s": n["backward"] - n["forward"], "rest_s": end - n["backward"],
        })  # fmt: skip


def _median(rows: list, key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3) if rows else 0.0


def timed_capture():
    """Time attention transfer's capture passes (its ``capture`` function), in place."""
    from rfkit.training import transfer

    spent = {"seconds": 0.0, "calls": 0}
    real = transfer.capture

    def capture(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent["seconds"] += time.perf_counter() - t0
            spent["calls"] += 1

    transfer.capture = capture
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fit_phases.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the JSON to write")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the rfkit command and its arguments, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    root = next((command[i + 1] for i, a in enumerate(command) if a == "--trainer.default_root_dir"), None)
    if not command or command[0] != "fit" or root is None:
        parser.error("give a fit command with --trainer.default_root_dir after --")

    from rfkit.cli import main as rfkit_main
    from rfkit.provenance import command_line, stamp

    import fit_phases  # the module the class path names (this file may run as __main__ or by path)

    timer = fit_phases.StepTimer
    started = time.time()
    capture = timed_capture()
    timer.steps.clear()
    try:
        rfkit_main([*command, "--trainer.callbacks+=fit_phases.StepTimer"])
    except SystemExit as exit:
        if exit.code not in (0, None):
            return int(exit.code) if isinstance(exit.code, int) else 1
    summary = json.loads(max(Path(root).rglob("summary.json"), key=lambda p: p.stat().st_mtime).read_text())
    phases = summary.get("phases", {})
    steps = timer.steps
    lengths = sorted({s["length"] for s in steps})
    by_length = {
        str(n): {
            "steps": len(rows := [s for s in steps if s["length"] == n]),
            "tokens_per_step": rows[0]["tokens"],
            "forward_s": _median(rows, "forward_s"), "backward_s": _median(rows, "backward_s"), "rest_s": _median(rows, "rest_s"),
            "total_s": round(sum(s["forward_s"] + s["backward_s"] + s["rest_s"] for s in rows), 1),
        }
        for n in lengths
    }  # fmt: skip
    stepping = sum(v["total_s"] for v in by_length.values())
    result = {
        "phases_s": phases,
        "wall_s": summary.get("wall_seconds"),
        "precision": summary.get("precision"),
        "ppl_ratio": summary.get("ppl_ratio"),
        "transfer": {"capture_s": round(capture["seconds"], 3), "capture_calls": capture["calls"],
                     "training_s": round(phases.get("transfer", 0.0) - capture["seconds"], 3)},  # fmt: skip
        "train": {"steps_s": round(stepping, 1), "outside_steps_s": round(phases.get("train", 0.0) - stepping, 1), "by_block_length": by_length},
        "steps": steps,
    }
    stamp(result, started, command_line([__file__, *(argv if argv is not None else sys.argv[1:])]))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nphases (s): {phases}")
    print(f"transfer: capture {result['transfer']['capture_s']} s, training {result['transfer']['training_s']} s")
    print(f"train: steps {result['train']['steps_s']} s, outside the steps (validation, measurement) {result['train']['outside_steps_s']} s")
    for n, v in by_length.items():
        print(f"  {n}-token blocks: {v['steps']} steps, median forward {v['forward_s']} s, backward {v['backward_s']} s, rest {v['rest_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
