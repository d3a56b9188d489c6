"""What the evaluation commands share: errors, argument parsing, greedy generation, output."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from rfkit.config.args import OneLineParser
from rfkit.config.loading import (
    ModelSpec,
    ModelSpecError,
    check_lengths_fit,
    check_output_file,
    torch_device,
)
from rfkit.validate import positive_int as _positive_int

log = logging.getLogger(__name__)


class EvalError(ModelSpecError):
    """Bad evaluation input; the message is one line for the user."""


class EvalParser(OneLineParser):
    error_class = EvalError


def add_model_arguments(parser: argparse.ArgumentParser, original: bool = True) -> None:
    """``--model DIR|RECIPE [--original] --device --json``: the arguments every model eval takes."""
    parser.add_argument("--model", required=True, help="converted model directory, HF model directory, or recipe YAML")
    if original:
        parser.add_argument(
            "--original", action="store_true", help="evaluate the unconverted base model instead of the converted one"
        )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results as JSON to this file")
    parser.add_argument(
        "--no-record", action="store_true",
        help="do not add the results to a converted model directory's card (README.md, evaluations.json)",
    )  # fmt: skip


def add_reuse_argument(parser: argparse.ArgumentParser) -> None:
    """``--no-reuse``: the reference models measured again (:mod:`rfkit.evals.references`)."""
    parser.add_argument(
        "--no-reuse", action="store_true",
        help="measure the original and the training-free model again instead of reusing their results "
        "from an earlier run on the same prompts and weights ($RFKIT_CACHE/eval_references)",
    )  # fmt: skip


def check_model_arguments(args, lengths: list[int] | None = None, extra_tokens: int = 0, flag: str = "--lengths"):
    """The model checks that need no weights: spec, device, output file and (when given) that
    every length fits the model's context. Sets ``args.torch_device`` and ``args.model_spec``,
    the command's one :class:`~rfkit.config.loading.ModelSpec` (its checks, recipe, resolution
    and tokenizer serve validation and the run alike)."""
    from rfkit.config.catalog import resolve_model_spec

    args.torch_device = torch_device(args.device)
    check_output_file(args.json_out)
    args.model = resolve_model_spec(args.model)  # a catalogue name (smollm2_b05) is its recipe
    args.model_spec = ModelSpec(args.model)
    if lengths:
        check_lengths_fit(lengths, args.model_spec.config(), flag, extra=extra_tokens)


def model_spec(args) -> ModelSpec:
    """The command's :class:`~rfkit.config.loading.ModelSpec` (made from ``args.model`` when
    :func:`check_model_arguments` has not run)."""
    if getattr(args, "model_spec", None) is None or args.model_spec.spec != args.model:
        args.model_spec = ModelSpec(args.model)
    return args.model_spec


def positive_int(args, name: str, minimum: int = 1) -> int:
    """``args.<name>`` must be an integer >= minimum; the flag is named in the error."""
    return _positive_int("--" + name.replace("_", "-"), getattr(args, name), minimum, error=EvalError)


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 1, progress=None):
    """Greedy completions (text after the prompt) through ``model.generate`` and its cache.

    Prompts are left-padded into batches of ``batch_size``; the converted model masks the
    padding out of both the kept attention heads and the Mamba state.
    """
    device = next(model.parameters()).device
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outputs: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True).to(device)
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            outputs.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
            if progress is not None:
                progress.update(len(chunk))
    finally:
        tokenizer.padding_side = old_side
    return outputs


def write_json(path: str | Path | None, obj, command: str | None = None) -> None:
    """Write results atomically (nothing half-written), when a path was given, with their
    provenance (:mod:`rfkit.provenance`; ``command`` as the user typed it)."""
    from rfkit.atomic import atomic_write_json

    from rfkit.provenance import stamp

    if path is not None:
        if isinstance(obj, dict):
            stamp(obj, command=command, wall_seconds=obj.get("wall_seconds"))
        atomic_write_json(path, obj)
        log.info("results -> %s", path)


def add_to_card(args, key: str, title: str, values: dict, formats: dict | None = None) -> None:
    """This run's ``{measure: value}`` added to the card of the converted model directory it
    measured (:mod:`rfkit.conversion.evaluations`), in the column "original" with
    ``--original``, else "converted"; nothing for a recipe or with ``--no-record``."""
    from rfkit.conversion.evaluations import add_to_model

    if getattr(args, "no_record", False):
        return
    side = "original" if getattr(args, "original", False) else "converted"
    rows = {measure: {side: value} for measure, value in values.items()}
    add_to_model(args.model, key, title, rows, getattr(args, "command_line", None), formats)
