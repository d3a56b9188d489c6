"""The state audit of ``rfkit fit``'s ``state_audit`` section, on a model already trained: measure
which layers' states turn a quote away and write a copy with those states closed.

    python benchmarks/state_audit.py SRC DST [--max-layers 3] [--shape plays] [--lengths 2048,4096]
        [--depths 1] [--trials 4] [--seed 0] [--split train] [--min-margin 0.5]

The calibration prompts read the filler's ``--split`` (never the validation split that ``rfkit
eval needles`` asks; :mod:`rfkit.training.state_audit`). ``DST`` is written as
``benchmarks/sharpen.py --close-states`` writes it (same weights, the chosen layers' gates at 0),
with ``state_audit.json`` (the report, with provenance) beside its weights. When no layer is
closed, ``DST`` is not written and the report goes to ``DST.state_audit.json``. ``--report PATH``
writes it there instead, in both cases. Bad settings get one line naming the field and exit code 2 before the model
loads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    parser.add_argument("--report", type=Path, default=None, help="where the report goes (default: see above)")
    args = parser.parse_args(argv)
    started = time.time()

    from rfkit.atomic import atomic_write_json
    from rfkit.training.state_audit import StateAuditConfig, audit
    from rfkit.errors import RFKitError
    from sharpen import check, sharpen

    try:
        config = StateAuditConfig(
            shape=args.shape, lengths=[int(x) for x in args.lengths.split(",")], depths=[float(x) for x in args.depths.split(",")],
            trials=args.trials, seed=args.seed, split=args.split, max_layers=args.max_layers, min_margin=args.min_margin,
        )  # fmt: skip
        check(args.src, args.dst, None)
    except (RFKitError, ValueError) as exc:
        print(f"state_audit.py: error: {exc}", file=sys.stderr)
        return 2

    from rfkit.config.loading import load_model
    from rfkit.provenance import stamp

    loaded = load_model(str(args.src))
    report = audit(loaded.model, loaded.tokenizer, config, close=False)
    del loaded
    report["model"] = str(args.src)
    closed = tuple(report["closed"])
    if closed:
        sharpen(args.src, args.dst, None, closed)
        report["audited_model"] = str(args.dst)
    else:
        print(f"{args.src}: no state closed ({len(report['targets'])} targets); {args.dst} not written")
    out = args.report or (args.dst / "state_audit.json" if closed else args.dst.with_name(args.dst.name + ".state_audit.json"))
    atomic_write_json(out, stamp(report, started))
    quoted = "every" if report["all_targets_quoted"] else "not every"
    print(f"closed layers {', '.join(map(str, closed)) or 'none'}; {quoted} calibration key the window alone quotes is quoted")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
