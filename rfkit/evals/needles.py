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
needles the training-free baseline (and the original) found that the model missed.

Writes ``needles.json``, ``needles.md`` and ``needles.png`` to ``--output`` (default
``runs/needles_<name of DIR>``) and adds the accuracies to DIR's model card (unless ``--no-record``).
"""

from __future__ import annotations

import functools
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

from rfkit.config.args import parse_depths, parse_lengths
from rfkit.evals import passkey
from rfkit.evals.common import EvalError, add_model_arguments, check_model_arguments, positive_int


@dataclass(frozen=True)
class Shape:
    """One kind of needle test: its filler, its key and how many needles it hides."""

    name: str
    about: str
    filler: str | None = None  # None: the passkey filler repeated; else the source whose held-out sentences fill
    digits: int = 5
    needles: int = 1
    new_tokens: int = passkey.NEW_TOKENS
    question: str | None = None  # one-needle shapes: None asks the passkey test's question (multi asks MULTI_QUESTION)


# After encyclopaedic text SmolLM2 continues "The pass key is" with a definition ("a device
# used to ...", the original 0 of 6 at 2,048 tokens, with the key the sentence before); asked
# for "the number" it quotes the key (6 of 6 on the same prompts).
PROSE_QUESTION = "What is the pass key? The pass key is the number"


SHAPES = {
    shape.name: shape
    for shape in (
        Shape("passkey", "the passkey test: one 5-digit key in the repeated filler"),
        Shape(
            "prose", "one 5-digit key in held-out Wikipedia summaries, asked for as a number",
            filler="embedded:wikipedia-en", question=PROSE_QUESTION,
        ),
        Shape("plays", "one 5-digit key in held-out Shakespeare", filler="embedded:shakespeare"),
        Shape("long", "one 20-digit key in the repeated filler", digits=20, new_tokens=24),
        Shape("multi", "three 5-digit keys for three doors; the question asks for one", needles=3),
    )
}
DEFAULT_SHAPES = ",".join(SHAPES)
ALLOWED = ", ".join(SHAPES)
COLOURS = ("red", "green", "blue")
MULTI_INSTRUCTION = (
    "Several pass keys are hidden in the long passage below, one for each door. "
    "Find them and keep them in mind: you will be asked for one of them at the end."
)
MULTI_NEEDLE = "The pass key of the {colour} door is {key}. Remember it. {key} is the pass key of the {colour} door."
MULTI_QUESTION = "What is the pass key of the {colour} door? The pass key of the {colour} door is"


# ----------------------------------------------------------------------------- prompts
@functools.lru_cache(maxsize=4)
def filler_sentences(source: str, split: str = "validation") -> tuple[str, ...]:
    """The sentences of ``source``'s ``split`` documents (rfkit's own split: ``validation`` is
    never trained on; ``train`` serves calibration, :mod:`rfkit.conversion.state_audit`),
    whitespace made single, without digits, of 4 to 60 words."""
    from rfkit.data.documents import split_documents
    from rfkit.data.embedded import default_split
    from rfkit.data.sources import load_documents

    docs = split_documents(load_documents(source), default_split(source))[split]
    sentences = []
    for doc in docs:
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.text.split())):
            if 4 <= len(sentence.split()) <= 60 and not re.search(r"\d", sentence):
                sentences.append(sentence)
    if len(sentences) < 50:
        raise EvalError(f"--shapes: '{source}' holds {len(sentences)} usable {split} sentences; the filler needs at least 50")
    return tuple(sentences)


def held_out_sentences(source: str) -> tuple[str, ...]:
    """:func:`filler_sentences` of the validation split: the evaluations' filler."""
    return filler_sentences(source, "validation")


def insert(instruction: str, filler: list[str], needles: list[tuple[float, str]], question: str) -> str:
    """``instruction``, the filler with each ``(depth, needle)`` after ``round(depth * len(filler))``
    of its sentences (in the order given where two fall together), then the question on its own
    line: :func:`rfkit.evals.passkey.compose`'s layout for any number of needles."""
    n = len(filler)
    at = sorted((round(depth * n), i) for i, (depth, _) in enumerate(needles))
    parts, done = [instruction], 0
    for where, i in at:
        parts += filler[done:where]
        parts.append(needles[i][1])
        done = where
    parts += filler[done:]
    return " ".join(parts) + "\n" + question


def trial(shape: Shape, tokenizer, length: int, depth: float, seed: int, index: int, split: str = "validation") -> dict:
    """One prompt of at most ``length`` tokens: ``{"text", "prompt_tokens", "key", "keys"}``
    (``keys``: every needle's key, the asked one first). Fixed by (shape, seed, length, depth,
    index) alone, so every model sees the same prompt. A running-text filler reads ``split``'s
    sentences (``train``: calibration prompts, never the evaluation's)."""
    if shape.name == "passkey":  # the passkey test's own key and prompt
        key = passkey.trial_key(seed, length, depth, index)
        text, tokens = passkey.build_prompt(tokenizer, length, depth, key)
        return {"text": text, "prompt_tokens": tokens, "key": key, "keys": [key]}
    # another split draws other keys too (the evaluation's own prompts are unchanged)
    tag = "" if split == "validation" else f":{split}"
    rng = random.Random(f"needles:{shape.name}:{seed}:{length}:{depth!r}:{index}{tag}")
    keys: list[int] = []
    while len(keys) < shape.needles:  # distinct keys of exactly shape.digits digits
        key = rng.randint(10 ** (shape.digits - 1), 10**shape.digits - 1)
        if key not in keys:
            keys.append(key)
    if shape.filler is None:
        sentences, start = passkey.FILLER_SENTENCES, 0
    else:
        sentences = filler_sentences(shape.filler, split)
        start = rng.randrange(len(sentences))
    if shape.needles == 1:
        instruction, question = passkey.INSTRUCTION, shape.question or passkey.QUESTION
        needles = [(depth, passkey.NEEDLE.format(key=keys[0]))]
    else:
        first = rng.randrange(len(COLOURS))
        colours = [COLOURS[(first + i) % len(COLOURS)] for i in range(shape.needles)]
        instruction, question = MULTI_INSTRUCTION, MULTI_QUESTION.format(colour=colours[0])
        needles = [
            ((depth + i / shape.needles) % 1.0 if i else depth, MULTI_NEEDLE.format(colour=colours[i], key=keys[i]))
            for i in range(shape.needles)
        ]

    def make(n: int) -> str:
        return insert(instruction, [sentences[(start + i) % len(sentences)] for i in range(n)], needles, question)

    text, tokens = passkey.longest_prompt(tokenizer, length, make, f"the {shape.name} template")
    return {"text": text, "prompt_tokens": tokens, "key": keys[0], "keys": keys}


def first_integer(output: str) -> int | None:
    found = re.search(r"\d+", output)
    return int(found.group()) if found else None


def prompts(tokenizer, shapes: list[Shape], lengths: list[int], depths: list[float], trials: int, seed: int, split: str = "validation") -> list[dict]:
    """Every prompt of the run, each a record (``shape``, ``length``, ``depth``, ``trial``, keys,
    text); the prompt of ``length`` is at most ``length - shape.new_tokens`` tokens. Running-text
    fillers read ``split``'s sentences."""
    records = []
    for shape in shapes:
        for length in lengths:
            for depth in depths:
                for index in range(trials):
                    made = trial(shape, tokenizer, length - shape.new_tokens, depth, seed, index, split)
                    records.append({"shape": shape.name, "length": length, "depth": depth, "trial": index, **made})
    return records


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
        except EvalError:
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
    answers, seconds, baseline = {}, {}, None
    for name, model, closed, training_free in models_to_measure(args, loaded, head_map, state_off=not args.no_state_off):
        t0 = time.time()
        if closed:
            with ablate_states(model):
                answers[name] = answer(model, loaded.tokenizer, records, args.batch_size, desc=f"needles ({name})")
        else:
            answers[name] = answer(model, loaded.tokenizer, records, args.batch_size, desc=f"needles ({name})")
        seconds[name] = round(time.time() - t0, 1)
        baseline = name if training_free else baseline
    shapes = [s.name for s in args.shape_list]
    rows = summarise(records, answers, shapes, args.length_list, baseline)
    for name in rows:
        rows[name]["seconds"] = seconds[name]
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
