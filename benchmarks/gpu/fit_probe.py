"""A short fit of the default recipe on one device: seconds per step by phase and the peak memory.

    python benchmarks/gpu/fit_probe.py --device cuda --output fit.json [--steps 8] [--tiny] [--window-backend flex] [--state-backend triton]

Runs ``rfkit fit --config recipes/smollm2_b05.yaml`` in this process with the GPU recipes'
precision (``trainer.precision: bf16-true`` over a ``model.dtype: bfloat16`` base: the new weights
and recurrent sums stay float32; float32 on a CPU without native bf16, said in the result's
``precision``) and only the length shortened: ``--steps`` training steps and as
many attention-transfer steps, one quick validation, nothing saved. On CUDA the peak is
``torch.cuda.max_memory_allocated`` over the whole fit; on the CPU the process's RSS high-water
mark. ``--tiny`` also shrinks the blocks and sample counts (the CPU rehearsal of the GPU check);
the command line is otherwise the one the GPU runs.

The result is added to ``--output`` under the device's name (read, updated, written then renamed),
so the GPU check's CUDA run and its CPU run of the same fit end up side by side in one file.
``--window-backend flex`` runs the window mixers' exact part through FlexAttention
(``RFKIT_WINDOW_BACKEND=flex``, rfkit.ops.flex_window; it serves CUDA only) and adds its row as
``<device>_flex``, with how many FlexAttention calls served the fit, beside the default's; the
speed-ups are computed only where FlexAttention served (CUDA) and include its compile.
``--state-backend triton`` does the same for the hybrid's state part through the Triton kernels
(``RFKIT_STATE_BACKEND=triton``, rfkit.ops.triton_state): row ``<device>_triton``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "smollm2_b05.yaml"


def precision(device: str) -> tuple[str, str, str]:
    """``(trainer.precision, model.dtype, why)``: the GPU recipes' bf16, except on a CPU that does
    not compute bf16 natively, where emulated bf16 is several times slower (the rehearsal's tiny fit
    ran past its timeout on an AVX2-only CPU) and the fit runs in float32, as ``model.dtype: auto``
    would choose."""
    from rfkit.devices import native_bf16

    native, why = native_bf16(device)
    if device == "cpu" and not native:
        return "32-true", "float32", why
    return "bf16-true", "bfloat16", why


def fit_args(device: str, steps: int, root: Path, tiny: bool) -> list[str]:
    trainer_precision, dtype, _ = precision(device)
    args = [
        "fit", "--config", str(RECIPE),
        "--trainer.accelerator", "gpu" if device == "cuda" else "cpu",
        "--trainer.precision", trainer_precision, "--model.dtype", dtype,
        "--trainer.max_steps", str(steps), "--model.lr_scheduler.init_args.T_max", str(steps),
        "--trainer.val_check_interval", str(steps), "--trainer.limit_val_batches", "1",
        "--model.transfer.steps", str(steps),
        "--data.val_blocks", "8",
        "--summary.save_model", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),
    ]  # fmt: skip
    if tiny:  # the rehearsal: the same command at a scale two CPU cores run in seconds
        args += [
            "--data.seq_len", "128", "--data.calibration_samples", "4", "--data.val_blocks", "2",
            "--data.long_seq_len", "256",
            "--model.transfer.samples", "4", "--model.transfer.long_samples", "1", "--model.transfer.long_seq_len", "256",
        ]  # fmt: skip
    return args


#: the opt-in backends' rows: (row suffix, the count that says the backend served, its name)
BACKEND_ROWS = (("flex", "flex_calls", "FlexAttention"), ("triton", "triton_calls", "Triton state"))


def run_fit(device: str, steps: int, tiny: bool, backend: str = "torch", state_backend: str = "torch") -> dict:
    import torch

    from rfkit.cli import main
    from rfkit.models.hybrid import HybridWindowAttention
    from rfkit.models.window import WindowAttention
    from rfkit.ops import flex_window, triton_state

    WindowAttention.window_backend, served = backend, flex_window.served
    HybridWindowAttention.state_backend, state_served = state_backend, triton_state.served
    with tempfile.TemporaryDirectory(prefix="rfkit-fit-probe-") as root:
        args = fit_args(device, steps, Path(root), tiny)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            main(args)
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        finally:
            WindowAttention.window_backend = HybridWindowAttention.state_backend = None
        wall = time.perf_counter() - started
        if code:
            raise SystemExit(f"fit_probe: rfkit fit exited with {code}")
        summary = json.loads(next(Path(root).rglob("summary.json")).read_text())
    phases = summary.get("phases", {})
    transfer_steps = (summary.get("transfer") or {}).get("steps_run") or steps
    row = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
        "steps": steps,
        "tiny": tiny,
        "wall_seconds": round(wall, 2),
        "phases": phases,
        "seconds_per_train_step": round(phases.get("train", 0.0) / steps, 3),
        "seconds_per_transfer_step": round(phases.get("transfer", 0.0) / transfer_steps, 3),
        "ppl_ratio": summary.get("ppl_ratio"),
        "precision": "{}, model.dtype {} ({})".format(*precision(device)),
        "window_backend": backend,
        "flex_calls": flex_window.served - served,  # FlexAttention calls that served the fit (0 where it does not serve: the CPU)
        "state_backend": state_backend,
        "triton_calls": triton_state.served - state_served,  # the Triton state kernels' forward launches (0 on the CPU)
        "command": "rfkit " + " ".join(fit_args(device, steps, Path("ROOT"), tiny)).replace(str(REPO) + "/", ""),
    }
    if device == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated()
        row["peak_method"] = "torch.cuda.max_memory_allocated over the whole fit"
    else:
        row["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        row["peak_method"] = "process RSS high-water mark (ru_maxrss)"
    return row


def update(path: Path, key: str, row: dict) -> dict:
    """Add ``row`` under ``key`` to the JSON at ``path`` (written then renamed)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = row
    if {"cuda", "cpu"} <= data.keys() and data["cpu"].get("seconds_per_train_step"):
        cuda, cpu = data["cuda"], data["cpu"]
        data["cuda_speedup_train_step"] = round(cpu["seconds_per_train_step"] / max(cuda["seconds_per_train_step"], 1e-9), 2)
        data["cuda_speedup_transfer_step"] = round(cpu["seconds_per_transfer_step"] / max(cuda["seconds_per_transfer_step"], 1e-9), 2)
    # an opt-in backend's fit beside the default's on the same device, where the backend served
    for device, (name, calls, what) in itertools.product(("cuda", "cpu"), BACKEND_ROWS):
        tiles, other = data.get(device), data.get(f"{device}_{name}")
        if tiles and other and other.get(calls) and other.get("seconds_per_train_step"):
            data[f"{device}_{name}_speedup_train_step"] = round(tiles["seconds_per_train_step"] / other["seconds_per_train_step"], 2)
            data[f"{device}_{name}_speedup_transfer_step"] = round(
                tiles["seconds_per_transfer_step"] / max(other["seconds_per_transfer_step"], 1e-9), 2
            )
            data[f"{device}_{name}_note"] = (
                f"per-step times over the whole phase: the {what} fit's include its compile (first calls); "
                "window_backends.json times one layer after a warm-up"
            )
    from rfkit.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fit_probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--output", required=True, help="JSON file; this device's row is added to it")
    parser.add_argument("--steps", type=int, default=8, help="training steps, and as many transfer steps")
    parser.add_argument("--tiny", action="store_true", help="short blocks and few samples (the CPU rehearsal)")
    parser.add_argument("--window-backend", choices=("torch", "flex"), default="torch",
                        help="the window mixers' exact part: the tiles (default) or FlexAttention (row <device>_flex)")
    parser.add_argument("--state-backend", choices=("torch", "triton"), default="torch",
                        help="the hybrid's state part: PyTorch (default) or the Triton kernels (row <device>_triton)")  # fmt: skip
    args = parser.parse_args(argv)
    row = run_fit(args.device, args.steps, args.tiny, args.window_backend, args.state_backend)
    suffix = "".join(f"_{b}" for b in (args.window_backend, args.state_backend) if b != "torch")
    key = args.device + suffix
    update(Path(args.output), key, row)
    print(
        f"fit_probe: {key}: {row['device']}: {row['seconds_per_train_step']} s per training step, "
        f"{row['seconds_per_transfer_step']} s per transfer step, peak {row['peak_bytes'] / 2**30:.2f} GiB, "
        f"whole fit {row['wall_seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
