"""Which layer's recurrent state turns a needle answer away from the key: the first answer token's
margin on ``rfkit eval needles`` prompts, with every state on, with each layer's state alone
switched off, with every state off, and for the original.

    python benchmarks/needle_margins.py MODEL [--shape plays] [--lengths 2048,4096] [--depths 1]
        [--trials 2] [--seed 0] [--token first|whole] [--output DIR]

The prompts are the ones ``rfkit eval needles`` asks (same shape, lengths, depths, trials and
seed, so the same keys). For each prompt the *margin* is the log-probability of the key's first
token minus the best other token's, at the position that answers: above 0 the greedy answer
starts with the key. A needle eval counts four prompts as 2 of 4; the margin says how far each
one is from flipping, and which layer's state moves it. ``--token whole``: the smallest margin over
all of the key's tokens instead (each following the key's tokens before it, teacher forced), for
keys of many tokens (``long``: 20 digits) that a model can start right and end wrong; above 0 the
greedy answer is the whole key, and the report names the weakest token. ``MODEL`` is a converted model directory
whose mixers have a state ablation (the hybrid and hybrid-Mamba operators). Costs one forward per
prompt of the original and ``2 + layers with a state`` of the converted model. Writes
``needle_margins.json`` (with provenance) and ``needle_margins.md`` into ``--output`` (default:
the model's folder) and prints the Markdown.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm.auto import tqdm

from rfkit.atomic import atomic_write_json, atomic_write_text
from rfkit.config.loading import load_model
from rfkit.training.state_audit import margins, prompt_pairs, stateful_layers, states_off
from rfkit.evals import needles
from rfkit.models.mixer import ablatable_mixers, ablate_states
from rfkit.provenance import stamp


TOKENS = {"first": "first", "whole": "margin"}  # --token -> the entry of key_margins.margins' rows


def report(model_dir: str, shape: str, lengths: list[int], depths: list[float], trials: int, seed: int, token: str = "first") -> dict:
    which = TOKENS[token]  # the entry of each prompt's margins that the rows report
    converted = load_model(model_dir)
    if not ablatable_mixers(converted.model):
        raise SystemExit(f"{model_dir}: no mixer with a state to switch off (the hybrid and hybrid-Mamba operators have one)")
    tok = converted.tokenizer
    records = needles.prompts(tok, needles.parse_shapes(shape), lengths, depths, trials, seed)
    prompts = prompt_pairs(tok, records)  # tokenized as rfkit eval needles tokenizes them
    original = load_model(model_dir, original=True).model.eval()
    rows = {"original": margins(original, prompts)}  # every margin of each prompt; `which` picks one below
    del original
    model = converted.model.eval()
    rows["every state on"] = margins(model, prompts)
    with ablate_states(model):
        rows["every state off"] = margins(model, prompts)
    layers = []
    for layer, mixers in tqdm(stateful_layers(model).items(), desc="one state off", unit="layer"):
        with states_off(mixers):
            got = margins(model, prompts)
        layers.append({"layer": layer, "margins": [g[which] for g in got]})
    for row in layers:
        row["change"] = [round(m - on[which], 4) for m, on in zip(row["margins"], rows["every state on"])]
    described = [{"length": r["length"], "depth": r["depth"], "trial": r["trial"], "key": r["key"], "key_token": answer[0]} for r, (_, answer) in zip(records, prompts)]
    for d, on in zip(described, rows["every state on"]):
        d["top_with_state"] = tok.decode([on["top"]])  # at the first answer token
        d["weakest_with_state"] = on["weakest"]  # which key token has the smallest margin (0: the first)
    return {"model": model_dir, "shape": shape, "lengths": lengths, "depths": depths, "trials": trials, "seed": seed, "token": token,
            "prompts": described, "rows": {k: [x[which] for x in v] for k, v in rows.items()}, "layers": layers}  # fmt: skip


def markdown(result: dict) -> str:
    heads = [f"{p['length']:,} d{p['depth']:g} #{p['trial']}" for p in result["prompts"]]
    what = (
        "the smallest margin over the key's tokens (log p of each key token minus the best other token's, the key's tokens before it given; above 0: the whole key)"
        if result.get("token") == "whole"
        else "first answer token's margin (log p of the key's first token minus the best other token's; above 0: the key)"
    )
    lines = [
        f"{result['model']}: {what} on `{result['shape']}` needles",
        "",
        "| model | " + " | ".join(heads) + " |",
        "|---|" + "---:|" * len(heads),
        *(f"| {name} | " + " | ".join(f"{m:+.2f}" for m in row) + " |" for name, row in result["rows"].items()),
        "| best first token with every state on | " + " | ".join(repr(p["top_with_state"]) for p in result["prompts"]) + " |",
        *(
            ["| weakest key token with every state on (0: the first) | " + " | ".join(str(p["weakest_with_state"]) for p in result["prompts"]) + " |"]
            if result.get("token") == "whole"
            else []
        ),
        "",
        "Margin change when one layer's state alone is off (positive: that layer's state pushes the answer away from the key), by mean change:",
        "",
        "| layer | " + " | ".join(heads) + " | mean |",
        "|---:|" + "---:|" * (len(heads) + 1),
    ]
    for row in sorted(result["layers"], key=lambda x: -sum(x["change"]) / len(x["change"])):
        lines.append(f"| {row['layer']} | " + " | ".join(f"{c:+.2f}" for c in row["change"]) + f" | {sum(row['change']) / len(row['change']):+.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--shape", default="plays", choices=sorted(needles.SHAPES))
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--depths", default="1")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token", default="first", choices=sorted(TOKENS), help="first: the first answer token's margin; whole: the smallest over the key's tokens")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if needles.SHAPES[args.shape].needles != 1:
        raise SystemExit(f"--shape: {args.shape} hides several keys; give one of the one-key shapes")
    started = time.time()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    result = stamp(report(args.model, args.shape, lengths, depths, args.trials, args.seed, args.token), started)
    out = Path(args.output or args.model)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "needle_margins.json", result)
    text = markdown(result)
    atomic_write_text(out / "needle_margins.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
