"""Passkey retrieval: find a 5-digit key hidden at a chosen depth in filler text.

    rfkit eval passkey --model DIR|RECIPE [--original] --lengths 512,1024,4096
                       --depths 0,0.25,0.5,0.75,1 --trials 5 --seed 0 [--device cpu] --json OUT

Each prompt is an instruction line, the filler "The grass is green. The sky is blue. The sun is
yellow. Here we go. There and back again." repeated, the needle "The pass key is NNNNN.
Remember it. NNNNN is the pass key." placed after ``round(depth * sentences)`` filler sentences
(depth 0: before all filler, 1: after all of it), and the question "What is the pass key? The
pass key is". The number of filler sentences is the largest for which the prompt, tokenised by
the model's own tokenizer the way generation tokenises it, is at most ``length`` tokens (so it
lands within one sentence, a few tokens, of the target). Each trial draws its own key from a
generator seeded by (seed, length, depth, trial), so the original and the converted model see
the same prompts. The model answers greedily (``--new-tokens``, default 8); a trial is correct
when the first integer in the answer equals the key.
"""

from __future__ import annotations

import re
import time

from rfkit.config.args import parse_depths, parse_lengths
from rfkit.data.needle_prompts import (  # noqa: F401  (the template's names, read by the evaluations and tests)
    FILLER,
    FILLER_SENTENCES,
    INSTRUCTION,
    NEEDLE,
    NEW_TOKENS,
    QUESTION,
    PromptError,
    build_prompt,
    compose,
    count_tokens,
    longest_prompt,
    template_tokens,
    trial_key,
)
from rfkit.evals.common import (
    EvalError,
    add_model_arguments,
    add_to_card,
    check_model_arguments,
    greedy_generate,
    positive_int,
    write_json,
)

def score(output: str, key: int) -> bool:
    """Correct when the first integer in ``output`` is the key."""
    found = re.search(r"\d+", output)
    return found is not None and found.group() == str(key)


# ----------------------------------------------------------------------------- evaluation
def evaluate_passkey(
    model,
    tokenizer,
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int = 0,
    progress: bool = True,
    new_tokens: int = NEW_TOKENS,
    batch_size: int = 1,
) -> dict:
    """Passkey accuracy per (length, depth), per length and overall, with every trial's record.

    ``progress`` shows a tqdm bar over the prompts. Prompts are generated greedily in batches of
    ``batch_size`` (left-padded).
    """
    from tqdm.auto import tqdm

    records = []
    prompts = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                key = trial_key(seed, length, depth, trial)
                text, n_tokens = build_prompt(tokenizer, length, depth, key)
                prompts.append(text)
                records.append(
                    {"length": length, "depth": depth, "trial": trial, "key": key, "prompt_tokens": n_tokens}
                )
    with tqdm(total=len(prompts), desc="passkey", unit="prompt", disable=not progress) as bar:
        outputs = greedy_generate(model, tokenizer, prompts, new_tokens, batch_size=batch_size, progress=bar)
    for record, output in zip(records, outputs):
        record["output"] = output
        record["correct"] = score(output, record["key"])

    def accuracy(rows) -> float:
        return sum(r["correct"] for r in rows) / len(rows)

    cells = []
    for length in lengths:
        for depth in depths:
            rows = [r for r in records if r["length"] == length and r["depth"] == depth]
            cells.append(
                {
                    "length": length,
                    "depth": depth,
                    "accuracy": accuracy(rows),
                    "correct": sum(r["correct"] for r in rows),
                    "trials": len(rows),
                    "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rows) / len(rows),
                }
            )
    by_length = [
        {"length": length, "accuracy": accuracy([r for r in records if r["length"] == length])} for length in lengths
    ]
    return {
        "lengths": list(lengths),
        "depths": list(depths),
        "trials": trials,
        "seed": seed,
        "new_tokens": new_tokens,
        "cells": cells,
        "by_length": by_length,
        "overall": accuracy(records),
        "records": records,
    }


def format_table(result: dict) -> str:
    """Markdown: a row per length, a column per depth and the length's mean, then the overall."""
    depths = result["depths"]
    head = "| length | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean |"
    rule = "|---:|" + "---:|" * (len(depths) + 1)
    lines = [head, rule]
    cell = {(c["length"], c["depth"]): c["accuracy"] for c in result["cells"]}
    for row in result["by_length"]:
        values = [f"{cell[(row['length'], d)]:.2f}" for d in depths]
        lines.append(f"| {row['length']} | " + " | ".join(values) + f" | {row['accuracy']:.2f} |")
    lines.append(f"\noverall accuracy: {result['overall']:.3f} ({len(result['records'])} trials)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command
def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="512,1024,4096", help="prompt lengths in tokens, comma separated")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1], comma separated")
    parser.add_argument("--trials", type=int, default=5, help="random keys per (length, depth)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the keys")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens generated per answer")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")


def spec_tokenizer(spec):
    """The tokenizer the model spec (a path, or the command's
    :class:`~rfkit.config.loading.ModelSpec`) will load with (no weights)."""
    from rfkit.config.loading import ModelSpec

    return ModelSpec.of(spec).tokenizer()


def validate(args) -> None:
    """Every check that needs no weights (the tokenizer is loaded to size the template)."""
    args.length_list = parse_lengths(args.lengths, "--lengths", example="512,1024", error=EvalError)
    args.depth_list = parse_depths(args.depths, "--depths", error=EvalError)
    positive_int(args, "trials")
    positive_int(args, "new_tokens")
    positive_int(args, "batch_size")
    check_model_arguments(args, args.length_list, extra_tokens=args.new_tokens)
    need = template_tokens(spec_tokenizer(args.model_spec))
    short = [n for n in args.length_list if n < need]
    if short:
        raise EvalError(
            f"--lengths: {short[0]} tokens cannot hold the passkey template ({need} tokens without filler); "
            f"give lengths of at least {need}"
        )


def run(args) -> int:
    from rfkit.config.loading import load_model

    loaded = load_model(args.model_spec, args.original, args.torch_device)
    start = time.perf_counter()
    result = evaluate_passkey(
        loaded.model, loaded.tokenizer, args.length_list, args.depth_list, args.trials, args.seed,
        progress=True, new_tokens=args.new_tokens, batch_size=args.batch_size,
    )  # fmt: skip
    result = {
        "task": "passkey",
        "model": loaded.name,
        "base_model": loaded.base_model,
        "converted": loaded.converted,
        "notes": loaded.notes,
        "device": str(args.torch_device),
        "wall_seconds": round(time.perf_counter() - start, 2),
        **result,
    }
    print(f"passkey retrieval: {loaded.name}")
    print(format_table(result))
    write_json(args.json_out, result, getattr(args, "command_line", None))
    depths = ", ".join(f"{d:g}" for d in args.depth_list)
    add_to_card(
        args, f"passkey depths={depths} trials={args.trials} seed={args.seed} new_tokens={args.new_tokens}",
        f"Passkey retrieval (depths {depths}; {args.trials} key{'s' * (args.trials > 1)} per depth, seed {args.seed})",
        {f"accuracy, {row['length']:,} tokens": row["accuracy"] for row in result["by_length"]},
        {f"accuracy, {n:,} tokens": ".2f" for n in args.length_list},
    )  # fmt: skip
    return 0
