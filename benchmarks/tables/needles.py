"""Needles of other shapes (issue 49: training never loses what streaming keeps): ``rfkit eval
needles`` on each beta's recipe model, beside its original, its state off and the training-free
model on the same heads and bytes. Used by docs/comparing.md."""

from __future__ import annotations

from . import load, table
from .trained import short

# beta label -> the needles result of that beta's recipe model, each fitted and asked on one machine
# (fit summaries in needles_float32_amd/)
RUNS = {
    "0.5": "needles_smollm2_b05/needles.json",
    "0.75": "needles_smollm2_b075/needles.json",
    "0.9": "needles_smollm2_b09/needles.json",
}


def _accuracy(row: dict, shapes: list[str], lengths: list[int]) -> list[str]:
    return [" / ".join(f"{row['accuracy'][s][str(n)]:.2f}" for n in lengths) for s in shapes]


def _original_answers(result: dict) -> list[tuple]:
    """Every prompt's key and the original's answer to it, in the records' order."""
    return [(r["key"], r["answers"]["original"]["output"]) for r in result["records"]]


def _missed(row: dict, reference: str, shapes: list[str]) -> str:
    missed = row["missed"].get(reference)
    return "-" if missed is None else str(sum(missed[s] for s in shapes))


@table("needles_by_beta")
def needles_by_beta() -> str:
    """One row per model and beta: accuracy per shape at each length, then how many needles the
    training-free model (and the original) found that this model missed. The original is shown
    once: every file must hold the same original answers (the same prompts, the same model)."""
    results = {beta: load(path) for beta, path in RUNS.items()}
    first_beta, first = next(iter(results.items()))
    shapes, lengths = first["shapes"], first["lengths"]
    for beta, r in results.items():
        if (r["shapes"], r["lengths"], r["depths"], r["trials"], r["seed"]) != (shapes, lengths, first["depths"], first["trials"], first["seed"]):
            raise ValueError(f"{RUNS[beta]}: its prompts differ from {RUNS[first_beta]}'s; the rows would not compare")
        if _original_answers(r) != _original_answers(first):
            raise ValueError(f"{RUNS[beta]}: its original answered differently from {RUNS[first_beta]}'s")
    machine = first.get("provenance", {}).get("machine", "machine not recorded")
    per = len(first["depths"]) * first["trials"] * len(lengths) * len(shapes)
    cols = " | ".join(f"{s} {' / '.join(f'{n:,}' for n in lengths)}" for s in shapes)
    lines = [
        f"| beta | model (asked on {machine}) | {cols} | missed where training-free found (of {per}) | missed where the original found |",
        "|---|---|" + "---:|" * (len(shapes) + 2),
    ]
    lines.append(f"| 0 | the original | {' | '.join(_accuracy(first['rows']['original'], shapes, lengths))} | - | - |")
    for beta, r in results.items():
        baseline = r["baseline"]
        for name, row in r["rows"].items():
            if name == "original":
                continue
            label = {"converted": "trained hybrid (the recipe)", "converted, state off": "trained hybrid, state off"}.get(name)
            if label is None:  # the training-free model
                label = f"training-free {short(name.removesuffix(', training-free'))}, the same heads and bytes"
            cells = _accuracy(row, shapes, lengths)
            lines.append(f"| {beta} | {label} | {' | '.join(cells)} | {_missed(row, baseline, shapes)} | {_missed(row, 'original', shapes)} |")
    return "\n".join(lines)


# (beta, label, needles result, long-document result): each trained model at the softmax's scale
# and the same weights read at a higher sharpness (benchmarks/sharpen.py), asked the same prompts
SHARPNESS_RUNS = [
    ("0.75", "trained hybrid (the recipe), sharpness 1", "needles_smollm2_b075/needles.json", "needles_recall_b075/context_recipe/context.json"),
    ("0.75", "the same weights at sharpness 1.25", "sharpness_b075/needles_sharp_1.25/needles.json", "sharpness_b075/context_sharp_1.25/context.json"),
    ("0.75", "trained at sharpness 1.25 (the same heads and steps)", "sharpness_b075/needles_sharp_1.25_trained/needles.json", "sharpness_b075/context_sharp_1.25_trained/context.json"),
    ("0.9", "trained hybrid (the recipe), sharpness 1", "needles_smollm2_b09/needles.json", "sharpness_b09/context_recipe/context.json"),
    ("0.9", "the same weights at sharpness 1.5", "sharpness_b09/needles_sharp_1.5/needles.json", "sharpness_b09/context_sharp_1.5/context.json"),
]


@table("needles_sharpness")
def needles_sharpness() -> str:
    """Per trained model and sharpness: long-document perplexity against the original, accuracy per
    needle shape and what it missed that the training-free model (and the original) found. Each
    beta's training-free row follows its models: the one asked beside the last of them."""
    by_beta: dict[str, list[str]] = {}
    baselines: dict[str, tuple[str, dict]] = {}
    first = None
    for beta, label, needles_path, context_path in SHARPNESS_RUNS:
        result, context = load(needles_path), load(context_path)
        first = first or result
        if _original_answers(result) != _original_answers(first) or result["shapes"] != first["shapes"]:
            raise ValueError(f"{needles_path}: its prompts or its original's answers differ from the first file's")
        shapes, lengths = result["shapes"], result["lengths"]
        ratio = " / ".join(f"{context['rows']['converted']['ppl_ratio'][str(n)]:.3f}" for n in context["lengths"])
        row = result["rows"]["converted"]
        by_beta.setdefault(beta, []).append(
            f"| {beta} | {label} | {ratio} | {' | '.join(_accuracy(row, shapes, lengths))} | "
            f"{_missed(row, result['baseline'], shapes)} | {_missed(row, 'original', shapes)} |"
        )
        baselines[beta] = (result["baseline"], result["rows"][result["baseline"]])
    lines = []
    for beta, rows in by_beta.items():
        name, row = baselines[beta]
        label = f"training-free {short(name.removesuffix(', training-free'))}, the same heads and bytes"
        lines += rows + [f"| {beta} | {label} | - | {' | '.join(_accuracy(row, shapes, lengths))} | - | {_missed(row, 'original', shapes)} |"]
    lengths_text = " / ".join(f"{n:,}" for n in load(SHARPNESS_RUNS[0][3])["lengths"])
    cols = " | ".join(f"{s} {' / '.join(f'{n:,}' for n in lengths)}" for s in shapes)
    per = len(first["depths"]) * first["trials"] * len(lengths) * len(shapes)
    head = [
        f"| beta | model | long documents {lengths_text} (perplexity / original's) | {cols} | missed where training-free found (of {per}) | missed where the original found |",
        "|---|---|---:|" + "---:|" * (len(shapes) + 2),
    ]
    return "\n".join(head + lines)
