"""callbacks/ and recipes/ ship inside the wheel as rfkit.callbacks and rfkit.recipes."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_maps_callbacks_and_recipes_into_the_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, timeout=300,
    )  # fmt: skip
    wheel = next(tmp_path.glob("rfkit-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "rfkit/callbacks/__init__.py" in names and "rfkit/callbacks/perplexity.py" in names
    assert "rfkit/recipes/smollm2_b05.yaml" in names
    assert "rfkit/config/catalog.py" in names  # `rfkit recipes` and --config NAME read rfkit.recipes from the wheel
    assert "rfkit/ops/kernels/mamba_cpu.c" in names  # the CPU kernel is compiled from the installed source
    kernels = {"rfkit/ops/kernels/loss_cpu.c", "rfkit/ops/kernels/hybrid_train_cpu.c", "rfkit/ops/kernels/bf16.h", "rfkit/ops/kernels/phi.h"}
    assert kernels <= names  # with the headers they include
    assert not any(name.startswith("callbacks/") for name in names)

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    # Run from an empty directory with only the installed wheel ahead of site-packages.
    probe = "import rfkit.callbacks, rfkit; print(rfkit.callbacks.__file__); print(rfkit.callbacks.PerplexityMonitor.__name__)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout.split()  # fmt: skip
    assert out[0].startswith(str(site)) and out[1] == "PerplexityMonitor"


@pytest.mark.slow
def test_import_rfkit_does_not_import_cuda_only_packages(modules_after_import_rfkit):
    """Nor Triton (the probe runs with it unimportable), nor the module of rfkit's Triton kernels,
    which waits until they serve (rfkit.ops.triton_state)."""
    assert {"rfkit", "torch", "rfkit.ops.triton_state"} <= modules_after_import_rfkit  # the probe did import
    assert not modules_after_import_rfkit & {"mamba_ssm", "causal_conv1d", "triton", "rfkit.ops.triton_state_kernels"}
