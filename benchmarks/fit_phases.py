"""Where a fit's time goes: the run's phases, attention transfer split into capture (short and long
blocks apart), evaluations, calibration / read-out and gradient steps, and every training step split
into its forward, backward and optimizer parts, short and long blocks apart.

    python benchmarks/fit_phases.py --output benchmarks/results/fit_phases/bf16.json -- \
        fit --config recipes/smollm2_b05.yaml --trainer.default_root_dir /tmp/fit_phases

Runs the rfkit command as given in this process with one more callback (:class:`StepTimer`, read
from this file) and timers on attention transfer's functions (put back afterwards); then reads the
run's ``summary.json``.
Writes one JSON with the provenance of the command, and prints a table. Timings on a shared machine
are noisy: say whether anything else ran.

``--profile-step N`` also runs ``torch.profiler`` over training step N (0-based; the profiler's
own overhead makes that step slower than the others): the time inside the teacher's forward, the
replacement mixers' forwards and the loss on the logits (CE and KL), the operators by kind (matrix products,
exact attention, softmax, the rest; forward and backward together) and the top operators by
their own time. That names the next lever.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the callback's class path: fit_phases.StepTimer


class StepTimer(pl.Callback):
    """Wall time of each training step's forward (batch start to backward), backward and the rest
    (optimizer step, logging), keyed by the block length of its batch."""

    steps: list = []  # class-level: the instance Lightning builds from the class path fills it
    profile_step: int | None = None  # the step torch.profiler records (main's --profile-step)
    profile: dict = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        ids = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        if len(StepTimer.steps) == StepTimer.profile_step:
            self._profiling = StepProfile(module)
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
        if getattr(self, "_profiling", None) is not None:
            StepTimer.profile = {"step": len(StepTimer.steps) - 1, "length": n["length"], "tokens": n["tokens"], **self._profiling.finish()}
            self._profiling = None


#: regions timed inside the profiled step (their inclusive CPU time)
REGIONS = ("teacher forward", "mixer forward", "loss on the logits")
#: operator kinds: the first whose words occur in the operator's name
KINDS = (
    ("exact attention", ("scaled_dot_product", "flash_attention")),
    ("matrix products", ("mm", "matmul", "linear", "baddbmm", "einsum", "addmv")),
    ("softmax", ("softmax",)),
)


class StepProfile:
    """``torch.profiler`` over one training step, with the teacher's forward, each replacement
    mixer's forward and the loss on the logits marked as regions."""

    def __init__(self, module):
        from torch.profiler import ProfilerActivity, profile, record_function

        from rfkit.models.mixer import ReplacementMixer
        from rfkit.training import distill, teacher

        self._stack = ExitStack()
        open_regions: list = []

        def enter(name):
            region = record_function(name)
            region.__enter__()
            open_regions.append(region)

        def leave():
            open_regions.pop().__exit__(None, None, None)

        def wrap(owner, attribute, name):
            real = getattr(owner, attribute)

            def timed(*args, **kwargs):
                with record_function(name):
                    return real(*args, **kwargs)

            setattr(owner, attribute, timed)
            self._stack.callback(setattr, owner, attribute, real)

        wrap(teacher.SharedTeacher, "__call__", REGIONS[0])
        wrap(distill, "rowwise_loss", REGIONS[2])
        for m in module.modules():
            if isinstance(m, ReplacementMixer):
                self._stack.callback(m.register_forward_pre_hook(lambda *_: enter(REGIONS[1])).remove)
                self._stack.callback(m.register_forward_hook(lambda *_: leave()).remove)
        self._profiler = self._stack.enter_context(profile(activities=[ProfilerActivity.CPU]))

    def finish(self) -> dict:
        """Stop, and the step's regions, operator kinds and top operators in seconds."""
        self._stack.close()
        events = self._profiler.key_averages()
        regions = {r: 0.0 for r in REGIONS}
        by_kind = dict.fromkeys([k for k, _ in KINDS] + ["the rest"], 0.0)
        ops = []
        for e in events:
            if e.key in regions:
                regions[e.key] = round(e.cpu_time_total / 1e6, 6)  # the profiler's microseconds: a tiny model's region is under 0.5 ms
                continue
            if not e.key.startswith("aten::") and "Backward" not in e.key:
                continue
            name = e.key.lower()
            kind = next((k for k, words in KINDS if any(w in name for w in words)), "the rest")
            by_kind[kind] += e.self_cpu_time_total / 1e6
            ops.append({"op": e.key, "self_s": round(e.self_cpu_time_total / 1e6, 3), "calls": e.count})
        ops.sort(key=lambda o: -o["self_s"])
        return {"regions_s": regions, "by_kind_s": {k: round(v, 6) for k, v in by_kind.items()}, "top_ops": ops[:25]}


def _median(rows: list, key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3) if rows else 0.0


def timed_transfer():
    """Time attention transfer's parts in place: its capture passes (``capture``; short and long
    blocks apart, by their length), its evaluations of every block (``evaluate``, run before,
    after the read-out and after training), the calibration / read-out solve and its gradient
    steps (``train_blocks``). Returns the running totals; ``spent["undo"]()`` puts the functions back."""
    from rfkit.models import mixer
    from rfkit.training import transfer

    spent = {"capture_seconds": 0.0, "capture_calls": 0, "by_length": {}, "parts": {}}
    originals = []
    spent["undo"] = lambda: [setattr(owner, name, real) for owner, name, real in reversed(originals)]

    def timed(owner, name, part, on_done=None):
        real = getattr(owner, name)
        originals.append((owner, name, real))

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                spent["parts"][part] = spent["parts"].get(part, 0.0) + seconds
                if on_done is not None:
                    on_done(seconds, *args)

        setattr(owner, name, wrapper)

    def captured(seconds, _model, blocks, *rest):
        spent["capture_seconds"] += seconds
        spent["capture_calls"] += 1
        key = str(int(blocks.shape[-1]))
        spent["by_length"][key] = spent["by_length"].get(key, 0.0) + seconds

    timed(transfer, "capture", "capture", captured)
    timed(transfer, "evaluate", "evaluate")
    timed(mixer, "calibrate_mixer", "calibrate / read-out")
    timed(transfer, "solve_readout", "calibrate / read-out")
    timed(transfer, "train_blocks", "gradient steps")
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fit_phases.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the JSON to write")
    parser.add_argument("--profile-step", type=int, default=None, help="run torch.profiler over this training step (0-based)")
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
    spent = timed_transfer()
    timer.steps.clear()
    timer.profile_step, timer.profile = args.profile_step, {}
    try:
        rfkit_main([*command, "--trainer.callbacks+=fit_phases.StepTimer"])
    except SystemExit as exit:
        if exit.code not in (0, None):
            return int(exit.code) if isinstance(exit.code, int) else 1
    finally:
        spent["undo"]()
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
        "transfer": {"capture_s": round(spent["capture_seconds"], 3), "capture_calls": spent["capture_calls"],
                     "training_s": round(phases.get("transfer", 0.0) - spent["capture_seconds"], 3),
                     "capture_by_length_s": {k: round(v, 3) for k, v in spent["by_length"].items()},
                     "parts_s": {k: round(v, 3) for k, v in spent["parts"].items()}},  # fmt: skip
        "train": {"steps_s": round(stepping, 1), "outside_steps_s": round(phases.get("train", 0.0) - stepping, 1), "by_block_length": by_length},
        "steps": steps,
    }
    if timer.profile:
        result["profile"] = timer.profile
    stamp(result, started, command_line([__file__, *(argv if argv is not None else sys.argv[1:])]))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nphases (s): {phases}")
    print(f"transfer: capture {result['transfer']['capture_s']} s, training {result['transfer']['training_s']} s")
    print(f"  its parts (s): {result['transfer']['parts_s']}; capture by block length (s): {result['transfer']['capture_by_length_s']}")
    print(f"train: steps {result['train']['steps_s']} s, outside the steps (validation, measurement) {result['train']['outside_steps_s']} s")
    for n, v in by_length.items():
        print(f"  {n}-token blocks: {v['steps']} steps, median forward {v['forward_s']} s, backward {v['backward_s']} s, rest {v['rest_s']} s")
    if timer.profile:
        p = timer.profile
        print(f"profiled step {p['step']} ({p['length']}-token blocks): regions {p['regions_s']}, operators by kind {p['by_kind_s']}")
        for o in p["top_ops"][:10]:
            print(f"  {o['self_s']:8.3f} s  {o['calls']:6d} calls  {o['op']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
