"""The window part through FlexAttention (``RFKIT_WINDOW_BACKEND=flex``, rfkit.ops.flex_window)
against the tiled PyTorch path on the device: a training forward and its backward (every
gradient: queries, keys, values and the mixer's weights), in float32 and for bf16 activations,
for every window mixer, over blocks that cross FlexAttention's 128-token key blocks. On the GPU
FlexAttention is compiled and serves the gradient too. The CPU twin asserts what the CPU does
instead, with FlexAttention allowed there eagerly (``CPU_EAGER``, off for users): it serves the
forward without a gradient (the same output as the tiles) and the tiles serve every forward that
needs one (PyTorch has no FlexAttention backward there)."""

from __future__ import annotations

import pytest
import torch
from cuda_models import rel_err

from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.hybrid_mamba import HybridMambaAttention
from rfkit.models.window import WindowAttention
from rfkit.ops import flex_window

pytestmark = pytest.mark.cuda

KVQ, HD, L = [0, 0, 0, 1, 1, 1], 16, 300  # two KV heads, three query heads each (SmolLM2's is 3 x 3)
# float32 through two different kernels (the sums in another order); bf16 activations are rounded
# on the way in and out, the window and state computed in float32 (rfkit.models.precision)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def mixer(kind: str, device) -> WindowAttention:
    torch.manual_seed(0)
    if kind == "window":
        b = WindowAttention(KVQ, HD, window=56, sink=4)
    elif kind == "hybrid":
        b = HybridWindowAttention(KVQ, HD, window=56, sink=4, feature_dim=16, decay_horizon=64.0)
        with torch.no_grad():  # the gate open, as after attention transfer
            b.gate.fill_(1.0)
            b.log_scale.normal_(0, 0.5)
    else:
        b = HybridMambaAttention(KVQ, HD, window=56, sink=4, state_dim=8)
        with torch.no_grad():
            for p in b.parameters():
                p.add_(0.05 * torch.randn_like(p))
    return b.to(device).train()


def inputs(dtype, device, grad: bool):
    g = torch.Generator().manual_seed(1)
    make = lambda h: (torch.randn(2, h, L, HD, generator=g) * 2).to(device, dtype).requires_grad_(grad)  # noqa: E731
    return make(len(KVQ)), make(2), make(2)


def run(b, backend: str, dtype, device, monkeypatch, grad: bool):
    """The block's output and, with ``grad``, every gradient; and how many FlexAttention calls served."""
    monkeypatch.setattr(WindowAttention, "window_backend", backend)
    monkeypatch.setattr(flex_window, "CPU_EAGER", True)  # the twin: FlexAttention eager on the CPU (off for users)
    before = flex_window.served
    b.zero_grad(set_to_none=True)
    q, k, v = inputs(dtype, device, grad)
    with torch.set_grad_enabled(grad):
        y = b.attend(q, k, v)
    grads = {}
    if grad:
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device=device)).sum().backward()
        grads = {"q": q.grad, "k": k.grad, "v": v.grad}
        grads.update({name: p.grad for name, p in b.named_parameters() if p.grad is not None})
    return y.detach(), grads, flex_window.served - before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("kind", ["window", "hybrid", "hybrid_mamba"])
def test_flex_trains_as_the_tiles(kind, dtype, device, monkeypatch):
    b = mixer(kind, device)
    if hasattr(b, "window_dropout"):
        b.window_dropout = 0.0  # both runs at the full window
    monkeypatch.setattr(WindowAttention, "use_kernel", False)  # the CPU twin: the PyTorch tiles
    grad = device.type == "cuda"
    y_flex, g_flex, calls = run(b, "flex", dtype, device, monkeypatch, grad)
    y_torch, g_torch, none = run(b, "torch", dtype, device, monkeypatch, grad)
    assert calls == 1 and none == 0
    assert y_flex.dtype == dtype and bool(torch.isfinite(y_flex).all())
    assert rel_err(y_flex.double(), y_torch.double()) < TOL[dtype]
    assert sorted(g_flex) == sorted(g_torch)
    for name in g_torch:
        assert rel_err(g_flex[name].double(), g_torch[name].double()) < TOL[dtype], name
    if device.type == "cpu":  # what the CPU does instead: a forward that needs a gradient takes the tiles
        _, grads, calls = run(b, "flex", dtype, device, monkeypatch, grad=True)
        assert calls == 0 and grads["q"] is not None


def test_flex_trains_as_the_tiles_at_drawn_windows(device, monkeypatch):
    """Window dropout on (every forward draws a window): three training passes draw the same
    windows on both backends (the block's own generator, reseeded) and agree pass by pass; the
    drawn window is a mask over one key length, so the compiled kernel keeps its shapes."""
    b = mixer("hybrid", device)
    b.window_dropout = 1.0
    monkeypatch.setattr(WindowAttention, "use_kernel", False)
    grad = device.type == "cuda"
    passes = {}
    for backend in ("flex", "torch"):
        b._generator = torch.Generator().manual_seed(5)
        passes[backend] = [run(b, backend, torch.float32, device, monkeypatch, grad) for _ in range(3)]
    windows = []
    b._generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        windows.append(b.train_window())
    assert len(set(windows)) > 1 and max(windows) < b.window  # the passes ran at shorter, different windows
    for (y_f, g_f, calls), (y_t, g_t, none) in zip(passes["flex"], passes["torch"]):
        assert calls == 1 and none == 0
        assert rel_err(y_f.double(), y_t.double()) < TOL[torch.float32]
        for name in g_t:
            assert rel_err(g_f[name].double(), g_t[name].double()) < TOL[torch.float32], name
