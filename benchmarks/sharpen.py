"""Copy a saved hybrid model with another state sharpness, without training.

    python benchmarks/sharpen.py SRC DST --sharpness 1.25

``SRC`` is a converted model folder whose operator is the hybrid (``rfkit.operators.HybridOperator``);
``DST`` gets the same weights, head map, tokenizer and recipe with ``sharpness`` set in its
operator record, so every rfkit command (``rfkit eval needles``, ``rfkit eval context``, ``rfkit
bench speed``) and transformers without rfkit (the folder's code is written again) read it with
the state's weight ``g e^{-tau m}`` (:mod:`rfkit.models.hybrid`). The sharpness is not a learned
weight: a refit at the new value can adapt the rest of the model to it; this measures what it
does to a model trained at another.

Bad input (a missing folder, another operator, a sharpness below 1, an existing ``DST``) gets one
line naming the field and exit code 2, before the model loads. ``DST`` is written beside itself
and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HYBRID = "rfkit.operators.HybridOperator"


def check(src: Path, dst: Path, sharpness: float) -> dict:
    """The source's operator record with the new sharpness; raises ValueError naming the field."""
    from rfkit.errors import RFKitError
    from rfkit.models.operators import HybridOperator

    config_path = src / "config.json"
    if not config_path.is_file() or not (src / "head_map.json").is_file():
        raise ValueError(f"SRC: '{src}' is not a saved converted model (no config.json and head_map.json)")
    record = json.loads(config_path.read_text()).get("rf_operator") or {}
    if record.get("class_path") != HYBRID:
        raise ValueError(f"SRC: the operator is {record.get('class_path')!r}; only {HYBRID} has a sharpness")
    if dst.exists():
        raise ValueError(f"DST: '{dst}' exists; give a new folder")
    try:
        operator = HybridOperator(**{**record.get("init_args", {}), "sharpness": sharpness})
    except RFKitError as exc:
        raise ValueError(f"--sharpness: {exc}") from None
    return operator.to_dict()


def sharpen(src: Path, dst: Path, sharpness: float) -> Path:
    """Write ``DST`` (see the module docstring); returns it."""
    record = check(src, dst, sharpness)
    from rfkit.config.loading import load_model
    from rfkit.conversion.convert import save_converted
    from rfkit.conversion.headmap import HeadMap
    from rfkit.models.hybrid import HybridWindowAttention

    loaded = load_model(str(src))
    model = loaded.model
    blocks = [m for m in model.modules() if isinstance(m, HybridWindowAttention)]
    for block in blocks:
        block.sharpness = float(sharpness)
    model.config.rf_operator = record
    recipe = src / "config.yaml"
    save_converted(
        model, HeadMap.load(src / "head_map.json"), dst, tokenizer=loaded.tokenizer,
        config_text=recipe.read_text() if recipe.is_file() else None,
    )  # fmt: skip
    print(f"{dst}: {len(blocks)} hybrid blocks at sharpness {sharpness:g} (from {src})")
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a saved hybrid model folder")
    parser.add_argument("dst", type=Path, help="the new folder (must not exist)")
    parser.add_argument("--sharpness", type=float, required=True, help="tau >= 1 in the state's weight g e^{-tau m}")
    args = parser.parse_args(argv)
    try:
        sharpen(args.src, args.dst, args.sharpness)
    except ValueError as exc:
        print(f"sharpen.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
