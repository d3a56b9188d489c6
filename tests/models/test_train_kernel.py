"""The compiled training forward and backward of the window mixers (``kernels/hybrid_train_cpu.c``,
:func:`rfkit.ops.cpu_kernels.window_train_cpu`) against the PyTorch tiled path in float64: the
output and the gradient of every input and weight, for plain window attention and the hybrid
(closed gate, open gates, a decay with a sharpness), with and without sink tokens, grouped and
ungrouped query heads, the full window and a shorter drawn one; and which forwards take it."""

from __future__ import annotations

import pytest
import torch

from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.window import WindowAttention
from rfkit.ops import cpu_kernels

GROUPED, UNGROUPED = [0, 0, 0, 1, 1, 1], [1, 0, 1, 0, 0, 1]


def make(kind: str, kvq, head_dim: int, sink: int, window: int = 9) -> WindowAttention:
    if kind == "window":
        return WindowAttention(kvq, head_dim, window=window, sink=sink).train()
    decay = 6.0 if kind == "hybrid_decay" else None
    sharp = 1.5 if kind == "hybrid_decay" else 1.0
    b = HybridWindowAttention(kvq, head_dim, window=window, sink=sink, feature_dim=4 if head_dim < 16 else 16, decay_horizon=decay, sharpness=sharp)
    if kind != "hybrid_closed":
        with torch.no_grad():
            b.gate.copy_(torch.linspace(0.2, 1.1, len(kvq)))
            b.gate[1] = 0.0  # one closed head beside open ones
            b.log_scale.copy_(torch.linspace(-0.5, 0.5, len(kvq)))
            if decay is not None:  # a horizon per KV head
                b.log_horizon.copy_(torch.log(torch.tensor([3.0, 11.0])))
    return b.train()


def run(b: WindowAttention, q, k, v, window: int | None):
    """Output and gradients of a weighted sum of it (every output element its own weight)."""
    b.zero_grad(set_to_none=True)
    if window is not None:
        b.draw_for_batch()
        b._batch_window = window
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    y = b.attend(q, k, v)
    weight = torch.linspace(-1.0, 1.0, y.numel(), dtype=y.dtype).view_as(y)
    (y * weight).sum().backward()
    grads = {"y": y, "dq": q.grad, "dk": k.grad, "dv": v.grad, **{n: p.grad for n, p in b.named_parameters()}}
    return {n: g.detach().clone() for n, g in grads.items()}  # the block may be cast after


def inputs(kvq, head_dim: int, length: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(length + head_dim)
    hkv = max(kvq) + 1
    return [torch.randn(2, h, length, head_dim, generator=g).to(dtype) for h in (len(kvq), hkv, hkv)]


@pytest.fixture
def kernel_calls(monkeypatch):
    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    calls = []
    compiled = cpu_kernels.window_train_cpu
    monkeypatch.setattr(cpu_kernels, "window_train_cpu", lambda *a: calls.append(a[-1]) or compiled(*a))
    return calls


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kvq", [GROUPED, UNGROUPED], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("head_dim, length", [(8, 5), (8, 40), (64, 33)])
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kind", ["window", "hybrid_closed", "hybrid_open", "hybrid_decay"])
def test_kernel_output_and_every_gradient_match_the_pytorch_path(kind, sink, head_dim, length, kvq, window, kernel_calls, monkeypatch):
    if kind == "window" and window is not None:  # no dropout there: a block with that window
        b, window = make(kind, kvq, head_dim, sink, window=window), None
    else:
        b = make(kind, kvq, head_dim, sink)
    q, k, v = inputs(kvq, head_dim, length)
    got = run(b, q, k, v, window)
    assert kernel_calls == [window or b.window]  # the kernel ran, at the drawn window
    monkeypatch.setattr(WindowAttention, "use_kernel", False)
    reference = b.double()
    want = run(reference, q.double(), k.double(), v.double(), window)
    assert len(kernel_calls) == 1
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if kind == "hybrid_closed" and length > sink + b.window:  # with old tokens, a closed gate still learns to open
        assert got["gate"].abs().min() > 0


def test_bf16_activations_compute_in_float32_and_return_bf16_gradients(kernel_calls, monkeypatch):
    """A bf16 model's mixer: the kernel reads bf16 q, k, v in float32 and hands back the output
    and the inputs' gradients in bf16, as the PyTorch path (float32 compute) does; the weights
    stay float32."""
    b = make("hybrid_decay", GROUPED, 64, 3)
    q, k, v = inputs(GROUPED, 64, 70, torch.bfloat16)
    got = run(b, q, k, v, None)
    assert kernel_calls
    monkeypatch.setattr(WindowAttention, "use_kernel", False)
    want = run(b, q, k, v, None)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{n}: {m}")
    assert {got[n].dtype for n in ("y", "dq", "dk", "dv")} == {torch.bfloat16}
    assert got["feature_map"].dtype == torch.float32


def test_only_whole_blocks_in_training_mode_take_the_kernel(kernel_calls):
    """Inference, a state to continue, padding, a forward that returns its state and the general
    path (fast = False) keep their own paths; a training forward without gradients (an activation
    checkpoint's first pass) takes the kernel as its recompute will."""
    b = make("hybrid_open", GROUPED, 8, 2)
    q, k, v = inputs(GROUPED, 8, 20)
    b.eval()
    b.attend(q, k, v)
    b.train()
    _, state = b.attend(q, k, v, return_states=True)
    b.attend(q, k, v, *state)
    b.attend(q, k, v, mask=torch.ones(2, 20, dtype=torch.long))
    b.fast = False
    b.attend(q, k, v)
    b.fast = True
    assert kernel_calls == []
    with torch.no_grad():
        b.attend(q, k, v)
    assert len(kernel_calls) == 1


def test_disabled_kernel_falls_back_to_the_pytorch_path(monkeypatch):
    """RFKIT_CPU_KERNEL=0 (or no compiler) leaves training on the PyTorch path, with the same result."""
    b = make("hybrid_open", GROUPED, 8, 2)
    q, k, v = inputs(GROUPED, 8, 30)
    with_kernel = run(b, q, k, v, None)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "window_train_cpu", lambda *a: pytest.fail("kernel called while unavailable"))
    without = run(b, q, k, v, None)
    for name in without:
        torch.testing.assert_close(with_kernel[name], without[name], rtol=1e-4, atol=1e-5)


def test_a_subclass_that_adds_to_the_window_keeps_its_own_path(kernel_calls):
    """HybridMambaAttention is a window block plus a Mamba state the kernel does not compute: its
    training forwards never reach the kernel (they would lose the state)."""
    from rfkit.models.hybrid_mamba import HybridMambaAttention

    b = HybridMambaAttention(GROUPED, 8, window=5, sink=2, state_dim=4).train()
    q, k, v = inputs(GROUPED, 8, 20)
    b.attend(q, k, v)
    assert kernel_calls == []
