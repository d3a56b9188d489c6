"""A fresh Python environment shaped like the lent GPU machine's, for the GPU check's rehearsal.

    python benchmarks/gpu/fresh_env.py --source .venv --target /tmp/rfkit-gpu-env

The GPU machine's image holds torch, lightning, peft and a few hundred other packages, but not
rfkit, jsonargparse, gguf, the embedded model and data, nor the transformers version CI uses
(``GPU_IMAGE`` below is its package list as the device tool's KINDS.md gave it on 2026-11-17).
This makes a new virtual environment (no pip of its own, no rfkit) and links into its
site-packages only the distributions of ``--source`` that the GPU image also has, except the
ones the carry replaces. Whatever rfkit needs beyond that must then come from the carry, exactly
as on the GPU: a missing wheel fails the rehearsal here instead of the check there. Linking takes
a second; nothing is copied or downloaded.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

#: the GPU image's Python packages (device tool, KINDS.md, read on a machine on 2026-11-17)
GPU_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())
#: the image has these, but at other versions than CI's: the carry brings CI's
REPLACED_BY_CARRY = {"transformers", "tokenizers", "peft"}
#: what the image lacks and the carry brings (benchmarks/gpu/carry.py), never linked
CARRIED = {"rfkit", "jsonargparse", "docstring-parser", "typeshed-client", "gguf"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip())


def top_levels(dist: metadata.Distribution, site: Path) -> set[str]:
    """The names a distribution puts directly into ``site`` (packages, modules, its dist-info)."""
    names = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if parts and parts[0] != ".." and (site / parts[0]).exists():
            names.add(parts[0])
    return names


def requirement_names(dist: metadata.Distribution) -> set[str]:
    """The distributions ``dist`` needs (extras left out)."""
    names = set()
    for req in dist.requires or []:
        if "extra ==" not in req.replace('"', " ").replace("'", " "):
            names.add(normalise(re.split(r"[\s;<>=!~\[(]", req.strip(), maxsplit=1)[0]))
    return names


def wanted(dists: dict[str, metadata.Distribution]) -> set[str]:
    """The GPU image's distributions found here, and what those need at the versions installed
    here (huggingface-hub's own HTTP client, say), less the ones the carry brings."""
    chosen = {n for n in dists if n in GPU_IMAGE and n not in REPLACED_BY_CARRY}
    todo = list(chosen)
    while todo:
        for need in requirement_names(dists[todo.pop()]):
            if need in dists and need not in chosen and need not in REPLACED_BY_CARRY and need not in CARRIED:
                chosen.add(need)
                todo.append(need)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fresh_env.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=".venv", help="the environment to link packages from")
    parser.add_argument("--target", required=True, help="the new environment (replaced whole)")
    args = parser.parse_args(argv)
    source_python = Path(args.source) / "bin" / "python"
    target = Path(args.target)
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([str(source_python), "-m", "venv", "--without-pip", str(target)], check=True)
    source_site, target_site = site_packages(source_python), site_packages(target / "bin" / "python")
    dists = {normalise(d.metadata["Name"]): d for d in metadata.distributions(path=[str(source_site)])}
    chosen = wanted(dists)
    linked, left = [], []
    for name, dist in sorted(dists.items()):
        if name in chosen:
            for top in top_levels(dist, source_site):
                link = target_site / top
                if not link.exists():
                    os.symlink(source_site / top, link)
            linked.append(name)
        else:
            left.append(name)
    print(f"fresh_env: {target}: {len(linked)} distributions linked as on the GPU image; left out: {', '.join(sorted(left))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
