"""An environment with the lent GPU machine's own versions, for the GPU check's rehearsal in them.

    python benchmarks/gpu/image_env.py --target /tmp/rfkit-gpu-image-env [--python python3.12]
    (or: make gpu-rehearsal-image, which then runs the rehearsal with it)

The CI rehearsal (``make gpu-rehearsal``, benchmarks/gpu/fresh_env.py) links this checkout's own
packages into a fresh environment: it proves the carry and the command lines, but on this
machine's Python and torch. The GPU machine runs Python 3.12 with torch 2.11, NumPy 2.5, Triton
3.6 and the rest below (the device tool's KINDS.md, read there in 2026-11), so an API that only a
newer torch has, or a NumPy 2.5 change, would first show on the GPU, in its few minutes. This
makes a virtual environment with those versions from PyPI (torch's CUDA build: it runs on a CPU,
about 5 GB with its CUDA libraries, a couple of minutes at PyPI's speed here) and nothing of
rfkit's: the rehearsal installs rfkit and the rest from the carry, as on the GPU.

It is built beside ``--target`` and renamed into place, with the pins in ``rfkit-image.json``; a
target whose pins match is kept as it is. Exit 2 with one line when no Python of the image's
minor version is found.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: the GPU image's Python and the versions of what rfkit and the check import there (KINDS.md's
#: pip list, 2026-11); transformers, tokenizers and peft come from the carry, as on the GPU
PYTHON = "3.12"
PINNED = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "numpy": "2.5.2",
    "lightning": "2.6.6",
    "pytorch-lightning": "2.6.6",
    "torchmetrics": "1.9.0",
    "safetensors": "0.8.0",
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "sentencepiece": "0.2.2",
}
#: also in the image, at versions KINDS.md does not give: the check's tools and transformers' imports
UNPINNED = ("pytest", "pytest-xdist", "pytest-timeout", "matplotlib", "pyyaml", "tqdm", "regex", "jinja2", "psutil",
            "requests", "typer", "rich", "packaging", "filelock", "fsspec")  # fmt: skip
STAMP = "rfkit-image.json"


def wanted() -> dict:
    return {"python": PYTHON, "pinned": PINNED, "unpinned": list(UNPINNED)}


def find_python(given: str | None) -> str | None:
    """``given``, else ``python3.12`` on the PATH, else one that pyenv installed; None when none of
    them runs as Python 3.12 (a pyenv shim of a version not selected does not)."""
    pyenv = sorted(Path.home().glob(f".pyenv/versions/{PYTHON}.*/bin/python{PYTHON}"), reverse=True)
    for candidate in [given] if given else [f"python{PYTHON}", *map(str, pyenv)]:
        exe = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if exe is None:
            continue
        out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip() == PYTHON:
            return exe
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the environment's folder")
    parser.add_argument("--python", default=None, help=f"a Python {PYTHON} interpreter (default: python{PYTHON} on the PATH)")
    args = parser.parse_args(argv)
    target = Path(args.target)
    stamp = target / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted() and (target / "bin" / "python").exists():
        print(f"image env: {target} has the GPU image's versions already")
        return 0
    python = find_python(args.python)
    if python is None:
        print(f"image env: --python: no Python {PYTHON} found (the GPU image's); give one with --python", file=sys.stderr)
        return 2
    started = time.time()
    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(building)], check=True)
    pip = [str(building / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", "-q", *(f"{name}=={version}" for name, version in PINNED.items()), *UNPINNED], check=True)
    (building / STAMP).write_text(json.dumps(wanted(), indent=1) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    building.rename(target)  # venv scripts name their folder: run them as target/bin/python, not by shebang
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"image env: {target}: Python {PYTHON}, " + ", ".join(f"{k} {v}" for k, v in PINNED.items())
          + f" ({size / 2**30:.1f} GiB, {time.time() - started:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
