"""HashHop: follow a chain of random hashes through a shuffled list of assignments (the paper's h_gq).

This module scores generated chains and runs ``rfkit eval hashhop``; the samples (and
``rfkit data hashhop``) are :mod:`rfkit.evals.hashhop_samples`, fine-tuning on them
:mod:`rfkit.evals.hashhop_finetune` (the paper's appendix B; see
``recipes/smollm2_hashhop_b05.yaml``).

Scoring: :func:`parse_chain` reads a generated completion back into ``[h0, h1, ...]``;
:func:`score` is the longest correct prefix *after* h0 (h0 is given in the prompt and does not
count) divided by ``hops``; h_gq is the mean over samples, in [0, 1].

    rfkit eval hashhop --model DIR|RECIPE [--original] [--samples N] [--data FILE.jsonl] [--hops 16]
                       [--hash-len 8] [--chars 6144] [--seed 0] [--batch-size 1] [--max-new-tokens N]
                       [--device cpu|cuda] [--json OUT]
"""

from __future__ import annotations

import re
import sys
import time

from rfkit.evals.common import (
    EvalError,
    add_model_arguments,
    add_to_card,
    check_model_arguments,
    greedy_generate,
    write_json,
)

# the fine-tuning data module keeps the class_path shipped recipes and saved configs name:
# rfkit.evals.hashhop.HashHopDataModule
from rfkit.evals.hashhop_finetune import HashHopDataModule  # noqa: F401
from rfkit.evals.hashhop_samples import add_sample_arguments, check_sample_arguments, generate_samples, read_samples
from rfkit.validate import positive_int

AT_LEAST = "{field}: must be >= {minimum}, got {value}"


# -------------------------------------------------------------------------------------------- scoring
_ITEM = re.compile(r"\s*(['\"`]?)([A-Za-z]+)(['\"`]?)")
_SEP = re.compile(r"\s*=")


def parse_chain(text: str, first: str) -> list[str]:
    """The chain a generated completion predicts: ``[first, h1, h2, ...]``.

    Reads ``h1 = h2 = ... = 'hN'`` from the start of ``text`` (after an optional leading ``=``),
    ignoring whitespace (newlines included) and quote marks (``'``, ``"`` or a backtick) around a
    hash. Stops after a quoted hash (the end of a chain), at the first piece that is not a
    run of letters, or where no ``=`` follows; whatever trails is ignored. If the model repeats
    ``first`` as its first item, that repetition is dropped.
    """
    out = [first]
    pos = 0
    lead = _SEP.match(text, pos)
    if lead:
        pos = lead.end()
    while True:
        item = _ITEM.match(text, pos)
        if not item:
            break
        out.append(item.group(2))
        pos = item.end()
        if item.group(1) or item.group(3):
            break
        sep = _SEP.match(text, pos)
        if not sep:
            break
        pos = sep.end()
    if len(out) > 1 and out[1] == first:
        del out[1]
    return out


def score(pred: list[str], target: list[str]) -> float:
    """Longest correct prefix of ``pred`` after h0, divided by the number of hops.

    Both lists start with h0 (given in the prompt, so it does not count); a perfect chain
    scores 1.0, a wrong first hop 0.0, and hashes predicted beyond the end are ignored.
    """
    hops = len(target) - 1
    if hops < 1:
        raise ValueError("target needs h0 and at least one hop")
    correct = 0
    for i in range(1, len(target)):
        if i >= len(pred) or pred[i] != target[i]:
            break
        correct += 1
    return correct / hops


def per_hop_accuracy(rows: list[dict]) -> list[float]:
    """``[a_1, a_2, ...]``: a_k is the fraction of samples whose chain is right through hop k
    (its score times its hops is at least k), over the samples that have k hops or more."""
    hops = [len(r["target"]) - 1 for r in rows]
    right = [round(r["score"] * h) for r, h in zip(rows, hops)]
    out = []
    for k in range(1, max(hops) + 1):
        have = [c for c, h in zip(right, hops) if h >= k]
        out.append(sum(c >= k for c in have) / len(have))
    return out


def completion_budget(tokenizer, samples: list[dict], margin: float = 0.25, extra: int = 8) -> int:
    """Tokens to generate: the longest target completion in tokens, plus 25% and 8 tokens."""
    longest = max(len(tokenizer(s["completion"], add_special_tokens=False)["input_ids"]) for s in samples)
    return int(longest * (1 + margin)) + extra


def evaluate_hashhop(model, tokenizer, samples: list[dict], batch_size: int = 1, max_new_tokens: int | None = None) -> dict:
    """Greedy-decode each sample's prompt and score the predicted chains.

    Returns ``{"h_gq", "per_hop", "n", "max_new_tokens", "samples": [{"index", "prediction",
    "target", "score", "text"}, ...]}``, ``text`` being the raw generated completion and
    ``per_hop`` :func:`per_hop_accuracy`.
    """
    from tqdm.auto import tqdm

    if not samples:
        raise ValueError("no samples to evaluate")
    if max_new_tokens is None:
        max_new_tokens = completion_budget(tokenizer, samples)
    with tqdm(total=len(samples), desc="hashhop", unit="sample") as bar:
        texts = greedy_generate(model, tokenizer, [s["prompt"] for s in samples], max_new_tokens, batch_size, bar)
    rows = []
    for i, (s, text) in enumerate(zip(samples, texts)):
        target = list(s["chain"])
        pred = parse_chain(text, target[0])
        rows.append({"index": s.get("index", i), "prediction": pred, "target": target, "score": score(pred, target), "text": text})
    h_gq = sum(r["score"] for r in rows) / len(rows)
    return {"h_gq": h_gq, "per_hop": per_hop_accuracy(rows), "n": len(rows), "max_new_tokens": max_new_tokens, "samples": rows}


# -------------------------------------------------------------------------------------------- `rfkit eval hashhop`
def add_arguments(parser) -> None:
    """``--model --original --device --json`` plus the sample and decoding options."""
    add_model_arguments(parser)
    parser.add_argument("--samples", type=int, default=None, help="number of samples (default: all of --data, else 20)")
    parser.add_argument("--data", default=None, help="JSONL samples written by `rfkit data hashhop` (default: generate them; --hops/--hash-len/--chars/--seed then do not apply)")
    add_sample_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (left-padded)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens to generate (default: longest target completion + 25%% + 8)"
    )


def _tokenizer_for(spec):
    """The tokenizer of ``spec`` (the command's :class:`~rfkit.config.loading.ModelSpec`, or a path)."""
    from rfkit.config.loading import ModelSpec

    spec = ModelSpec.of(spec)
    try:
        return spec.tokenizer()
    except (OSError, ValueError) as e:
        raise EvalError(f"--model: cannot load a tokenizer for '{spec}': {' '.join(str(e).split())}") from None


def validate(args) -> None:
    """Checks that load no weights: counts, the data file, the model spec, and that the longest
    prompt plus the generated tokens fit the model's context (the tokenizer is loaded for that).
    Sets ``args.hh_samples``, ``args.max_new_tokens`` and ``args.prompt_tokens``."""
    from rfkit.config.loading import ModelSpecError, check_lengths_fit, max_context

    positive_int("--samples", args.samples, optional=True, error=EvalError, message=AT_LEAST)
    positive_int("--batch-size", args.batch_size, error=EvalError, message=AT_LEAST)
    positive_int("--max-new-tokens", args.max_new_tokens, optional=True, error=EvalError, message=AT_LEAST)
    if args.data is not None:
        samples = read_samples(args.data)
        if args.samples is not None:
            if args.samples > len(samples):
                raise EvalError(f"--samples: {args.data} holds only {len(samples)} samples, asked for {args.samples}")
            samples = samples[: args.samples]
        flag = "--data"
    else:
        check_sample_arguments(args)
        kw = {"hops": args.hops, "hash_len": args.hash_len, "chars": args.chars}
        samples = generate_samples(args.samples or 20, seed=args.seed, **kw)
        flag = "--chars"
    check_model_arguments(args)
    tokenizer = _tokenizer_for(args.model_spec)
    prompt_tokens = max(len(tokenizer(s["prompt"])["input_ids"]) for s in samples)
    if args.max_new_tokens is None:
        args.max_new_tokens = completion_budget(tokenizer, samples)
    try:
        check_lengths_fit([prompt_tokens], args.model_spec.config(), flag, extra=args.max_new_tokens)
    except ModelSpecError:
        limit = max_context(args.model_spec.config())
        room = limit - args.max_new_tokens
        if flag == "--chars":
            where = f"a prompt of {args.chars} characters is up to {prompt_tokens} tokens"
            fix = f"use --chars up to about {max(room, 0) * args.chars // prompt_tokens}"
        else:
            where = f"the longest prompt in {args.data} is {prompt_tokens} tokens"
            fix = "write shorter samples with `rfkit data hashhop --chars`"
        raise EvalError(
            f"{flag}: {where}, plus {args.max_new_tokens} generated, beyond the model's context "
            f"(max_position_embeddings {limit}); {fix}"
        ) from None
    args.hh_samples = samples
    args.prompt_tokens = prompt_tokens


def run(args) -> int:
    """Load the model, generate, score, print one summary line and write the JSON."""
    from rfkit.config.loading import load_model

    loaded = load_model(args.model_spec, args.original, args.torch_device)
    start = time.time()
    result = evaluate_hashhop(loaded.model, loaded.tokenizer, args.hh_samples, args.batch_size, args.max_new_tokens)
    wall = time.time() - start
    settings = {
        "data": args.data,
        "hops": sorted({len(s["chain"]) - 1 for s in args.hh_samples}),
        "hash_len": None if args.data else args.hash_len,
        "chars": None if args.data else args.chars,
        "seed": None if args.data else args.seed,
        "batch_size": args.batch_size,
        "prompt_tokens_max": args.prompt_tokens,
        "device": str(args.torch_device),
        "wall_seconds": round(wall, 2),
    }
    out = {
        "h_gq": result["h_gq"],
        "per_hop": result["per_hop"],
        "model": loaded.name,
        "base_model": loaded.base_model,
        "converted": loaded.converted,
        "original": bool(args.original),
        "notes": loaded.notes,
        "n": result["n"],
        "max_new_tokens": result["max_new_tokens"],
        **settings,
        "samples": result["samples"],
    }
    write_json(args.json_out, out, getattr(args, "command_line", None))
    where = f"samples of {args.data}" if args.data else f"{args.hops} hops, {args.chars} characters, seed {args.seed}"
    add_to_card(
        args, f"hashhop {where} n={result['n']} max_new_tokens={result['max_new_tokens']}",
        f"HashHop ({result['n']} samples, {where})",
        {"h_gq": result["h_gq"], **{f"right through hop {k}": a for k, a in enumerate(result["per_hop"], 1)}},
        {"h_gq": ".3f", **{f"right through hop {k}": ".2f" for k in range(1, len(result["per_hop"]) + 1)}},
    )  # fmt: skip
    sys.stdout.write(f"hashhop: h_gq {result['h_gq']:.4f} over {result['n']} samples, model {loaded.name} ({wall:.1f} s)\n")
    sys.stdout.write("right through hop " + ", ".join(f"{k}: {a:.2f}" for k, a in enumerate(result["per_hop"], 1)) + "\n")
    return 0
