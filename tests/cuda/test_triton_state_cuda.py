"""The hybrid's state part through the Triton kernels (``RFKIT_STATE_BACKEND=triton``,
rfkit.ops.triton_state) against its PyTorch chunks on the device: a training forward and its
backward (every gradient: queries, keys, values and the block's weights, the decay's horizon
included), in float32 and for bf16 activations, at the full window and at drawn shorter ones,
alone and beside FlexAttention's window part, over blocks of five of the kernels' chunks. On the
GPU the kernels are compiled; the CPU twin runs the same kernels under Triton's interpreter
(``CPU_INTERPRET``, off for users), which serves the backward too, so it asserts the same."""

from __future__ import annotations

import pytest
import torch
from cuda_models import rel_err

from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.window import WindowAttention
from rfkit.ops import flex_window, triton_state

pytestmark = pytest.mark.cuda

KVQ, HD, L = [0, 0, 0, 1, 1, 1], 16, 300  # two KV heads, three query heads each (SmolLM2's is 3 x 3)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def interpreter_runs(device):
    """The CPU twin needs Triton's interpreter to run the kernels; the GPU image's pair, Triton 3.6
    under NumPy 2.5, cannot (rfkit.ops.triton_state.interpreter_problem), and the rehearsal in the
    image's versions meets it. On a GPU the kernels are compiled and this never skips."""
    if device.type == "cpu" and (problem := triton_state.interpreter_problem()) is not None:
        pytest.skip(f"the CPU twin needs Triton's interpreter, which cannot run the kernels here: {problem}")


def hybrid(device) -> HybridWindowAttention:
    torch.manual_seed(0)
    b = HybridWindowAttention(KVQ, HD, window=56, sink=4, feature_dim=16, decay_horizon=64.0)
    with torch.no_grad():  # the gate open, as after attention transfer
        b.gate.fill_(1.0)
        b.log_scale.normal_(0, 0.5)
    return b.to(device).train()


def run(b, state_backend: str, window_backend: str, dtype, device, monkeypatch):
    """Output, every gradient, and how many state-kernel and FlexAttention calls served."""
    monkeypatch.setattr(HybridWindowAttention, "state_backend", state_backend)
    monkeypatch.setattr(WindowAttention, "window_backend", window_backend)
    monkeypatch.setattr(triton_state, "CPU_INTERPRET", True)  # the twin: the kernels interpreted on the CPU
    monkeypatch.setattr(flex_window, "CPU_EAGER", True)
    monkeypatch.setattr(WindowAttention, "use_kernel", False)  # the CPU twin: the PyTorch tiles
    calls, flex = triton_state.served, flex_window.served
    b.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1)
    make = lambda h: (torch.randn(2, h, L, HD, generator=g) * 2).to(device, dtype).requires_grad_()  # noqa: E731
    q, k, v = make(len(KVQ)), make(2), make(2)
    y = b.attend(q, k, v)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=device)).sum().backward()
    grads = {"q": q.grad, "k": k.grad, "v": v.grad, **{n: p.grad for n, p in b.named_parameters() if p.grad is not None}}
    return y.detach(), grads, triton_state.served - calls, flex_window.served - flex


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("window_backend", ["torch", "flex"])
def test_triton_trains_as_the_pytorch_chunks(window_backend, dtype, device, monkeypatch):
    b = hybrid(device)
    b.window_dropout = 0.0
    y_k, g_k, calls, flex = run(b, "triton", window_backend, dtype, device, monkeypatch)
    y_p, g_p, none, flex_p = run(b, "torch", window_backend, dtype, device, monkeypatch)
    assert calls == 1 and none == 0
    # FlexAttention serves a training pass on CUDA; on the CPU it has no backward (the tiles run)
    assert flex == flex_p == (1 if window_backend == "flex" and device.type == "cuda" else 0)
    assert y_k.dtype == dtype and bool(torch.isfinite(y_k).all())
    assert rel_err(y_k.double(), y_p.double()) < TOL[dtype]
    assert "log_horizon" in g_p and sorted(g_k) == sorted(g_p)
    for name in g_p:
        assert rel_err(g_k[name].double(), g_p[name].double()) < TOL[dtype], name


def test_triton_trains_as_the_pytorch_chunks_at_drawn_windows(device, monkeypatch):
    """Window dropout on: three passes draw the same (shorter, different) windows on both backends
    and agree pass by pass; the ring's keys outside a drawn window start the kernels' state."""
    b = hybrid(device)
    b.window_dropout = 1.0
    passes = {}
    for backend in ("triton", "torch"):
        b._generator = torch.Generator().manual_seed(5)
        passes[backend] = [run(b, backend, "torch", torch.float32, device, monkeypatch) for _ in range(3)]
    b._generator = torch.Generator().manual_seed(5)
    windows = [b.train_window() for _ in range(3)]
    assert len(set(windows)) > 1 and max(windows) < b.window
    for (y_k, g_k, calls, _), (y_p, g_p, none, _) in zip(passes["triton"], passes["torch"]):
        assert calls == 1 and none == 0
        assert rel_err(y_k.double(), y_p.double()) < TOL[torch.float32]
        for name in g_p:
            assert rel_err(g_k[name].double(), g_p[name].double()) < TOL[torch.float32], name
