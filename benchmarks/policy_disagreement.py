"""Where the two built-in head rankings part: recency ratio against measured streaming loss.

    python benchmarks/policy_disagreement.py HEAD_MAP [--betas 0.5,0.75,0.9] [--output DIR]

``HEAD_MAP`` is a head map made by :class:`rfkit.policies.StreamedLossPolicy` (``rfkit convert``,
``rfkit fit`` or a ``rfkit sweep`` row with ``--policies streamed_loss``): it holds both the
recency profile (RA-I, mean RR) and the loss increase of streaming each KV group alone. For each
beta it lists the KV groups that only one of the two policies replaces, with what each policy
saw in them, and how much loss the groups the recency ranking replaces cost by the measured
loss (the sum of single-group increases: a first-order estimate, interactions not counted).

Writes ``disagreement.json`` (with provenance) and ``disagreement.md`` into ``--output``
(default: the head map's folder), and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rfkit.atomic import atomic_write_json, atomic_write_text
from rfkit.conversion.headmap import HeadMap
from rfkit.conversion.streamed_loss import disagreement, measured_delta
from rfkit.models.layout import AttentionLayout
from rfkit.provenance import stamp


def report(head_map: HeadMap, betas: list[float]) -> dict:
    # selection reads the head counts only
    layout = AttentionLayout("head map", head_map.num_layers, head_map.num_heads, head_map.num_kv_heads, 1, head_map.num_heads)
    delta = measured_delta(head_map)
    weight = head_map.policy.get("recall_weight", 0.0)  # planted records: the ranking's own weight
    rows = []
    for beta in betas:
        d = disagreement(layout, head_map, beta, recall_weight=weight)
        cost_loss = sum(r["delta"] for r in d["only_streamed_loss"])
        cost_rr = sum(r["delta"] for r in d["only_recency"])
        rows.append({**d, "extra_loss_of_recency_choice": round(cost_rr - cost_loss, 6)})
    per_layer = [round(sum(row), 6) for row in delta]
    return {"head_map": head_map.model, "measured": {k: v for k, v in head_map.measured.items() if k != "delta"},
            "loss_increase_per_layer": per_layer, "betas": rows}  # fmt: skip


def markdown(result: dict) -> str:
    m = result["measured"]
    lines = [
        f"Recency ratio (RA-I, then mean RR) against measured streaming loss (each KV group alone kept to "
        f"sink {m['sink']} + recent {m['recent']} tokens, {m['tokens']:,} tokens, baseline loss {m['baseline_loss']:.4f} nats).",
        "",
        "| beta | groups replaced | both agree | only by loss | only by recency | extra loss of the recency choice (first order, nats) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["betas"]:
        lines.append(
            f"| {r['beta']:g} | {r['replaced']} | {r['agree']} | {len(r['only_streamed_loss'])} | {len(r['only_recency'])} | "
            f"{r['extra_loss_of_recency_choice']:.4f} |"
        )
    for r in result["betas"]:
        lines += ["", f"beta {r['beta']:g}: groups only one policy replaces (layer.group: RA-I, mean RR, loss increase)", ""]
        for name, key in (("by loss only", "only_streamed_loss"), ("by recency only", "only_recency")):
            cells = ", ".join(f"{x['layer']}.{x['group']}: {x['rai']:g}, {x['rr_mean']:.2f}, {x['delta']:+.4f}" for x in r[key])
            lines.append(f"- {name}: {cells or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("head_map")
    parser.add_argument("--betas", default="0.5,0.75,0.9")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    started = time.time()
    head_map = HeadMap.load(args.head_map)
    try:
        betas = [float(b) for b in args.betas.split(",")]
    except ValueError:
        parser.error(f"--betas: {args.betas!r} is not allowed; give comma-separated numbers in [0, 1]")
    result = stamp(report(head_map, betas), started)
    out = Path(args.output) if args.output else Path(args.head_map).parent
    atomic_write_json(out / "disagreement.json", result)
    text = markdown(result)
    atomic_write_text(out / "disagreement.md", text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
