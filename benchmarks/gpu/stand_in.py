"""The embedded model's stand-in on a machine without its weights: seeded random weights of the
exact shape, with the real config and tokenizer, where rfkit resolves ``embedded:smollm2-135m-instruct``.

    python benchmarks/gpu/stand_in.py --carry .gpu-carry [--seed 0]

The GPU check runs it once after the bootstrap (``RFKIT_CACHE`` set to the check's own folder, so
nothing of a user's cache is touched). The real weights are a 98 MB GGUF, over one command's files;
memory, speed and every code path depend on the shape alone, which the carried config fixes. Quality
numbers need the real weights and are never taken from a stand-in: the folder says what it is in
``stand_in.json``, and the check records it beside every result. A folder that already holds the
real (dequantised) weights is left alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from rfkit.atomic import atomic_directory
from rfkit.hub import EMBEDDED_MODEL, embedded_model_dir, resolve_model

NOTE = "stand_in.json"


def make_stand_in(carry: Path, seed: int = 0) -> Path:
    """Write the stand-in into rfkit's cache unless a model is there already; returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    files = carry / "embedded" / EMBEDDED_MODEL.split(":", 1)[1]
    target = embedded_model_dir()
    if (target / "config.json").exists():
        return target
    config = AutoConfig.from_pretrained(str(files))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # the dequantised GGUF is float32
    model.config._name_or_path = EMBEDDED_MODEL
    with atomic_directory(target, replace=False) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for path in files.iterdir():
            if path.name != "config.json":
                shutil.copy2(path, Path(tmp) / path.name)
        note = {"weights": f"random, torch.manual_seed({seed}), transformers' own initialisation",
                "config_and_tokenizer": "the embedded model's own, from the carry",
                "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
        (Path(tmp) / NOTE).write_text(json.dumps(note, indent=1) + "\n")
    return target


def describe(folder: Path) -> dict:
    """What the resolved embedded model is: the stand-in's note, or the real weights."""
    note = folder / NOTE
    return json.loads(note.read_text()) if note.exists() else {"weights": "the real embedded weights"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stand_in.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--carry", required=True, help="the carry folder (benchmarks/gpu/carry.py)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = make_stand_in(Path(args.carry), args.seed)
    resolved = Path(resolve_model(EMBEDDED_MODEL))
    if resolved != folder:
        sys.exit(f"stand_in: {EMBEDDED_MODEL} resolves to {resolved}, not {folder}")
    print(json.dumps({"embedded_model": str(resolved), **describe(resolved)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
