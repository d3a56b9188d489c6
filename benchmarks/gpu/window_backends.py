"""The window mixers' exact part and the hybrid's state part on their backends, side by side in one
process: the tiled PyTorch path (the default, in tiles of 32 queries and of 128) against one
FlexAttention call (``RFKIT_WINDOW_BACKEND=flex``, rfkit.ops.flex_window) for the window, and the
PyTorch chunks against the Triton kernels (``RFKIT_STATE_BACKEND=triton``, rfkit.ops.triton_state)
for the state, each alone and both together, at SmolLM2's converted-layer shape.

    python benchmarks/gpu/window_backends.py --device cuda --output DIR [--runs 5] [--budget-s 110]
    python benchmarks/gpu/window_backends.py --device cpu --tiny --output DIR    # the rehearsal

Rows: a training forward and backward of one hybrid layer (9 query heads over 3 KV heads,
head_dim 64, sink 4 + window 56, 16 features, decay horizon 2,048; bf16 activations, computed in
float32 as the precision policy does) at the blocks the recipes train on (4 x 512 and 1 x 4,096;
each shape compiles FlexAttention once), and an inference prefill of 32,768 tokens; for each the median seconds of
``--runs`` after a warm-up (FlexAttention's first call, which compiles it, timed apart), the peak
memory, and how far each variant's output and gradients are from the default's (relative
Frobenius error): the tile size is the other GPU setting the check measures. The script fails
(exit 1) when they disagree beyond the tolerance or a backend did not serve its variant, so a
wrong kernel shows as a failed step of the GPU check. ``--tiny`` (the CPU rehearsal): two small
rows, inference only (FlexAttention has no backward on the CPU), FlexAttention eager, the Triton
kernels under Triton's interpreter.

Writes ``window_backends.json`` and ``.md`` in ``--output`` after every row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import rfkit.models.hybrid as hybrid_module
import rfkit.models.window as window_module
from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.window import TILE, WindowAttention
from rfkit.ops import flex_window, triton_state

KVQ = [g for g in range(3) for _ in range(3)]  # SmolLM2: 9 query heads over 3 KV heads
HEAD_DIM = 64
# float32 sums in two orders through bf16 inputs and outputs (the gradients pass through them too)
TOLERANCE = 2e-2


def layer(device, tiny: bool) -> HybridWindowAttention:
    torch.manual_seed(0)
    b = HybridWindowAttention(KVQ, 16 if tiny else HEAD_DIM, window=8 if tiny else 56, sink=4,
                              feature_dim=16, decay_horizon=2048.0)  # fmt: skip
    with torch.no_grad():  # the gate open, as after attention transfer
        b.gate.fill_(1.0)
        b.log_scale.normal_(0, 0.5)
    return b.to(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: what each column runs: the window backend, the tiles' query count (rfkit.models.window.TILE,
#: 32, sized for a 2-core CPU; a GPU may want larger tiles; None keeps it) and the state backend
VARIANTS = {
    "torch": ("torch", None, "torch"),
    "torch_tile128": ("torch", 128, "torch"),
    "flex": ("flex", None, "torch"),
    "triton": ("torch", None, "triton"),
    "flex_triton": ("flex", None, "triton"),
}
COLUMNS = {"torch_tile128": "tiles of 128", "flex": "flex", "triton": "triton state", "flex_triton": "flex + triton"}


def once(b, variant: str, batch: int, length: int, train: bool, device, seed: int = 1):
    """One forward (and backward when ``train``) of ``variant``: seconds, output, gradients."""
    backend, tile, state = VARIANTS[variant]
    WindowAttention.window_backend = backend
    HybridWindowAttention.state_backend = state
    window_module.TILE = hybrid_module.TILE = tile or TILE
    b.train(train)
    b.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(seed)
    hd = b.head_dim
    make = lambda h: (torch.randn(batch, h, length, hd, generator=g) * 2).to(device, torch.bfloat16).requires_grad_(train)  # noqa: E731
    q, k, v = make(len(KVQ)), make(3), make(3)
    sync(device)
    start = time.perf_counter()
    with torch.set_grad_enabled(train):
        y = b.attend(q, k, v)
        if train:
            y.float().square().mean().backward()
    sync(device)
    seconds = time.perf_counter() - start
    grads = {"q": q.grad, "k": k.grad, "v": v.grad, "feature_map": b.feature_map.grad} if train else {}
    return seconds, y.detach(), grads


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def measure(b, batch: int, length: int, train: bool, runs: int, device, skip=()) -> dict:
    """One row: every variant but those in ``skip`` (named in the result's ``not_run``)."""
    variants = [v for v in VARIANTS if v not in skip]
    row = {"batch": batch, "length": length, "pass": "train (forward + backward)" if train else "prefill (forward)"}
    outputs = {}
    for backend in variants:
        served, state_served = flex_window.served, triton_state.served
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        first, y, grads = once(b, backend, batch, length, train, device)
        times = [once(b, backend, batch, length, train, device)[0] for _ in range(runs)]
        row[f"{backend}_first_s"] = round(first, 4)
        row[f"{backend}_s"] = round(statistics.median(times), 5)
        row[f"{backend}_runs_s"] = [round(t, 5) for t in times]
        if device.type == "cuda":
            row[f"{backend}_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        outputs[backend] = (y, grads)
        row[f"{backend}_flex_calls"] = flex_window.served - served  # 0 for the tiles, one per pass for flex: it served
        row[f"{backend}_state_calls"] = triton_state.served - state_served  # the same for the Triton kernels
    y_t, g_t = outputs["torch"]
    # every pass of a variant went through the backends it names, and no other
    agree = all(
        row[f"{v}_flex_calls"] == (runs + 1 if VARIANTS[v][0] == "flex" else 0)
        and row[f"{v}_state_calls"] == (runs + 1 if VARIANTS[v][2] == "triton" else 0)
        for v in variants
    )
    for variant in [v for v in COLUMNS if v in variants]:
        y_v, g_v = outputs[variant]
        errors = {"output": rel_err(y_v, y_t), **{f"grad_{n}": rel_err(g_v[n], g_t[n]) for n in g_t if g_t[n] is not None}}
        row[f"{variant}_rel_err"] = {n: float(f"{e:.3g}") for n, e in errors.items()}
        agree = agree and max(errors.values()) < TOLERANCE
        row[f"{variant}_speedup"] = round(row["torch_s"] / row[f"{variant}_s"], 3)
    row["agree"] = agree
    return row


def markdown(result: dict) -> str:
    columns = {v: name for v, name in COLUMNS.items() if v not in result.get("not_run", {})}
    lines = [
        f"Window part (tiled PyTorch against FlexAttention) and state part (PyTorch chunks against the Triton "
        f"kernels): {result['device']}, bf16 activations (float32 compute), one hybrid layer ({result['layer']}); "
        f"medians of {result['runs']} runs after a warm-up (a first call compiles FlexAttention and the kernels); "
        "speed-ups and errors against the default, tiles of 32 with the PyTorch state.",
        "",
        "| pass | batch x length | default s | " + " | ".join(f"{name} s (speed-up)" for name in columns.values())
        + " | flex first call s | worst rel. error | agree |",
        "|---|---|---:|" + "---:|" * len(columns) + "---:|---:|---|",
    ]
    for r in result["rows"]:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['pass']} | {r['batch']} x {r['length']:,} | {r.get('error') or r.get('skipped')} |" + " |" * (len(columns) + 3))
            continue
        worst = max(max(r[f"{v}_rel_err"].values()) for v in columns)
        cells = " | ".join(f"{r[f'{v}_s']:.4f} ({r[f'{v}_speedup']:.2f}x)" for v in columns)
        lines.append(f"| {r['pass']} | {r['batch']} x {r['length']:,} | {r['torch_s']:.4f} | {cells} | {r['flex_first_s']:.2f} | "
                     f"{worst:.2e} | {'yes' if r['agree'] else 'NO'} |")  # fmt: skip
    lines += [f"Not run, {variant}: {why}" for variant, why in result.get("not_run", {}).items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output", required=True, help="folder for window_backends.json and .md")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=None, help="rows that would start past it are skipped")
    parser.add_argument("--tiny", action="store_true", help="the CPU rehearsal: small rows, inference only")
    args = parser.parse_args(argv)
    from rfkit.atomic import atomic_write_json, atomic_write_text
    from rfkit.provenance import command_line, stamp

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 is float32 on both sides
    # the PyTorch tiles a GPU runs, not the CPU's compiled prefill (which never reaches either backend)
    WindowAttention.use_kernel = False
    flex_window.CPU_EAGER = True  # the rehearsal: FlexAttention eager on the CPU (off for users)
    triton_state.CPU_INTERPRET = True  # and the Triton kernels interpreted
    not_run = {}
    if device.type == "cpu" and (problem := triton_state.interpreter_problem()) is not None:
        # the twin cannot interpret the kernels here (Triton 3.6 under NumPy 2.5, the GPU image's
        # pair); a GPU compiles them. The window backends are still compared.
        for variant in [v for v in VARIANTS if VARIANTS[v][2] == "triton"]:
            not_run[variant] = f"Triton's interpreter cannot run the kernels here: {problem}"
    b = layer(device, args.tiny)
    cases = [(1, 128, False), (2, 256, False)] if args.tiny else [
        (4, 512, True), (1, 4096, True), (1, 32768, False)]  # fmt: skip
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = {"kind": "window_backends", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "layer": repr(b), "runs": args.runs, "tolerance": TOLERANCE, "rows": []}  # fmt: skip
    if not_run:
        result["not_run"] = not_run
    stamp(result, started, command_line(["benchmarks/gpu/window_backends.py", *(argv if argv is not None else sys.argv[1:])]))
    failed = False
    for batch, length, train in cases:
        ident = {"batch": batch, "length": length, "pass": "train (forward + backward)" if train else "prefill (forward)"}
        if args.budget_s is not None and time.time() - started > args.budget_s:
            row = {**ident, "skipped": "time budget"}
        else:
            try:
                row = measure(b, batch, length, train and device.type == "cuda", args.runs, device, skip=not_run)
            except Exception as err:  # one row's failure (out of memory, a compile error) must not cost the rest
                row = {**ident, "error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"}
                failed = True
            finally:
                WindowAttention.window_backend = HybridWindowAttention.state_backend = None
                window_module.TILE = hybrid_module.TILE = TILE
        failed = failed or row.get("agree") is False
        result["rows"].append(row)
        result["provenance"]["wall_seconds"] = round(time.time() - started, 1)
        atomic_write_json(out / "window_backends.json", result)
        atomic_write_text(out / "window_backends.md", markdown(result))
        print(markdown({**result, "rows": [row]}).splitlines()[-(1 + len(not_run))], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
