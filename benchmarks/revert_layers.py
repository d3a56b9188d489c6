"""Which converted layers carry the quality loss: perplexity with one layer at a time reverted.

    python benchmarks/revert_layers.py --model runs/smollm2_b05/lightning_logs/version_0/model
        [--val-blocks 16] [--output benchmarks/results/revert_smollm2_b05.json]

Loads a converted model directory and its base model (named in the head map), measures the
converted model's perplexity on the validation blocks of the embedded-default data settings
(the recipe's ``--config``), then, for every converted layer, puts that layer's original
attention back and measures again. A layer whose revert recovers much of the gap is where the
new block falls short. The run's ``summary.json`` (next to the model), when present, adds each
layer's attention-transfer MSE to the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    run_started = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a converted model directory (with head_map.json)")
    p.add_argument("--config", default="recipes/smollm2_b05.yaml", help="recipe whose data settings give the validation blocks")
    p.add_argument("--val-blocks", type=int, default=16)
    p.add_argument("--output", default=None, help="JSON path (default: revert_layers.json beside the model)")
    args = p.parse_args(argv)

    from rfkit.atomic import atomic_write_json
    from rfkit.config.loading import load_model, parse_recipe
    from rfkit.evals.perplexity import evaluate_perplexity

    started = time.time()
    model_dir = Path(args.model)
    converted = load_model(str(model_dir)).model
    original = load_model(str(model_dir), original=True).model
    _, datamodule = parse_recipe(args.config, [])
    datamodule.setup("fit")
    val = datamodule.validation[: args.val_blocks]
    batches = [{"input_ids": val[i : i + datamodule.batch_size]} for i in range(0, len(val), datamodule.batch_size)]

    ppl_original = evaluate_perplexity(original, batches, desc="perplexity (original)")
    ppl_converted = evaluate_perplexity(converted, batches, desc="perplexity (converted)")
    summary_path = model_dir.parent / "summary.json"
    mse = json.loads(summary_path.read_text()).get("transfer", {}).get("mse_after", {}) if summary_path.exists() else {}

    ours = converted.get_decoder().layers
    theirs = original.get_decoder().layers
    rows = []
    for i, layer in enumerate(ours):
        if not hasattr(layer.self_attn, "mixer"):
            continue
        mine = layer.self_attn
        layer.self_attn = theirs[i].self_attn
        try:
            ppl = evaluate_perplexity(converted, batches, desc=f"perplexity (layer {i} reverted)")
        finally:
            layer.self_attn = mine
        row = {
            "layer": i,
            "replaced_heads": len(mine.replaced_heads),
            "ppl": ppl,
            "ppl_ratio": ppl / ppl_original,
            "gap_recovered": (ppl_converted - ppl) / max(ppl_converted - ppl_original, 1e-12),
            "transfer_mse": mse.get(str(i)),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: -r["gap_recovered"])
    result = {
        "command": "python benchmarks/revert_layers.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": str(model_dir),
        "val_blocks": int(val.shape[0]),
        "ppl_original": ppl_original,
        "ppl_converted": ppl_converted,
        "ppl_ratio": ppl_converted / ppl_original,
        "layers": rows,
        "wall_seconds": round(time.time() - started, 1),
    }
    out = Path(args.output) if args.output else model_dir.parent / "revert_layers.json"
    from rfkit.provenance import stamp

    stamp(result, run_started, result["command"])
    atomic_write_json(out, result)
    print(f"original {ppl_original:.3f}, converted {ppl_converted:.3f} (ratio {ppl_converted / ppl_original:.3f}) -> {out}")
    print("| layer | heads | PPL with it reverted | ratio | share of gap recovered | transfer MSE |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        m = "-" if r["transfer_mse"] is None else f"{r['transfer_mse']:.3f}"
        print(f"| {r['layer']} | {r['replaced_heads']} | {r['ppl']:.2f} | {r['ppl_ratio']:.3f} | {r['gap_recovered']:.1%} | {m} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
