"""Which layer's recurrent state helps or hurts at a length: a converted model scored on long
blocks with every state on, with each layer's state alone switched off, and against the original,
with the loss split by position (before and after ``--split`` tokens, e.g. the training length,
and in spans of ``--span`` tokens, an eighth of the block unless given).

    python benchmarks/state_by_layer.py MODEL [--source embedded:shakespeare] [--length 8192]
        [--blocks 1] [--split 4096] [--span LENGTH/8] [--no-layers] [--output DIR]

``MODEL`` is a converted model directory whose mixers have a state ablation (the hybrid and
hybrid-Mamba operators). A layer whose state hurts shows a *lower* loss with its state off
(``delta`` < 0). Costs one forward of the original and ``2 + layers with a state`` forwards of
the converted model per block (``--no-layers``: 2, the per-layer rows left out). Writes
``state_by_layer.json`` (with provenance) and ``state_by_layer.md`` into ``--output`` (default:
the model's folder) and prints the Markdown.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from rfkit.atomic import atomic_write_json, atomic_write_text
from rfkit.config.loading import load_model
from rfkit.experiments.sweep import long_sets
from rfkit.models.mixer import ablatable_mixers, ablate_states
from rfkit.models.modeling import decoder_layers
from rfkit.provenance import stamp


@torch.no_grad()
def token_losses(model, blocks: list[torch.Tensor]) -> torch.Tensor:
    """Next-token losses ``(blocks, L - 1)`` in float32."""
    out = []
    for ids in blocks:
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        out.append(F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")[0])
    return torch.stack(out)


def _parts(losses: torch.Tensor, split: int) -> dict:
    """Mean loss over all positions, before ``split`` and from it on (positions of the predicted token)."""
    return {"all": float(losses.mean()), "before": float(losses[:, : split - 1].mean()), "after": float(losses[:, split - 1 :].mean())}


def _spans(losses: torch.Tensor, base: torch.Tensor, span: int) -> list[tuple[int, int, float]]:
    """``(first, end, ratio)`` per span of ``span`` predicted positions: the perplexity ratio to
    ``base`` over those positions of every block (position ``p`` predicts token ``p + 1``)."""
    n = losses.shape[1]
    return [(a, min(a + span, n), math.exp(float(losses[:, a : a + span].mean() - base[:, a : a + span].mean()))) for a in range(0, n, span)]


def report(model_dir: str, source: str, length: int, blocks: int, split: int, span: int | None = None, layers: bool = True) -> dict:
    span = max(1, length // 8) if span is None else span
    if not 1 < split < length:
        raise SystemExit(f"--split: {split} is not allowed; give 1 < split < --length ({length})")
    if not 1 <= span < length:
        raise SystemExit(f"--span: {span} is not allowed; give 1 <= span < --length ({length})")
    converted = load_model(model_dir)
    mixers = ablatable_mixers(converted.model)
    if not mixers:
        raise SystemExit(f"{model_dir}: no mixer with a state to switch off (the hybrid and hybrid-Mamba operators have one)")
    batches = next(iter(long_sets(source, converted.tokenizer.name_or_path, [length], blocks).values()))
    ids = [b["input_ids"] for b in batches]
    original = load_model(model_dir, original=True).model
    base = token_losses(original, ids)
    del original
    model = converted.model
    on = token_losses(model, ids)
    with ablate_states(model):
        off = token_losses(model, ids)
    layer_of = {id(m): i for i, layer in enumerate(decoder_layers(model)) for m in layer.modules()}
    rows = []
    for mixer in tqdm(mixers if layers else [], desc="one state off", unit="layer"):
        with mixer.state_ablation():
            alone = token_losses(model, ids)
        rows.append({"layer": layer_of[id(mixer)], **{f"delta_{k}": round(v - _parts(on, split)[k], 5) for k, v in _parts(alone, split).items()}})
    per_block = [round(math.exp(float(on[b].mean() - base[b].mean())), 4) for b in range(len(ids))]
    summary = {name: {k: round(math.exp(v - _parts(base, split)[k]), 4) for k, v in _parts(t, split).items()} for name, t in (("state_on", on), ("state_off", off))}
    by_span = [{"from": a, "to": b, "state_on": round(r_on, 4), "state_off": round(r_off, 4)}
               for (a, b, r_on), (_, _, r_off) in zip(_spans(on, base, span), _spans(off, base, span))]
    return {"model": model_dir, "source": source, "length": length, "blocks": len(ids), "split": split,
            "ppl_ratio": summary, "ppl_ratio_per_block": per_block, "span": span, "by_span": by_span,
            "layers": rows}  # fmt: skip


def markdown(result: dict) -> str:
    s, r = result["split"], result["ppl_ratio"]
    lines = [
        f"{result['model']}: {result['blocks']} block(s) of {result['length']:,} tokens of {result['source']}; perplexity ratio to the original, all / before {s:,} / from {s:,} on:",
        "",
        f"- every state on: {r['state_on']['all']:.3f} / {r['state_on']['before']:.3f} / {r['state_on']['after']:.3f} (per block: {', '.join(f'{x:.3f}' for x in result['ppl_ratio_per_block'])})",
        f"- every state off: {r['state_off']['all']:.3f} / {r['state_off']['before']:.3f} / {r['state_off']['after']:.3f}",
        "",
        "Perplexity ratio to the original by position (the predicted token's position, from and below):",
        "",
        "| positions | every state on | every state off |",
        "|---|---:|---:|",
        *(f"| {row['from']:,}-{row['to']:,} | {row['state_on']:.3f} | {row['state_off']:.3f} |" for row in result.get("by_span", [])),
    ]
    if result["layers"]:
        lines += [
            "",
            "Loss change (nats per token) when one layer's state alone is off; negative: that state hurts.",
            "",
            f"| layer | all | before {s:,} | from {s:,} on |",
            "|---:|---:|---:|---:|",
        ]
    for row in sorted(result["layers"], key=lambda x: x["delta_after"]):
        lines.append(f"| {row['layer']} | {row['delta_all']:+.4f} | {row['delta_before']:+.4f} | {row['delta_after']:+.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--source", default="embedded:shakespeare")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--split", type=int, default=4096)
    parser.add_argument("--span", type=int, default=None, help="positions per row of the by-position table (default: an eighth of --length)")
    parser.add_argument("--no-layers", action="store_true", help="leave out the per-layer rows (2 forwards per block, not 2 + layers)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    started = time.time()
    result = stamp(report(args.model, args.source, args.length, args.blocks, args.split, args.span, not args.no_layers), started)
    out = Path(args.output or args.model)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "state_by_layer.json", result)
    text = markdown(result)
    atomic_write_text(out / "state_by_layer.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
