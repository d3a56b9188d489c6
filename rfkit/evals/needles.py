"""Needles of several shapes: which ones the converted model finds, against the original and the training-free baseline.

    rfkit eval needles --model DIR [--shapes passkey,prose,plays,long,multi]
                       [--lengths 2048,4096] [--depths 0,0.5,1] [--trials 2] [--seed 0]
                       [--baseline matched | "sink_recent(sink=4,window=64)" | none]
                       [--no-state-off] [--batch-size 1] [--output DIR] [--device cpu] [--no-record]

The passkey test (:mod:`rfkit.evals.passkey`) asks for one 5-digit key in one repeated filler.
A model can pass it by a trick a window also has: the filler repeats, so anything that is not
filler stands out. The shapes here vary the filler, the needle and the number of needles:

- ``passkey``: the passkey test itself (the same prompts and keys as ``rfkit eval passkey`` and
  ``rfkit eval context`` at the same prompt length);
- ``prose``: the passkey needle in running text: held-out Wikipedia summaries
  (``embedded:wikipedia-en``'s validation split), each trial from its own starting sentence;
  its question asks for "the number" (:data:`PROSE_QUESTION`: after encyclopaedic text a small
  model completes "The pass key is" with a definition);
- ``plays``: the same in held-out Shakespeare (``embedded:shakespeare``'s validation plays);
- ``long``: a 20-digit key in the passkey filler (one token per digit with SmolLM2's tokenizer);
- ``multi``: three keys, each for a door of its own colour, at depths d, d + 1/3 and d + 2/3
  (mod 1) of the passkey filler; the question asks for the one at depth d, whose colour the
  trial draws. ``answered_other`` records answers that are another door's key.

Filler sentences that hold a digit are left out of ``prose`` and ``plays``: the score reads
the first integer of the answer, and a year in the filler would make the test one of
distractors, which ``multi`` asks on purpose. A trial is correct when the first integer of the
greedy answer is the key. Each prompt is at most the length less the shape's answer tokens, so
prompt and answer fit in the length, as in ``rfkit eval context``.

Models, all in one process on the same prompts (as :mod:`rfkit.evals.context` builds them):
the original, the converted model, its state switched off (``--no-state-off`` leaves it out)
and the ``--baseline`` operator on the same head map, training-free (``matched``: the recent
window that holds the converted heads' bytes). The report counts, per model and shape, the
needles the training-free baseline (and the original) found that the model missed. The
original's and the baseline's answers are reused from an earlier run on the same prompts and
weights (:mod:`rfkit.evals.references`; ``--no-reuse`` answers them again).

Writes ``needles.json``, ``needles.md`` and ``needles.png`` to ``--output`` (default
``runs/needles_<name of DIR>``) and adds the accuracies to DIR's model card (unless ``--no-record``).
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

from rfkit.config.args import parse_depths, parse_lengths
from rfkit.data.needle_prompts import (  # noqa: F401  (the shapes' names, read by the evaluation and tests)
    ALLOWED,
    COLOURS,
    DEFAULT_SHAPES,
    MULTI_INSTRUCTION,
    MULTI_NEEDLE,
    MULTI_QUESTION,
    PROSE_QUESTION,
    SHAPES,
    PromptError,
    Shape,
    filler_sentences,
    held_out_sentences,
    insert,
    prompts,
    trial,
)
from rfkit.evals import passkey, references
from rfkit.evals.common import EvalError, add_model_arguments, add_reuse_argument, check_model_arguments, positive_int


def first_integer(output: str) -> int | None:
    found = re.search(r"\d+", output)
    return int(found.group()) if found else None


def answer(model, tokenizer, records: list[dict], batch_size: int = 1, desc: str = "needles") -> list[dict]:
    """Each record's greedy answer and score for ``model``: ``[{"output", "answer", "correct",
    "answered_other"}]`` in the records' order (one ``generate`` call per shape: answers differ
    in length)."""
    from tqdm.auto import tqdm

    from rfkit.evals.common import greedy_generate

    results: list[dict | None] = [None] * len(records)
    with tqdm(total=len(records), desc=desc, unit="prompt") as bar:
        for name in dict.fromkeys(r["shape"] for r in records):
            which = [i for i, r in enumerate(records) if r["shape"] == name]
            outputs = greedy_generate(
                model, tokenizer, [records[i]["text"] for i in which], SHAPES[name].new_tokens,
                batch_size=batch_size, progress=bar,
            )  # fmt: skip
            for i, output in zip(which, outputs):
                got = first_integer(output)
                results[i] = {
                    "output": output,
                    "answer": got,
                    "correct": got == records[i]["key"],
                    "answered_other": got in records[i]["keys"][1:],
                }
    return results


# ----------------------------------------------------------------------------- report
def summarise(records: list[dict], answers: dict[str, list[dict]], shapes: list[str], lengths: list[int], baseline: str | None) -> dict:
    """Accuracy per model, shape and length; and per model the needles a reference (the original,
    the training-free baseline) found that the model missed, per shape."""
    rows = {}
    for name, results in answers.items():
        cells = {}
        for shape in shapes:
            cells[shape] = {}
            for n in lengths:
                hits = [a["correct"] for r, a in zip(records, results) if r["shape"] == shape and r["length"] == n]
                cells[shape][n] = sum(hits) / len(hits)
        rows[name] = {
            "accuracy": cells,
            "overall": sum(a["correct"] for a in results) / len(results),
            "answered_other": sum(a["answered_other"] for a in results),
        }
    references = ["original"] + ([baseline] if baseline else [])
    for name, row in rows.items():
        row["missed"] = {}
        for ref in references:
            if ref == name:
                continue
            row["missed"][ref] = {
                shape: sum(
                    answers[ref][i]["correct"] and not answers[name][i]["correct"]
                    for i, r in enumerate(records)
                    if r["shape"] == shape
                )
                for shape in shapes
            }
    return rows


def markdown(result: dict) -> str:
    shapes, lengths = result["shapes"], result["lengths"]
    baseline = result["baseline"]
    per = len(result["depths"]) * result["trials"]
    lines = [
        f"Needle tests: {result['model']} (beta {result['beta']:g}); depths {', '.join(f'{d:g}' for d in result['depths'])}, "
        f"{result['trials']} trial(s) each, so {per} prompts per shape and length. Shapes: "
        + "; ".join(f"{name}: {about}" for name, about in result["about"].items()) + ".",
        "",
        "| model |" + "".join(f" {s} {n:,} |" for s in shapes for n in lengths) + " overall |",
        "|---|" + "---:|" * (len(shapes) * len(lengths) + 1),
    ]  # fmt: skip
    for name, row in result["rows"].items():
        cells = [f"{row['accuracy'][s][n]:.2f}" for s in shapes for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['overall']:.3f} |")
    if baseline:
        lines += [
            "",
            f"Needles {baseline} found that the model missed (of {per * len(lengths)} per shape):",
            "",
            "| model |" + "".join(f" {s} |" for s in shapes) + " total |",
            "|---|" + "---:|" * (len(shapes) + 1),
        ]
        for name, row in result["rows"].items():
            if baseline in row["missed"]:
                missed = row["missed"][baseline]
                lines.append(f"| {name} | " + " | ".join(str(missed[s]) for s in shapes) + f" | {sum(missed.values())} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Accuracy per shape (one panel each) against length, one line per model."""
    from rfkit.plots import pyplot, save_figure

    plt = pyplot()
    shapes, lengths = result["shapes"], result["lengths"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.4 * len(shapes), 3.6), squeeze=False, sharey=True)
    for ax, shape in zip(axes[0], shapes):
        for i, (name, row) in enumerate(result["rows"].items()):
            values = [row["accuracy"][shape][n] for n in lengths]
            ax.plot(lengths, values, marker="os^Dv"[i % 5], ms=9 - 2 * (i % 4), alpha=0.85, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(shape)
        ax.set_xlabel("length (tokens)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- command
def add_arguments(parser) -> None:
    from rfkit.evals.context import DEFAULT_BASELINE

    add_model_arguments(parser, original=False)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"needle shapes, comma separated; allowed: {ALLOWED}")
    parser.add_argument("--lengths", default="2048,4096", help="lengths in tokens (prompt and answer), comma separated")
    parser.add_argument("--depths", default="0,0.5,1", help="depths in [0, 1] of the asked needle, comma separated")
    parser.add_argument("--trials", type=int, default=2, help="prompts per (shape, length, depth)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the keys and filler starts")
    parser.add_argument(
        "--baseline", default=DEFAULT_BASELINE,
        help="training-free operator on the same head map; matched (default): sink_recent at the converted heads' bytes; or none",
    )  # fmt: skip
    parser.add_argument("--no-state-off", action="store_true", help="leave out the converted model with its state off")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")
    add_reuse_argument(parser)
    parser.add_argument("--output", default=None, help="output directory (default runs/needles_<model dir name>)")


def parse_shapes(text: str) -> list[Shape]:
    names = [part.strip() for part in str(text).split(",") if part.strip()]
    if not names:
        raise EvalError(f"--shapes: give at least one of {ALLOWED}")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise EvalError(f"--shapes: unknown shape '{unknown[0]}'; allowed: {ALLOWED}")
    if len(set(names)) < len(names):
        raise EvalError(f"--shapes: a shape is given twice in '{text}'")
    return [SHAPES[n] for n in names]


def validate(args) -> None:
    """Every check that needs no weights (the tokenizer sizes the templates)."""
    from rfkit.evals.context import check_baseline, check_converted_dir, output_dir

    check_converted_dir(args)
    args.shape_list = parse_shapes(args.shapes)
    args.length_list = parse_lengths(args.lengths, "--lengths", example="2048,4096", error=EvalError)
    args.depth_list = parse_depths(args.depths, "--depths", error=EvalError)
    positive_int(args, "trials")
    positive_int(args, "batch_size")
    check_model_arguments(args, args.length_list)
    check_baseline(args)
    tokenizer = passkey.spec_tokenizer(args.model_spec)
    shortest = min(args.length_list)
    for shape in args.shape_list:  # the shortest length must hold every template and its answer
        try:
            trial(shape, tokenizer, shortest - shape.new_tokens, 0.0, args.seed, 0)
        except PromptError:
            raise EvalError(
                f"--lengths: {shortest} tokens cannot hold the {shape.name} template and its {shape.new_tokens}-token "
                f"answer; give longer lengths or leave {shape.name} out of --shapes"
            ) from None
    args.output_dir = output_dir(args, "needles")


def run(args) -> int:
    from rfkit.config.loading import load_model
    from rfkit.evals.context import models_to_measure
    from rfkit.experiments.reports import write_report
    from rfkit.models.mixer import ablate_states

    start = time.time()
    loaded = load_model(args.model_spec, device=args.torch_device)
    head_map = args.model_spec.head_map
    records = prompts(loaded.tokenizer, args.shape_list, args.length_list, args.depth_list, args.trials, args.seed)
    models = models_to_measure(args, loaded, head_map, state_off=not args.no_state_off)
    baseline = next((name for name, _, _, training_free in models if training_free), None)

    def measure_one(name, model, closed) -> list[dict]:
        with ablate_states(model) if closed else contextlib.nullcontext():
            return answer(model, loaded.tokenizer, records, args.batch_size, desc=f"needles ({name})")

    shapes = [s.name for s in args.shape_list]
    settings = {
        "shapes": shapes, "new_tokens": [SHAPES[n].new_tokens for n in shapes], "lengths": args.length_list,
        "depths": args.depth_list, "trials": args.trials, "seed": args.seed, "batch_size": args.batch_size,
    }  # fmt: skip
    inputs = [[r["shape"], r["length"], r["text"], r["key"], r["keys"]] for r in records]
    measured = references.measure_models(models, measure_one, "needles", settings, inputs, head_map.selected, not args.no_reuse)
    answers = {name: result for name, (result, _, _) in measured.items()}
    rows = summarise(records, answers, shapes, args.length_list, baseline)
    for name in rows:
        rows[name]["seconds"], rows[name]["reused"] = measured[name][1], measured[name][2]
    for i, record in enumerate(records):
        record.pop("text")
        record["answers"] = {name: answers[name][i] for name in answers}
    result = {
        "task": "needles",
        "model": args.model,
        "base_model": head_map.model,
        "beta": head_map.beta,
        "shapes": shapes,
        "about": {s.name: s.about for s in args.shape_list},
        "lengths": args.length_list,
        "depths": args.depth_list,
        "trials": args.trials,
        "seed": args.seed,
        "baseline": baseline,
        "device": str(args.torch_device),
        "rows": rows,
        "records": records,
        "wall_seconds": round(time.time() - start, 1),
    }
    write_report(args.output_dir, "needles", result, markdown(result), plot, getattr(args, "command_line", None))
    _record(args, result)
    return 0


def _record(args, result: dict) -> None:
    from rfkit.conversion.evaluations import add_to_model

    if args.no_record:
        return
    rows, formats = {}, {}
    for shape in result["shapes"]:
        for n in result["lengths"]:
            label = f"{shape} needle accuracy, {n:,} tokens"
            rows[label] = {name: row["accuracy"][shape][n] for name, row in result["rows"].items()}
            formats[label] = ".2f"
    settings = f"shapes={','.join(result['shapes'])} depths={result['depths']} trials={result['trials']} seed={result['seed']}"
    title = f"Needle tests ({', '.join(result['shapes'])}; rfkit eval needles)"
    add_to_model(args.model, f"needles {settings}", title, rows, getattr(args, "command_line", None), formats)
