"""The wheel: callbacks/ and recipes/ ship inside it as rfkit.callbacks and rfkit.recipes, and
what ``import rfkit`` pulls in, asked of the installed wheel in a fresh interpreter."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run from an empty directory with only the installed wheel ahead of site-packages. Triton is made
# unimportable first: where it is installed torch imports it itself (``torch._dynamo`` asks whether
# it is there), so only blocked does its absence say anything of rfkit, and an import of it by
# rfkit fails the probe.
PROBE = """
import json, sys
sys.modules["triton"] = None
import rfkit, rfkit.callbacks, rfkit.cli, rfkit.evals.tasks, rfkit.evals.lm_eval, rfkit.models.hybrid
print(json.dumps({
    "rfkit": rfkit.__file__,
    "callbacks": rfkit.callbacks.__file__,
    "monitor": rfkit.callbacks.PerplexityMonitor.__name__,
    "modules": sorted(name for name, module in sys.modules.items() if module is not None),
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> dict:
    """The wheel built from this checkout, its file names, and :data:`PROBE`'s answer in a fresh
    interpreter where it is installed (one interpreter start for every question asked of it)."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root), str(ROOT)],
        check=True, timeout=300,
    )  # fmt: skip
    path = next(root.glob("rfkit-*.whl"))
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(path)],
        check=True, timeout=300,
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=root, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    probe = json.loads(out.strip().splitlines()[-1])
    return {"names": set(zipfile.ZipFile(path).namelist()), "site": site, "probe": probe, "modules": set(probe["modules"])}


@pytest.mark.slow
def test_wheel_maps_callbacks_and_recipes_into_the_package(wheel):
    names = wheel["names"]
    assert "rfkit/callbacks/__init__.py" in names and "rfkit/callbacks/perplexity.py" in names
    assert "rfkit/recipes/smollm2_b05.yaml" in names
    assert "rfkit/config/catalog.py" in names  # `rfkit recipes` and --config NAME read rfkit.recipes from the wheel
    assert "rfkit/ops/kernels/mamba_cpu.c" in names  # the CPU kernel is compiled from the installed source
    kernels = {"rfkit/ops/kernels/loss_cpu.c", "rfkit/ops/kernels/hybrid_train_cpu.c", "rfkit/ops/kernels/bf16.h", "rfkit/ops/kernels/phi.h"}
    assert kernels <= names  # with the headers they include
    assert not any(name.startswith("callbacks/") for name in names)
    # imported from the installed wheel, not from this checkout
    probe = wheel["probe"]
    assert probe["rfkit"].startswith(str(wheel["site"])) and probe["callbacks"].startswith(str(wheel["site"]))
    assert probe["monitor"] == "PerplexityMonitor"


@pytest.mark.slow
def test_import_rfkit_does_not_import_cuda_only_packages(wheel):
    """Nor Triton (the probe runs with it unimportable), nor the module of rfkit's Triton kernels,
    which waits until they serve (rfkit.ops.triton_state)."""
    modules = wheel["modules"]
    assert {"rfkit", "torch", "rfkit.ops.triton_state"} <= modules  # the probe did import
    assert not modules & {"mamba_ssm", "causal_conv1d", "triton", "rfkit.ops.triton_state_kernels"}


@pytest.mark.slow
def test_importing_rfkit_never_imports_lm_eval(wheel):
    assert {"rfkit", "rfkit.cli", "rfkit.evals.lm_eval"} <= wheel["modules"]  # the probe imported rfkit, its CLI and the adapter
    assert "lm_eval" not in wheel["modules"]
