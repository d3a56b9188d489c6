"""Kill a real `rfkit fit` with SIGKILL mid-training, resume it with `--ckpt_path last`, and
compare it with an uninterrupted run of the same command.

    python benchmarks/resume_check.py [--config recipes/smollm2_b05.yaml] [--steps 6] [--every 2]
        [--kill-after 3] [--output benchmarks/results/resume_smollm2_b05.json] [-- EXTRA OVERRIDES]

Three runs of ``rfkit fit --config R --trainer.max_steps STEPS --checkpoint.every_n_train_steps
EVERY`` (plus any overrides after ``--``), each in its own run directory under ``--workdir``:

1. the whole run;
2. the same run, killed with SIGKILL at the start of the batch after step ``--kill-after``
   (``tests/fault_callbacks.HangAt`` holds it there; the kill itself is real);
3. the same command as 2 with ``--ckpt_path last``.

Every run records its training loss per step (``fault_callbacks.LossRecorder``). The JSON gives
both loss curves, both summaries, the largest relative difference of the losses and of the
final perplexity, the step the checkpoint was from, and whether the resumed run profiled or ran
attention transfer (it should do neither). On the embedded default the profile is reused from
the cache in all three runs unless ``-- --model.reuse_profile false`` is passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], log: Path, wait: bool = True) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "RFKIT_LOG": "INFO"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "rfkit.cli", "fit", *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if wait:
        proc.wait()
    return proc


def losses(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def main(argv=None) -> int:
    run_started = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    raw = list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="recipes/smollm2_b05.yaml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-after", type=int, default=3)
    p.add_argument("--workdir", default="runs/resume_check")
    p.add_argument("--output", default="benchmarks/results/resume_smollm2_b05.json")
    args = p.parse_args(argv)
    if not 0 < args.kill_after < args.steps:
        p.error("--kill-after: must lie between 0 and --steps")

    from rfkit.atomic import atomic_write_json
    from rfkit.training.checkpointing import read_meta

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    common = [
        "--config", args.config, "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.steps),
        "--checkpoint.every_n_train_steps", str(args.every), "--trainer.enable_progress_bar", "false", *extra,
    ]  # fmt: skip

    def recorded(name: str) -> list[str]:
        return ["--trainer.callbacks+=fault_callbacks.LossRecorder", "--trainer.callbacks.path", str(work / f"{name}.losses.jsonl")]

    for name in ("whole", "killed"):
        (work / f"{name}.losses.jsonl").unlink(missing_ok=True)
    timings = {}

    started = time.time()
    whole = run([*common, "--trainer.default_root_dir", str(work / "whole"), *recorded("whole")], work / "whole.log")
    timings["whole_s"] = round(time.time() - started, 1)
    if whole.returncode != 0:
        print(f"the whole run failed (exit {whole.returncode}); see {work / 'whole.log'}", file=sys.stderr)
        return 1

    marker = work / "killed.hung"
    marker.unlink(missing_ok=True)
    started = time.time()
    hang = ["--trainer.callbacks+=fault_callbacks.HangAt", "--trainer.callbacks.step", str(args.kill_after), "--trainer.callbacks.marker", str(marker)]
    proc = run([*common, "--trainer.default_root_dir", str(work / "killed"), *recorded("killed"), *hang], work / "killed.log", wait=False)
    while not marker.exists():
        if proc.poll() is not None:
            print(f"the run to kill ended on its own (exit {proc.returncode}); see {work / 'killed.log'}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    timings["killed_s"] = round(time.time() - started, 1)
    ckpt = work / "killed" / "checkpoints" / "last.ckpt"
    meta = read_meta(ckpt)
    import torch

    ckpt_step = int(torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    leftovers = sorted(str(p.relative_to(work)) for p in (work / "killed").rglob("*") if p.name.startswith(".") or p.name in ("summary.json", "model"))

    started = time.time()
    resumed = run([*common, "--trainer.default_root_dir", str(work / "killed"), *recorded("killed"), "--ckpt_path", "last"], work / "resumed.log")
    timings["resumed_s"] = round(time.time() - started, 1)
    if resumed.returncode != 0:
        print(f"the resumed run failed (exit {resumed.returncode}); see {work / 'resumed.log'}", file=sys.stderr)
        return 1

    log = (work / "resumed.log").read_text()
    a, b = losses(work / "whole.losses.jsonl"), losses(work / "killed.losses.jsonl")
    sa = json.loads(next((work / "whole").rglob("summary.json")).read_text())
    sb = json.loads(next((work / "killed").rglob("summary.json")).read_text())
    rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30)  # noqa: E731
    result = {
        "command": " ".join(["python benchmarks/resume_check.py", *raw]),
        "config": args.config,
        "steps": args.steps,
        "checkpoint_every": args.every,
        "killed_after_step": args.kill_after,
        "checkpoint_step": ckpt_step,
        "checkpoint_head_map_selected_equal": meta["head_map"]["selected"] == json.loads(next((work / "whole").rglob("head_map.json")).read_text())["selected"],
        "leftovers_after_kill": leftovers,
        "resumed_profiled": "profiling heads" in log or "reusing head profile" in log,
        "resumed_ran_transfer": "transfer: train" in log,
        "losses_whole": a,
        "losses_killed_then_resumed": b,
        "max_rel_loss_difference": max(rel(b[s], a[s]) for s in a),
        "ppl_converted": {"whole": sa["ppl_converted"], "resumed": sb["ppl_converted"]},
        "rel_ppl_difference": rel(sb["ppl_converted"], sa["ppl_converted"]),
        "wall_seconds": {"whole_summary": sa["wall_seconds"], "resumed_summary": sb["wall_seconds"], **timings},
    }
    from rfkit.provenance import stamp

    stamp(result, run_started, result["command"])
    atomic_write_json(args.output, result)
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("losses")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
