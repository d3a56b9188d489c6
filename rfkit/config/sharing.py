"""``rfkit export --model DIR --output DIR``: a saved converted model, made self-contained.

Models saved before rfkit wrote the code of its model classes beside the weights load only where
rfkit is installed. ``rfkit export`` copies such a folder (every file it holds) into ``--output``
and adds what ``rfkit fit`` and ``rfkit convert`` now write themselves (:mod:`rfkit.models.export`):
the generated ``modeling_rfkit.py`` and the modules it imports, ``auto_map`` in ``config.json``, and a
model card whose metadata and "How to load" section say how to load it without rfkit (the rest of
the card, its measured results included, is kept). The output is written whole, then renamed
into place. Bad input is one line (exit 2) before anything is copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rfkit.config.args import OneLineParser
from rfkit.errors import RFKitError


class ExportCommandError(RFKitError):
    """Bad ``rfkit export`` input; one line for the user."""


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="rfkit export",
        description="Copy a saved converted model into a folder that transformers loads without rfkit.",
        error_class=ExportCommandError,
    )
    parser.add_argument("--model", required=True, help="a model directory written by rfkit fit / rfkit convert")
    parser.add_argument("--output", required=True, help="the self-contained copy (a new directory)")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")
    return parser


def check(args) -> None:
    """Every check that copies nothing."""
    from rfkit.atomic import check_writable
    from rfkit.config.loading import ModelSpecError, check_model_spec
    from rfkit.models.export import exportable

    try:
        if check_model_spec(args.model) != "directory":
            raise ExportCommandError(f"--model: '{args.model}' is a recipe; give the directory of a saved converted model")
    except ModelSpecError as err:
        raise ExportCommandError(str(err)) from None
    source, target = Path(args.model).resolve(), Path(args.output).expanduser().resolve()
    if target == source or source in target.parents:
        raise ExportCommandError(f"--output: '{args.output}' is the model directory or inside it; give a new directory")
    if target.exists() and not args.force:
        raise ExportCommandError(f"--output: '{args.output}' already exists; add --force to replace it")
    check_writable(str(target), "--output", "directory")
    reason = exportable(json.loads((source / "config.json").read_text()))
    if reason:
        raise ExportCommandError(f"--model: '{args.model}' cannot carry its own code: {reason}")


def export(model_dir: str | Path, output: str | Path) -> list[str]:
    """Copy ``model_dir`` to ``output`` with its code, ``auto_map`` and a refreshed card; returns
    the code files written."""
    from rfkit.atomic import atomic_directory, atomic_write_text
    from rfkit.conversion.headmap import HeadMap
    from rfkit.conversion.model_card import model_card, refresh_card
    from rfkit.models.export import generated_files, write_remote_code

    source = Path(model_dir)
    files = generated_files()  # an earlier export's copies of these are written anew
    head_map = HeadMap.load(source / "head_map.json")
    with atomic_directory(output) as tmp:
        for path in sorted(source.iterdir()):
            if path.name in files:
                continue
            if path.is_dir():
                shutil.copytree(path, tmp / path.name)
            else:
                shutil.copy2(path, tmp / path.name)
        written = write_remote_code(tmp, files)
        config = json.loads((tmp / "config.json").read_text())
        card = tmp / "README.md"
        if card.is_file():
            text = refresh_card(card.read_text(), head_map)
        else:
            recipe = tmp / "config.yaml"
            text = model_card(
                head_map, recipe.read_text() if recipe.is_file() else None, None, config.get("rf_operator"), self_contained=True
            )
        atomic_write_text(card, text)
    return written


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check(args)
    written = export(args.model, args.output)
    print(f"{args.output}: self-contained ({len(written)} code files beside the weights)")
    print(f"  load it without rfkit: AutoModelForCausalLM.from_pretrained({str(args.output)!r}, trust_remote_code=True)")
    return 0
