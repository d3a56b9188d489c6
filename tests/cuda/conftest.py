"""The CUDA suite: what rfkit claims of a GPU, checked on one (``python -m pytest -m cuda tests/cuda``).

Every module here is marked ``cuda`` (``pytestmark``). Where no GPU is, tests/conftest.py deselects
them, unless ``RFKIT_CUDA_TWIN=1``: then they run on the CPU as *twins*, the rehearsal of the GPU
check that CI can run. A twin runs the code a GPU runs: the ``device`` fixture is the CPU and
:func:`device_paths` switches rfkit's compiled CPU kernels off (``rfkit.ops.cpu_kernels``), so the
window mixers take the PyTorch prefill and steady / per-row decode step and the Mamba block the
PyTorch scan and step, as on CUDA (where the C kernels never apply). What only a GPU can show
(pinned host memory, the CUDA generator in a checkpoint, Inductor's CUDA code, Lightning's FSDP
on a GPU) is asserted as what the CPU does instead, so a twin still fails when that code breaks.
"""

from __future__ import annotations

import pytest
import torch

from rfkit.ops import cpu_kernels


@pytest.fixture(scope="session")
def device() -> torch.device:
    """``cuda`` where a GPU is, else the CPU (twin mode). TF32 is off, so float32 matmuls and
    convolutions on the GPU are float32 (the tolerances below are float32's)."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def device_paths(device, monkeypatch):
    """On the CPU twin, rfkit's C kernels report themselves unavailable, so every mixer runs the
    PyTorch path a GPU runs (nothing to change on CUDA). The twin's tensors are tiny: one
    intra-op thread runs them fastest, and on a busy 2-core host a second thread's barriers made
    each small matmul over 100 times slower; the count is restored after each test."""
    if device.type != "cpu":
        yield
        return
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
