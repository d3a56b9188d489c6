"""The state audit of ``rfkit fit``'s ``state_audit`` section, on a model already trained: measure
which layers' states turn a quote away and write a copy with those states closed.

    python benchmarks/state_audit.py SRC DST [--max-layers 3] [--shape plays] [--lengths 2048,4096]
        [--depths 1] [--trials 4] [--seed 0] [--split train] [--min-margin 0.5] [--guards long]
        [--guard-depths 0,0.5] [--no-heads] [--gates-from RUN/summary.json]

The calibration prompts read the filler's ``--split`` (never the validation split that ``rfkit
eval needles`` asks; :mod:`rfkit.training.state_audit`). ``DST`` is written as
``benchmarks/sharpen.py --close-states`` writes it (same weights, the chosen layers' gates at 0),
with ``state_audit.json`` (the report, with provenance) beside its weights. When no layer is
closed (and no ``--gates-from``), ``DST`` is not written and the report goes to ``DST.state_audit.json``. ``--report PATH``
writes it there instead, in both cases. ``--gates-from`` audits again a model that ``rfkit fit``
already audited: every state gate is first set to the value the fit's own audit started from
(``RUN/summary.json``, its ``state_audit.gates_before``), so the audit starts from the trained
model, not from the closings of an older audit. A checkpoint (``checkpoints/last.ckpt``) also
works, with the gates of its own step: a fit writes one every 5 steps, so a 72-step fit's last
is step 70, two steps before training ended (the report records the step). Bad settings get one
line naming the field and exit code 2 before the model loads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def saved_gates(source: Path) -> tuple[dict, int | None]:
    """The state gates a ``--gates-from`` file holds: ``(parameter name or layer -> values, step)``.
    A fit's ``summary.json`` (or an audit report) holds ``gates_before``, the gates its audit
    started from (layer -> one value per head); a checkpoint holds every gate by parameter name at
    its own step (a fit writes one every few steps, so ``last.ckpt`` can be a few steps before
    training ended)."""
    import json

    import torch

    if source.suffix == ".json":
        data = json.loads(source.read_text())
        gates = data.get("gates_before", (data.get("state_audit") or {}).get("gates_before"))
        if gates is None:
            raise ValueError(f"--gates-from: {source} has no state audit's gates_before (a fit's summary.json with a state audit, or an audit report)")
        return {int(k): v for k, v in gates.items()}, None
    saved = torch.load(source, map_location="cpu", weights_only=False)
    prefix = "model."
    return {k[len(prefix) :]: v for k, v in saved["state_dict"].items() if k.startswith(prefix) and k.endswith("mixer.gate")}, saved.get("global_step")


def reopen(model, source: Path) -> tuple[list[str], int | None]:
    """Set every state gate of ``model`` to its value in ``source`` (:func:`saved_gates`); returns
    the gates whose values changed (parameter names) and the checkpoint's step (None for a
    summary)."""
    import torch

    from rfkit.training.state_audit import gate_slots, stateful_layers

    gates, step = saved_gates(source)
    changed = []
    with torch.no_grad():
        if source.suffix == ".json":
            layers = stateful_layers(model)
            if sorted(gates) != sorted(layers) or any(len(gates[i]) != len(gate_slots(layers[i])) for i in layers):
                raise SystemExit(f"--gates-from: {source}'s gates are not this model's (layers {sorted(gates)}; this model's {sorted(layers)})")
            names = {id(p): n for n, p in model.named_parameters()}
            for i, mixers in layers.items():
                for (mixer, at), value in zip(gate_slots(mixers), gates[i]):
                    if float(mixer.gate[at]) != value:
                        changed.append(f"{names[id(mixer.gate)]}[{at}]")
                    mixer.gate[at] = value
            return changed, None
        for name, gate in model.named_parameters():
            if not name.endswith("mixer.gate"):
                continue
            saved = gates.get(name)
            if saved is None or saved.shape != gate.shape:
                raise SystemExit(f"--gates-from: {source} has no gate {name!r} of shape {tuple(gate.shape)}; not this model's fit")
            if not torch.equal(saved.to(gate.dtype), gate):
                changed.append(name)
            gate.copy_(saved)
    return changed, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a saved hybrid model folder")
    parser.add_argument("dst", type=Path, help="the audited copy (must not exist)")
    parser.add_argument("--max-layers", type=int, default=3)
    parser.add_argument("--shape", default="plays")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--depths", default="1")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="train")
    parser.add_argument("--min-margin", type=float, default=0.5)
    parser.add_argument("--guards", default="long", help="guard shapes, comma separated ('' for none)")
    parser.add_argument("--guard-depths", default="0,0.5")
    parser.add_argument("--no-heads", action="store_true", help="a layer a guard refuses stays open (no head-by-head tries)")
    parser.add_argument(
        "--gates-from", type=Path, default=None,
        help="a fit's summary.json (the gates its audit started from) or a checkpoint, whose state gates the model starts from",
    )  # fmt: skip
    parser.add_argument("--report", type=Path, default=None, help="where the report goes (default: see above)")
    args = parser.parse_args(argv)
    started = time.time()

    from rfkit.atomic import atomic_write_json
    from rfkit.conversion.model_card import describe_closed
    from rfkit.training.state_audit import StateAuditConfig, audit, close_states
    from rfkit.errors import RFKitError
    from sharpen import check, sharpen

    try:
        config = StateAuditConfig(
            shape=args.shape, lengths=[int(x) for x in args.lengths.split(",")], depths=[float(x) for x in args.depths.split(",")],
            trials=args.trials, seed=args.seed, split=args.split, max_layers=args.max_layers, min_margin=args.min_margin,
            guards=[g for g in args.guards.split(",") if g], guard_depths=[float(x) for x in args.guard_depths.split(",") if x],
            heads=not args.no_heads,
        )  # fmt: skip
        check(args.src, args.dst, None)
        if args.gates_from is not None and not args.gates_from.is_file():
            raise ValueError(f"--gates-from: {args.gates_from} is not a file (a fit's summary.json, or its checkpoints/last.ckpt)")
        if args.gates_from is not None and args.gates_from.suffix == ".json":
            saved_gates(args.gates_from)  # a summary without an audit: one line before the model loads
    except (RFKitError, ValueError) as exc:
        print(f"state_audit.py: error: {exc}", file=sys.stderr)
        return 2

    from rfkit.config.loading import load_model
    from rfkit.provenance import stamp

    loaded = load_model(str(args.src))
    if args.gates_from is not None:
        report_gates, step = reopen(loaded.model, args.gates_from)
    report = audit(loaded.model, loaded.tokenizer, config, close=False)
    del loaded
    report["model"] = str(args.src)
    if args.gates_from is not None:
        if args.gates_from.suffix == ".json":
            report["gates_from"] = {"summary": str(args.gates_from), "reset": report_gates}
        else:
            report["gates_from"] = {"checkpoint": str(args.gates_from), "step": step, "reset": report_gates}
    closed = tuple(report["closed"])

    def prepare(model):  # the gates the audit started from, then its closings (whole layers or heads)
        if args.gates_from is not None:
            reopen(model, args.gates_from)
        close_states(model, closed, report["closed_heads"])

    if closed or args.gates_from is not None:  # the reopened model is new even with nothing closed
        sharpen(args.src, args.dst, None, (), prepare)
        report["audited_model"] = str(args.dst)
    else:
        print(f"{args.src}: no state closed ({len(report['targets'])} targets); {args.dst} not written")
    out = args.report or (args.dst / "state_audit.json" if "audited_model" in report else args.dst.with_name(args.dst.name + ".state_audit.json"))
    atomic_write_json(out, stamp(report, started))
    quoted = "every" if report["all_targets_quoted"] else "not every"
    print(f"closed layers {describe_closed(report)}; {quoted} calibration key the window alone quotes is quoted")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
