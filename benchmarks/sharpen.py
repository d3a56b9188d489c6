"""Copy a saved hybrid model with another state sharpness, or with some layers' states closed, without training.

    python benchmarks/sharpen.py SRC DST --sharpness 1.25
    python benchmarks/sharpen.py SRC DST --close-states 5,14
    python benchmarks/sharpen.py SRC DST --close-states 3,5,20,21 --close-heads '{"5": [0, 3, 5]}'

``SRC`` is a converted model folder whose operator is the hybrid (``rfkit.operators.HybridOperator``);
``DST`` gets the same weights, head map, tokenizer and recipe with ``sharpness`` set in its
operator record, so every rfkit command (``rfkit eval needles``, ``rfkit eval context``, ``rfkit
bench speed``) and transformers without rfkit (the folder's code is written again) read it with
the state's weight ``g e^{-tau m}`` (:mod:`rfkit.models.hybrid`). The sharpness is not a learned
weight: a refit at the new value can adapt the rest of the model to it; this measures what it
does to a model trained at another. ``--close-states`` sets the gates of the listed decoder
layers' hybrid blocks to 0 (their window alone, as ``rfkit eval context``'s "state off" row does
for every layer at once): what one layer's state does to a model, measured by every command.
``--close-heads`` (JSON, layer -> head numbers, each layer also in ``--close-states``) closes only
those heads there, numbered as a state audit's report numbers them: with ``closed`` and
``closed_heads`` of an audit, the copy closes what ``rfkit fit --state_audit.close_layers ...
--state_audit.close_heads ...`` closes when training ends.

Bad input (a missing folder, another operator, a sharpness below 1, an existing ``DST``, a
``--close-states`` layer that replaces no head, neither option) gets one line naming the field and
exit code 2, before the model loads. ``DST`` is written beside itself
and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def check(src: Path, dst: Path, sharpness: float | None, close: tuple[int, ...] = (), heads: dict | None = None) -> dict:
    """The source's operator record with the new sharpness (None: the source's); raises
    ValueError naming the field (a layer in ``close`` that replaces no head too)."""
    from rfkit.errors import RFKitError
    from rfkit.models.operators import HybridOperator

    config_path = src / "config.json"
    if not config_path.is_file() or not (src / "head_map.json").is_file():
        raise ValueError(f"SRC: '{src}' is not a saved converted model (no config.json and head_map.json)")
    from rfkit.training.state_audit import HYBRID, is_hybrid

    record = json.loads(config_path.read_text()).get("rf_operator") or {}
    if not is_hybrid(record.get("class_path")):
        raise ValueError(f"SRC: the operator is {record.get('class_path')!r}; only {HYBRID} has a sharpness")
    if dst.exists():
        raise ValueError(f"DST: '{dst}' exists; give a new folder")
    selected = json.loads((src / "head_map.json").read_text()).get("selected") or []
    stateful = [i for i, heads in enumerate(selected) if heads]
    missing = sorted(set(close) - set(stateful))
    if missing:
        raise ValueError(f"--close-states: layer {missing[0]} replaces no head, so it has no state; allowed: {', '.join(map(str, stateful))}")
    from rfkit.callbacks.state_audit import fixed_closing

    try:
        fixed_closing(list(close), heads, ("--close-states", "--close-heads"))
    except RFKitError as exc:
        raise ValueError(str(exc)) from None
    for layer, picked in (heads or {}).items():  # a layer's heads with a state: the ones it replaces
        if max(picked) >= len(selected[layer]):
            raise ValueError(f"--close-heads: layer {layer} has {len(selected[layer])} heads with a state (0 to {len(selected[layer]) - 1}); got heads {picked}")
    if sharpness is None:
        return record
    try:
        operator = HybridOperator(**{**record.get("init_args", {}), "sharpness": sharpness})
    except RFKitError as exc:
        raise ValueError(f"--sharpness: {exc}") from None
    return operator.to_dict()


def sharpen(src: Path, dst: Path, sharpness: float | None, close: tuple[int, ...] = (), prepare=None, heads: dict | None = None) -> Path:
    """Write ``DST`` (see the module docstring); returns it. ``prepare(model)``, when given, runs on
    the loaded model before anything else changes it."""
    record = check(src, dst, sharpness, close, heads)

    from rfkit.config.loading import load_model
    from rfkit.conversion.convert import save_converted
    from rfkit.conversion.headmap import HeadMap
    from rfkit.models.hybrid import HybridWindowAttention
    from rfkit.training.state_audit import close_states, read_sharper

    loaded = load_model(str(src))
    model = loaded.model
    if prepare is not None:
        prepare(model)
    if sharpness is not None:
        read_sharper(model, sharpness)  # the blocks and the operator record (``record``)
    blocks = [m for m in model.modules() if isinstance(m, HybridWindowAttention)]
    close_states(model, close, heads, "--close-heads")
    recipe = src / "config.yaml"
    save_converted(
        model, HeadMap.load(src / "head_map.json"), dst, tokenizer=loaded.tokenizer,
        config_text=recipe.read_text() if recipe.is_file() else None,
    )  # fmt: skip
    tau = record.get("init_args", {}).get("sharpness", 1.0)
    from rfkit.conversion.model_card import describe_closed

    closed = f", states closed in layers {describe_closed({'closed': list(close), 'closed_heads': {str(k): v for k, v in (heads or {}).items()}})}" if close else ""
    print(f"{dst}: {len(blocks)} hybrid blocks at sharpness {tau:g}{closed} (from {src})")
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a saved hybrid model folder")
    parser.add_argument("dst", type=Path, help="the new folder (must not exist)")
    parser.add_argument("--sharpness", type=float, default=None, help="tau >= 1 in the state's weight g e^{-tau m} (default: the source's)")
    parser.add_argument("--close-states", default="", help="decoder layers, comma separated, whose hybrid blocks' gates are set to 0")
    parser.add_argument("--close-heads", default="", help='JSON, layer -> heads closed there instead of all (e.g. \'{"5": [0, 3]}\')')
    args = parser.parse_args(argv)
    try:
        try:
            close = tuple(int(x) for x in args.close_states.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--close-states: give layer numbers, comma separated, got {args.close_states!r}") from None
        try:
            heads = {int(k): v for k, v in json.loads(args.close_heads).items()} if args.close_heads.strip() else None
        except (ValueError, AttributeError):
            raise ValueError(f"--close-heads: give JSON, layer -> head numbers (e.g. '{{\"5\": [0, 3]}}'), got {args.close_heads!r}") from None
        if args.sharpness is None and not close:
            raise ValueError("--sharpness or --close-states: give at least one (the copy would be the source)")
        sharpen(args.src, args.dst, args.sharpness, close, heads=heads)
    except ValueError as exc:
        print(f"sharpen.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
