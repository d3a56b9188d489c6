"""The training loss's time on the logits: next-token CE plus KL to the teacher as the plain
expressions compute them (``summed_nll`` and one-expression KL, autograd over full-size float32
tensors) against :func:`rfkit.training.distill.rowwise_loss` (a few positions at a time, the
gradient made in the same pass), forward and backward, on the logits of one training batch.
``rowwise_loss`` runs the compiled CPU loss where it is built (``kernels/loss_cpu.c``); its PyTorch
twin (a few positions at a time) is timed beside it as ``rowwise_pytorch``.

    python benchmarks/loss_rows.py [--shape 4x511x49152] [--dtype bfloat16] [--runs 5]
        [--output benchmarks/results/precision_smollm2_b05/loss_rows.json]

The default shape is the default recipe's Wikipedia batch (4 x 512 tokens, the next-token
positions) over SmolLM2's 49,152-word vocabulary, in the bf16 logits a ``bf16-true`` fit makes.
The two run interleaved, the order alternating, after one untimed run each; medians of ``--runs``.
Also checks that both give the same value and gradient.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def plain_loss(student: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The expressions rowwise_loss replaced: mean next-token CE plus the mean over positions of
    KL(teacher || student), temperature 1."""
    ce = F.cross_entropy(student.float().reshape(-1, student.shape[-1]), targets.reshape(-1))
    log_s = F.log_softmax(student.float(), dim=-1)
    log_t = F.log_softmax(teacher.float(), dim=-1)
    return ce + (log_t.exp() * (log_t - log_s)).sum(-1).mean()


def _without_kernel(fn):
    """``fn()`` with the compiled CPU loss switched off: rowwise_loss's PyTorch twin."""
    from rfkit.training import distill

    real = distill._kernel_takes
    distill._kernel_takes = lambda *args: False
    try:
        return fn()
    finally:
        distill._kernel_takes = real


def _timed(fn, student, targets, teacher) -> tuple[float, torch.Tensor, torch.Tensor]:
    student.grad = None
    t0 = time.perf_counter()
    value = fn(student, targets, teacher)
    value.backward()
    return time.perf_counter() - t0, value.detach(), student.grad


def main(argv: list[str] | None = None) -> int:
    from rfkit.atomic import atomic_write_json
    from rfkit.provenance import command_line, stamp
    from rfkit.training import distill

    parser = argparse.ArgumentParser(prog="loss_rows.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4x511x49152", help="BATCHxPOSITIONSxVOCAB")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/precision_smollm2_b05/loss_rows.json"))
    args = parser.parse_args(argv)
    started = time.time()
    B, L, V = (int(x) for x in args.shape.lower().split("x"))
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    student = (torch.randn(B, L, V, generator=generator) * 3).to(dtype).requires_grad_()
    teacher = (torch.randn(B, L, V, generator=generator) * 3).to(dtype)
    targets = torch.randint(0, V, (B, L), generator=generator)
    fns = {
        "plain": plain_loss,
        "rowwise": lambda s, y, t: distill.rowwise_loss(s, targets=y, teacher=t)[0],
        "rowwise_pytorch": lambda s, y, t: _without_kernel(lambda: distill.rowwise_loss(s, targets=y, teacher=t)[0]),
    }
    times = {name: [] for name in fns}
    outputs = {}
    for name, fn in fns.items():  # untimed warm-up, and the values compared below
        _, value, grad = _timed(fn, student, targets, teacher)
        outputs[name] = (float(value), grad.clone())
    for run in range(args.runs):
        for name in list(fns) if run % 2 == 0 else list(fns)[::-1]:
            times[name].append(_timed(fns[name], student, targets, teacher)[0])
    (v_plain, g_plain), (v_rows, g_rows) = outputs["plain"], outputs["rowwise"]
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "shape": [B, L, V], "dtype": args.dtype, "runs": args.runs, "threads": torch.get_num_threads(),
        "seconds": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
        "median_s": {name: round(m, 4) for name, m in medians.items()},
        "speedup": round(medians["plain"] / medians["rowwise"], 2),
        "compiled": distill._kernel_takes(student, teacher, student),
        "speedup_over_pytorch_rowwise": round(medians["rowwise_pytorch"] / medians["rowwise"], 2),
        "value_difference": abs(v_plain - v_rows),
        "grad_max_difference": float((g_plain.float() - g_rows.float()).abs().max()),
        "grad_max": float(g_plain.float().abs().max()),
    }  # fmt: skip
    stamp(result, started, command_line([__file__, *(argv if argv is not None else sys.argv[1:])]))
    atomic_write_json(args.output, result)
    print(json.dumps({k: result[k] for k in ("median_s", "speedup", "speedup_over_pytorch_rowwise", "value_difference", "grad_max_difference")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
