"""The window part through FlexAttention (``window_backend = "flex"``, rfkit.ops.flex_window)
against the tiled PyTorch path and a naive masked attention, in float64 on the CPU (FlexAttention
eager, forward only: the CPU has no FlexAttention backward). Across chunks that carry the state,
a first chunk shorter than the sink, a shorter drawn window, GQA and per-head groups, every
window mixer; and where it must not serve (a sharper hybrid, a CPU forward that needs a
gradient, an unknown backend; the CLI's refusal is in tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import converted_tiny, decode_alike_on_two_backends
from test_fast_paths import W, block, masked_reference, qkv

from rfkit.errors import RFKitError
from rfkit.models.hybrid_mamba import HybridMambaAttention
from rfkit.models.operators import HybridOperator
from rfkit.models.window import WindowAttention
from rfkit.ops import flex_window

@pytest.fixture(autouse=True)
def flex_on_the_cpu(monkeypatch):
    """FlexAttention eager on the CPU (``CPU_EAGER``, off for users): the path these tests hold to the tiles."""
    monkeypatch.setattr(flex_window, "CPU_EAGER", True)


PER_HEAD = [1, 0, 0, 1]  # query heads whose KV heads are not in grouped order: every head its own group


def _mixer(kind: str, sink: int, kvq):
    if kind == "hybrid_mamba":
        b = HybridMambaAttention(kvq, 8, window=W, sink=sink, state_dim=4).double().eval()
        with torch.no_grad():
            for p in b.parameters():  # away from the zero start, so the state's output counts
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
        return b
    if kind == "hybrid_tau1":  # the decayed block of test_fast_paths, read at sharpness 1
        b = block("hybrid_decay", sink, kvq)
        b.sharpness = 1.0
        return b
    return block(kind, sink, kvq)


def _run(b, backend: str, chunks, monkeypatch, window: int | None = None):
    """Outputs and the final state of consecutive prefill chunks through the tiled path."""
    monkeypatch.setattr(WindowAttention, "window_backend", backend)
    monkeypatch.setattr(WindowAttention, "use_kernel", False)  # the PyTorch tiles, not the C prefill
    state, outs = (), []
    with torch.no_grad():
        for q, k, v in chunks:
            if not state:
                state = b.empty_state(q.shape[0], q.device, k.dtype)
            seen = int(state[2][0])
            if window is None:
                y, state = b.attend(q, k, v, *state, return_states=True)
            else:  # a shorter window, as a training forward draws it
                y, state = b._prefill(q, k, v, state, seen, True, window)
            outs.append(y)
    return torch.cat(outs, 1), state


def _chunks(L: int, cuts, kvq):
    q, k, v = qkv(2, L, kvq, seed=L)
    bounds = [0, *cuts, L]
    return [tuple(t[:, :, a:b] for t in (q, k, v)) for a, b in zip(bounds, bounds[1:])], (q, k, v)


@pytest.mark.parametrize("kind", ["window", "hybrid_open", "hybrid_closed", "hybrid_tau1", "hybrid_mamba"])
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kvq", [[0, 0, 1, 1], PER_HEAD], ids=["gqa", "per_head"])
def test_flex_matches_the_tiles_across_chunks(kind, sink, kvq, monkeypatch):
    """Chunks of 2 (inside the sink), 19 and 20 tokens: the same outputs and the same state."""
    b = _mixer(kind, sink, kvq)
    chunks, whole = _chunks(41, [2, 21], kvq)
    before = flex_window.served
    y_flex, s_flex = _run(b, "flex", chunks, monkeypatch)
    assert flex_window.served - before == 3, "FlexAttention served every chunk"
    y_torch, s_torch = _run(b, "torch", chunks, monkeypatch)
    torch.testing.assert_close(y_flex, y_torch, rtol=1e-10, atol=1e-10)
    for a, c in zip(s_flex, s_torch):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)
    if kind != "hybrid_mamba":  # the naive L x L reference of test_fast_paths, one chunk
        torch.testing.assert_close(y_flex, masked_reference(b, *whole), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["window", "hybrid_open"])
def test_flex_matches_the_tiles_at_a_shorter_window(kind, monkeypatch):
    """A window shorter than the block's (window dropout) after a first chunk: the ring's oldest
    keys are outside it, and for the hybrid folded into the state first."""
    b = _mixer(kind, 2, [0, 0, 1, 1])
    chunks, _ = _chunks(45, [12], [0, 0, 1, 1])
    shapes = []
    real = flex_window.window_attention
    monkeypatch.setattr(flex_window, "window_attention", lambda q, k, *a, **kw: shapes.append(k.shape[2]) or real(q, k, *a, **kw))
    y_flex, s_flex = _run(b, "flex", chunks, monkeypatch, window=3)
    # the drawn window is a mask over the whole ring: the keys' length (the compiled kernel's
    # shape) is sink + ring + chunk whatever the draw
    assert shapes == [2 + W + 12, 2 + W + 33]
    y_torch, s_torch = _run(b, "torch", chunks, monkeypatch, window=3)
    torch.testing.assert_close(y_flex, y_torch, rtol=1e-10, atol=1e-10)
    for a, c in zip(s_flex, s_torch):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


def test_flex_does_not_serve_where_the_log_sum_exp_is_not_enough(monkeypatch):
    """A hybrid read sharper than trained needs the window's max itself; a CPU forward that
    needs a gradient has no FlexAttention backward: both keep the tiles (and agree with them)."""
    monkeypatch.setattr(WindowAttention, "window_backend", "flex")
    q, k, v = qkv(1, 9, [0, 0, 1, 1])
    state = lambda b: b.empty_state(1, q.device, q.dtype)  # noqa: E731
    sharp = block("hybrid_decay", 2)  # sharpness 1.5
    assert sharp.sharpness != 1.0 and not sharp._flex_ready(q, k, v, state(sharp))
    plain = block("window", 2)
    assert plain._flex_ready(q, k, v, state(plain))
    assert not plain._flex_ready(q.requires_grad_(), k, v, state(plain))  # the CPU: no backward


def test_on_a_cpu_the_tiles_run_and_say_so_once_unless_flex_is_allowed_there(monkeypatch, caplog):
    """For users a CPU keeps the tiles (uncompiled FlexAttention would hold every score of the
    chunk), with one warning line per process, and gives the tiles' output."""
    monkeypatch.setattr(flex_window, "CPU_EAGER", False)
    monkeypatch.setattr(flex_window, "_told", set())
    b = _mixer("hybrid_open", 2, [0, 0, 1, 1])
    chunks, _ = _chunks(30, [], [0, 0, 1, 1])
    before = flex_window.served
    with caplog.at_level("WARNING", logger="rfkit.ops.flex_window"):
        y_cpu, _ = _run(b, "flex", chunks, monkeypatch)
        _run(b, "flex", chunks, monkeypatch)
    assert flex_window.served == before
    assert [r.getMessage() for r in caplog.records] == [
        "RFKIT_WINDOW_BACKEND=flex: FlexAttention serves CUDA devices; the window mixers keep their tiles on cpu"
    ]
    torch.testing.assert_close(y_cpu, _run(b, "torch", chunks, monkeypatch)[0], rtol=0, atol=0)


def test_an_unknown_backend_is_one_line_naming_the_field(monkeypatch):
    monkeypatch.setattr(WindowAttention, "window_backend", "triton")
    b = block("window", 2)
    q, k, v = qkv(1, 5, [0, 0, 1, 1])
    with pytest.raises(RFKitError, match=r"^WindowAttention.window_backend: 'triton' is not allowed; allowed: torch, flex$"):
        b.attend(q, k, v)
    monkeypatch.setattr(WindowAttention, "window_backend", None)
    monkeypatch.setenv(flex_window.ENV, "fast")
    with pytest.raises(RFKitError, match=r"^RFKIT_WINDOW_BACKEND: 'fast' is not allowed; allowed: torch, flex$"):
        b.attend(q, k, v)
    monkeypatch.setenv(flex_window.ENV, "flex")
    assert flex_window.resolve(None) == "flex"
    monkeypatch.delenv(flex_window.ENV)
    assert flex_window.resolve(None) == "torch"



def test_a_converted_model_decodes_and_generates_through_flex_as_through_the_tiles(monkeypatch):
    """A converted model whose prefills run through FlexAttention: cached steps after a prefill
    give the full forward's logits, and greedy ``generate`` on a left-padded batch (each row's
    prefill on its own) picks the tiles' tokens with the tiles' logits, in float64."""
    model = converted_tiny(HybridOperator(sink=2, window=5, feature_dim=4))
    monkeypatch.setattr(WindowAttention, "use_kernel", False)
    choose = lambda name: monkeypatch.setattr(WindowAttention, "window_backend", name)  # noqa: E731
    decode_alike_on_two_backends(model, ("flex", "torch"), choose, lambda: flex_window.served,
                                 length=20, prefix=9, new_tokens=10, tol=1e-9)  # fmt: skip
