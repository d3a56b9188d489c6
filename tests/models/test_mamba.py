"""Tests of rfkit.models.mamba: the chunked selective scan against the sequential reference, and the
MambaBlock (wiring, decoding, chunked prefill, masking, arguments, path choice).

Tolerances: float64 comparisons use atol=rtol=1e-10 (the computations are algebraically equal,
only rounding differs); float32 comparisons use atol=rtol=1e-5 for outputs and states and
atol=rtol=1e-4 for gradients (which sum many more float32 terms).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

import rfkit.models.mamba as rm
import rfkit.ops.scan as rs
from rfkit.models.mamba import MambaBlock
from rfkit.ops.scan import selective_scan_chunked, selective_scan_ref

F64 = {"atol": 1e-10, "rtol": 1e-10}
F32 = {"atol": 1e-5, "rtol": 1e-5}
F32_GRAD = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # The tensors here are tiny; on a small, busy CPU box intra-op threads only add OpenMP
    # contention (observed: a 2x32x16 float64 conv1d taking ~0.4 s with 2 threads, 0.2 ms with 1).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tol(dtype, grad=False):
    if dtype == torch.float64:
        return F64
    return F32_GRAD if grad else F32


# --------------------------------------------------------------------------- scan
def _scan_inputs(bsz, dim, n, length, dtype, *, delta_max=None, a_min=-4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    u = r(bsz, dim, length)
    if delta_max is None:
        delta = r(bsz, dim, length) - 1.0  # raw, used with delta_bias + softplus
    else:
        delta = torch.rand(bsz, dim, length, generator=g, dtype=dtype) * delta_max
    A = a_min * torch.rand(dim, n, generator=g, dtype=dtype)  # in [a_min, 0]
    B = r(bsz, n, length)
    C = r(bsz, n, length)
    D = r(dim)
    z = r(bsz, dim, length)
    delta_bias = 0.5 * r(dim)
    h0 = r(bsz, dim, n)
    return u, delta, A, B, C, D, z, delta_bias, h0


def _run_scan(fn, tensors, *, softplus, with_init, **kw):
    u, delta, A, B, C, D, z, delta_bias, h0 = tensors
    y, last = fn(
        u,
        delta,
        A,
        B,
        C,
        D,
        z=z,
        delta_bias=delta_bias if softplus else None,
        delta_softplus=softplus,
        initial_state=h0 if with_init else None,
        return_last_state=True,
        **kw,
    )
    return y, last


def _outputs_and_grads(fn, tensors, *, softplus, with_init, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    y, last = _run_scan(fn, leaves, softplus=softplus, with_init=with_init, **kw)
    # a fixed random projection of (y, last state) as the loss, so every gradient is exercised
    g = torch.Generator().manual_seed(123)
    wy = torch.randn(y.shape, generator=g, dtype=y.dtype)
    wh = torch.randn(last.shape, generator=g, dtype=last.dtype)
    loss = (y * wy).sum() + (last * wh).sum()
    # delta_bias (index 7) is only used with softplus, initial_state (index 8) only with_init
    used = [t for i, t in enumerate(leaves) if (softplus or i != 7) and (with_init or i != 8)]
    grads = torch.autograd.grad(loss, used)
    return y.detach(), last.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_matches_reference_outputs_and_grads(dtype, with_init):
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]
    for length in (1, 5, 31, 64, 100):
        tensors = _scan_inputs(2, 3, 4, length, dtype, seed=length)
        y_ref, h_ref, g_ref = _outputs_and_grads(selective_scan_ref, tensors, softplus=True, with_init=with_init)
        for chunk in (1, 4, 8, 32, 64):
            y, h, g = _outputs_and_grads(
                selective_scan_chunked, tensors, softplus=True, with_init=with_init, chunk_size=chunk
            )
            ctx = f"L={length} chunk={chunk} {dtype} init={with_init}"
            assert y.dtype == dtype
            torch.testing.assert_close(y, y_ref, **_tol(dtype), msg=lambda m: f"y {ctx}: {m}")
            torch.testing.assert_close(h, h_ref, **_tol(dtype), msg=lambda m: f"state {ctx}: {m}")
            assert len(g) == len(g_ref) == (9 if with_init else 8)
            for name, a, b in zip(names, g, g_ref):
                assert torch.isfinite(a).all(), f"grad {name} {ctx} not finite"
                torch.testing.assert_close(a, b, **_tol(dtype, grad=True), msg=lambda m: f"grad {name} {ctx}: {m}")


def test_chunked_without_optional_args_matches_reference():
    u, delta, A, B, C, *_ = _scan_inputs(2, 3, 5, 23, torch.float64, delta_max=1.0)
    y_ref = selective_scan_ref(u, delta, A, B, C)
    y = selective_scan_chunked(u, delta, A, B, C, chunk_size=8)
    assert y.shape == (2, 3, 23)
    torch.testing.assert_close(y, y_ref, **F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_stable_for_large_delta_times_A(dtype):
    # delta up to 5 and A down to -16: |delta * A| up to 80 per token and up to 80 * 64 over a chunk
    # of 64, so exp(-cumsum) (the unstable formulation) would overflow even in float64.
    tensors = _scan_inputs(2, 4, 6, 100, dtype, delta_max=5.0, a_min=-16.0, seed=7)
    y_ref, h_ref, g_ref = _outputs_and_grads(selective_scan_ref, tensors, softplus=False, with_init=True)
    for chunk in (8, 32, 64):
        y, h, g = _outputs_and_grads(selective_scan_chunked, tensors, softplus=False, with_init=True, chunk_size=chunk)
        assert torch.isfinite(y).all() and torch.isfinite(h).all()
        assert all(torch.isfinite(t).all() for t in g)
        torch.testing.assert_close(y, y_ref, **_tol(dtype))
        torch.testing.assert_close(h, h_ref, **_tol(dtype))
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, **_tol(dtype, grad=True))


def test_chunked_bf16_computes_in_float32_and_returns_bf16():
    u, delta, A, B, C, D, z, delta_bias, h0 = _scan_inputs(2, 3, 4, 40, torch.float32, seed=3)
    bf = [t.to(torch.bfloat16) for t in (u, delta, B, C, z)]
    y, last = selective_scan_chunked(
        bf[0], bf[1], A, bf[2], bf[3], D, z=bf[4], delta_bias=delta_bias, delta_softplus=True,
        return_last_state=True,
    )
    assert y.dtype == torch.bfloat16 and last.dtype == torch.float32
    # the float32 reference on the same (bf16-rounded) inputs: only the final rounding differs
    y_ref = selective_scan_ref(
        *(t.float() for t in bf[:2]), A, bf[2].float(), bf[3].float(), D, z=bf[4].float(),
        delta_bias=delta_bias, delta_softplus=True,
    )
    torch.testing.assert_close(y.float(), y_ref, atol=2e-2, rtol=1e-2)


def test_scan_rejects_bad_shapes():
    u, delta, A, B, C, *_ = _scan_inputs(2, 3, 4, 5, torch.float32)
    with pytest.raises(ValueError, match="B must be"):
        selective_scan_chunked(u, delta, A, B[:, :2], C)
    with pytest.raises(ValueError, match="chunk_size"):
        selective_scan_chunked(u, delta, A, B, C, chunk_size=0)


# --------------------------------------------------------------------------- block helpers
def _block(d_in=16, d_out=12, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("use_fast_path", "never")
    blk = MambaBlock(d_in, d_out, d_state=5, d_conv=4, expand=2, bias=True, **kw).to(dtype)
    with torch.no_grad():  # move every parameter away from its special init value
        for p in blk.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return blk


def _naive_block(blk: MambaBlock, hs: torch.Tensor) -> torch.Tensor:
    """The Mamba block written out by hand from blk's parameters, using the sequential scan."""
    d_inner, K = blk.d_inner, blk.d_conv
    xz = hs @ blk.in_proj.weight.T + blk.in_proj.bias  # (B, L, 2*d_inner)
    x, z = xz[..., :d_inner], xz[..., d_inner:]
    w = blk.conv1d.weight[:, 0, :]  # (d_inner, K)
    L = hs.shape[1]
    conv = torch.zeros_like(x)
    for t in range(L):  # causal depthwise conv, tap by tap, zeros before the sequence
        for k in range(K):
            src = t - (K - 1) + k
            if src >= 0:
                conv[:, t] += w[:, k] * x[:, src]
    xc = F.silu(conv + blk.conv1d.bias)  # (B, L, d_inner)
    dbc = xc @ blk.x_proj.weight.T
    r, n = blk.dt_rank, blk.d_state
    dt, Bm, Cm = dbc[..., :r], dbc[..., r : r + n], dbc[..., r + n :]
    delta = F.softplus(dt @ blk.dt_proj.weight.T + blk.dt_proj.bias)  # (B, L, d_inner)
    A = -torch.exp(blk.A_log)
    y = selective_scan_ref(
        xc.transpose(1, 2), delta.transpose(1, 2), A, Bm.transpose(1, 2), Cm.transpose(1, 2), blk.D,
        z=z.transpose(1, 2),
    )
    return y.transpose(1, 2) @ blk.out_proj.weight.T + blk.out_proj.bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_forward_matches_naive_implementation(dtype):
    blk = _block(d_in=16, d_out=12, dtype=dtype)
    hs = torch.randn(3, 21, 16, dtype=dtype)
    out = blk(hs)
    assert out.shape == (3, 21, 12) and out.dtype == dtype
    torch.testing.assert_close(out, _naive_block(blk, hs), **_tol(dtype))


def test_block_gradients_match_naive_implementation():
    blk = _block(d_in=8, d_out=6, dtype=torch.float64, chunk_size=4)
    hs = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 13, 6, dtype=torch.float64)
    params = [hs, *blk.parameters()]
    g = torch.autograd.grad((blk(hs) * w).sum(), params)
    g_ref = torch.autograd.grad((_naive_block(blk, hs) * w).sum(), params)
    names = ["hidden_states"] + [n for n, _ in blk.named_parameters()]
    for name, a, b in zip(names, g, g_ref):
        assert a.abs().sum() > 0, f"no gradient reached {name}"
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"grad {name}: {m}")


# --------------------------------------------------------------------------- decoding, prefill, mask
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_step_by_step_decoding_equals_full_forward(dtype):
    blk = _block(dtype=dtype)
    hs = torch.randn(2, 11, 16, dtype=dtype)
    full, (conv_full, ssm_full) = blk(hs, return_states=True)
    conv, ssm = blk.allocate_inference_cache(2)
    outs = []
    for t in range(hs.shape[1]):
        tok = hs[:, t : t + 1] if t % 2 == 0 else hs[:, t]  # both (B, 1, d_in) and (B, d_in)
        out, conv2, ssm2 = blk.step(tok, conv, ssm)
        assert out.shape == (2, 1, 12)
        assert conv2 is conv and ssm2 is ssm  # updated in place
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **_tol(dtype))
    torch.testing.assert_close(conv, conv_full, **_tol(dtype))
    torch.testing.assert_close(ssm, ssm_full, **_tol(dtype))


@pytest.mark.parametrize("split", [2, 6, 9])
def test_two_part_forward_with_states_equals_full_forward(split):
    blk = _block()
    hs = torch.randn(2, 13, 16, dtype=torch.float64)
    full, (conv_full, ssm_full) = blk(hs, return_states=True)
    first, (conv, ssm) = blk(hs[:, :split], return_states=True)
    assert conv.shape == (2, blk.d_inner, blk.d_conv) and ssm.shape == (2, blk.d_inner, blk.d_state)
    conv_in, ssm_in = conv.clone(), ssm.clone()
    second, (conv2, ssm2) = blk(hs[:, split:], conv_state=conv, ssm_state=ssm, return_states=True)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, **F64)
    torch.testing.assert_close(conv2, conv_full, **F64)
    torch.testing.assert_close(ssm2, ssm_full, **F64)
    assert torch.equal(conv, conv_in) and torch.equal(ssm, ssm_in)  # forward does not modify its inputs
    # and decoding continues from a prefill exactly like the full forward
    c, s = conv.clone(), ssm.clone()
    outs = [blk.step(hs[:, t], c, s)[0] for t in range(split, 13)]
    torch.testing.assert_close(torch.cat(outs, dim=1), full[:, split:], **F64)


def test_conv_state_is_zero_padded_for_short_prompts():
    blk = _block()
    hs = torch.randn(1, 2, 16, dtype=torch.float64)
    _, (conv, _) = blk(hs, return_states=True)
    x = (hs @ blk.in_proj.weight.T + blk.in_proj.bias)[..., : blk.d_inner]  # conv input (1, 2, d_inner)
    assert torch.equal(conv[:, :, :2], torch.zeros_like(conv[:, :, :2]))
    torch.testing.assert_close(conv[:, :, 2:], x.transpose(1, 2), **F64)


def test_left_padding_mask_matches_unpadded_sequence():
    blk = _block()
    real, pad, total = 6, 5, 11
    seq0 = torch.randn(1, real, 16, dtype=torch.float64)
    seq1 = torch.randn(1, total, 16, dtype=torch.float64)
    garbage = 10 * torch.randn(1, pad, 16, dtype=torch.float64)  # padding embeddings must not matter
    batch = torch.cat([torch.cat([garbage, seq0], dim=1), seq1], dim=0)  # (2, 11, 16)
    mask = torch.ones(2, total, dtype=torch.bool)
    mask[0, :pad] = False

    out, (conv, ssm) = blk(batch, mask=mask, return_states=True)
    ref0, (conv0, ssm0) = blk(seq0, return_states=True)
    ref1, (conv1, ssm1) = blk(seq1, return_states=True)
    torch.testing.assert_close(out[0:1, pad:], ref0, **F64)
    torch.testing.assert_close(out[1:2], ref1, **F64)
    torch.testing.assert_close(conv[0:1], conv0, **F64)
    torch.testing.assert_close(ssm[0:1], ssm0, **F64)
    torch.testing.assert_close(ssm[1:2], ssm1, **F64)
    # without the mask the padding does leak into the real positions (the test can fail)
    assert not torch.allclose(blk(batch)[0:1, pad:], ref0, atol=1e-3)
    # a 0/1 float mask works the same, and decoding after the padded prefill matches
    out_f = blk(batch, mask=mask.double())
    torch.testing.assert_close(out_f[0:1, pad:], ref0, **F64)
    nxt = torch.randn(2, 16, dtype=torch.float64)
    step_b = blk.step(nxt, conv, ssm)[0]
    step_0 = blk.step(nxt[0:1], conv0, ssm0)[0]
    torch.testing.assert_close(step_b[0:1], step_0, **F64)


# --------------------------------------------------------------------------- construction
def test_shapes_d_in_ne_d_out_and_dt_rank_auto():
    blk = MambaBlock(40, 24)
    assert blk.dt_rank == math.ceil(40 / 16) == 3
    assert blk.d_inner == 80
    assert blk.x_proj.weight.shape == (3 + 2 * 16, 80)
    assert blk.dt_proj.weight.shape == (80, 3)
    assert blk.in_proj.weight.shape == (160, 40) and blk.out_proj.weight.shape == (24, 80)
    assert blk.conv1d.weight.shape == (80, 1, 4)
    out = blk(torch.randn(2, 7, 40))
    assert out.shape == (2, 7, 24)
    assert MambaBlock(16, 16).dt_rank == 1
    assert MambaBlock(17, 16).dt_rank == 2
    assert MambaBlock(16, 16, dt_rank=5).dt_rank == 5


def test_initialisation():
    torch.manual_seed(0)
    blk = MambaBlock(32, 32, d_state=8, dt_min=0.002, dt_max=0.05)
    assert torch.allclose(blk.A_log, torch.log(torch.arange(1, 9, dtype=torch.float32)).repeat(64, 1))
    assert torch.equal(blk.D, torch.ones(64))
    assert blk.A_log._no_weight_decay is True and blk.D._no_weight_decay is True
    bound = blk.dt_rank**-0.5
    assert blk.dt_proj.weight.abs().max() <= bound
    dt = F.softplus(blk.dt_proj.bias)
    assert dt.min() >= 0.002 * (1 - 1e-4) and dt.max() <= 0.05 * (1 + 1e-4)
    assert dt.std() > 0  # sampled, not constant


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"d_in": 0}, "d_in"),
        ({"d_in": 2.5}, "d_in"),
        ({"d_out": -1}, "d_out"),
        ({"d_state": 0}, "d_state"),
        ({"d_state": True}, "d_state"),
        ({"d_conv": 0}, "d_conv"),
        ({"expand": 0}, "expand"),
        ({"dt_rank": 0}, "dt_rank"),
        ({"dt_rank": "big"}, "dt_rank"),
        ({"dt_min": 0.0}, "dt_min"),
        ({"dt_max": -1.0}, "dt_max"),
        ({"dt_min": 0.5, "dt_max": 0.1}, "dt_min"),
        ({"dt_init_floor": 0}, "dt_init_floor"),
        ({"use_fast_path": "sometimes"}, "use_fast_path"),
        ({"use_fast_path": True}, "use_fast_path"),
        ({"layer_idx": -1}, "layer_idx"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    args = {"d_in": 8, "d_out": 8, **kwargs}
    with pytest.raises(ValueError, match=name):
        MambaBlock(**args)


def test_cache_allocation_and_state_bytes():
    blk = MambaBlock(16, 16, d_state=8, d_conv=3)
    conv, ssm = blk.allocate_inference_cache(5)
    assert conv.shape == (5, 32, 3) and ssm.shape == (5, 32, 8)
    assert conv.dtype == ssm.dtype == torch.float32
    assert not conv.any() and not ssm.any()
    assert blk.state_bytes(5, torch.float32) == conv.nbytes + ssm.nbytes == 5 * 32 * 11 * 4
    conv16, ssm16 = blk.allocate_inference_cache(5, dtype=torch.bfloat16)
    assert conv16.dtype == torch.bfloat16 and ssm16.dtype == torch.float32  # the SSM state is a sum: float32
    assert blk.state_bytes(5, torch.bfloat16) == conv16.nbytes + ssm16.nbytes == 5 * 32 * (3 * 2 + 8 * 4)
    assert blk.bfloat16().allocate_inference_cache(5)[1].dtype == torch.float32  # bf16 weights too


def test_bf16_block_runs_and_stays_close_to_float32():
    blk = _block(dtype=torch.float32)
    hs = torch.randn(2, 9, 16)
    ref = blk(hs)
    out = blk.to(torch.bfloat16)(hs.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)


# --------------------------------------------------------------------------- fast path choice
def test_always_on_cpu_raises_runtime_error_naming_the_extra():
    blk = MambaBlock(8, 8, use_fast_path="always")  # constructing is fine; running is not
    with pytest.raises(RuntimeError, match=r"rfkit\[cuda\]"):
        blk(torch.randn(1, 3, 8))
    conv, ssm = blk.allocate_inference_cache(1)
    with pytest.raises(RuntimeError, match=r"rfkit\[cuda\]"):
        blk.step(torch.randn(1, 8), conv, ssm)


def _poisoned(name):
    def fn(*args, **kwargs):
        raise AssertionError(f"{name} must not be called on CPU")

    return fn


def _install_kernels(monkeypatch, fns):
    for name in ("selective_scan_fn", "causal_conv1d_fn", "causal_conv1d_update", "selective_state_update"):
        monkeypatch.setattr(rm, name, fns[name])


def test_auto_uses_pytorch_on_cpu_even_when_kernels_import(monkeypatch):
    _install_kernels(monkeypatch, {n: _poisoned(n) for n in (
        "selective_scan_fn", "causal_conv1d_fn", "causal_conv1d_update", "selective_state_update")})
    assert rm.fused_kernels_available()
    blk = _block(use_fast_path="auto")
    hs = torch.randn(1, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(blk(hs), _naive_block(blk, hs), **F64)
    conv, ssm = blk.allocate_inference_cache(1)
    blk.step(hs[:, 0], conv, ssm)
    # with kernels importable but CPU tensors, "always" names the device problem
    with pytest.raises(RuntimeError, match="CUDA"):
        MambaBlock(8, 8, use_fast_path="always")(torch.randn(1, 3, 8))


# Stand-ins with the upstream signatures and semantics, written independently in plain PyTorch,
# to check how the block calls the fused kernels (argument order, layouts, in-place state updates).
def _fake_causal_conv1d_fn(x, weight, bias=None, activation=None):
    # x (B, D, L), weight (D, W)
    W = weight.shape[1]
    out = F.conv1d(F.pad(x, (W - 1, 0)), weight[:, None, :], bias, groups=weight.shape[0])
    return F.silu(out) if activation in ("silu", "swish") else out


def _fake_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    # x (B, D), conv_state (B, D, W) updated in place
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], x[:, :, None]], dim=-1))
    out = (conv_state * weight).sum(-1) + (0 if bias is None else bias)
    return F.silu(out) if activation in ("silu", "swish") else out


def _fake_selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                            return_last_state=False):
    return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                              return_last_state=return_last_state)


def _fake_selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    # state (B, D, N) updated in place; x, dt, z (B, D); B, C (B, N)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    state.copy_(state * torch.exp(dt[:, :, None] * A) + (dt * x)[:, :, None] * B[:, None, :])
    out = (state * C[:, None, :]).sum(-1)
    if D is not None:
        out = out + D * x
    if z is not None:
        out = out * F.silu(z)
    return out


def test_fused_call_sites_with_stand_in_kernels(monkeypatch):
    _install_kernels(monkeypatch, {
        "selective_scan_fn": _fake_selective_scan_fn,
        "causal_conv1d_fn": _fake_causal_conv1d_fn,
        "causal_conv1d_update": _fake_causal_conv1d_update,
        "selective_state_update": _fake_selective_state_update,
    })
    blk = _block(use_fast_path="never")
    hs = torch.randn(2, 9, 16, dtype=torch.float64)
    ref, (conv_ref, ssm_ref) = blk(hs, return_states=True)
    monkeypatch.setattr(MambaBlock, "_fast", lambda self, t: True)  # pretend we are on CUDA
    out, (conv, ssm) = blk(hs, return_states=True)
    torch.testing.assert_close(out, ref, **F64)
    torch.testing.assert_close(conv, conv_ref, **F64)
    torch.testing.assert_close(ssm, ssm_ref, **F64)
    c, s = blk.allocate_inference_cache(2)
    outs = [blk.step(hs[:, t], c, s)[0] for t in range(9)]
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, **F64)
    torch.testing.assert_close(s, ssm_ref, **F64)


def test_path_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(rm, "_LOGGED_PATHS", set())
    blk = MambaBlock(8, 8, use_fast_path="never")
    with caplog.at_level(logging.INFO, logger="rfkit.models.mamba"):
        blk(torch.randn(1, 4, 8))
        blk(torch.randn(1, 4, 8))
        conv, ssm = blk.allocate_inference_cache(1)
        blk.step(torch.randn(1, 8), conv, ssm)
    msgs = [r.getMessage() for r in caplog.records if r.name == "rfkit.models.mamba"]
    assert msgs == ["mamba: pure-PyTorch scan"]


def _import_fresh_copy(monkeypatch, name="rfkit_mamba_isolated"):
    spec = importlib.util.spec_from_file_location(name, rm.__file__)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_import_works_without_optional_kernels(monkeypatch):
    for mod in ("mamba_ssm", "causal_conv1d"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import mod` raise ImportError
    mod = _import_fresh_copy(monkeypatch)
    assert mod.selective_scan_fn is None and mod.causal_conv1d_fn is None
    assert mod.causal_conv1d_update is None and mod.selective_state_update is None
    assert not mod.fused_kernels_available()
    assert mod.MambaBlock(8, 4)(torch.randn(1, 3, 8)).shape == (1, 3, 4)


def test_import_survives_a_broken_kernel_install(monkeypatch, tmp_path):
    # a compiled extension built against another CUDA fails with OSError, not ImportError
    for pkg in ("mamba_ssm", "causal_conv1d"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("raise OSError('libcudart.so.12: cannot open shared object file')\n")
        monkeypatch.delitem(sys.modules, pkg, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = _import_fresh_copy(monkeypatch, "rfkit_mamba_broken")
    assert not mod.fused_kernels_available()
    with pytest.raises(RuntimeError, match="libcudart") as info:
        mod.MambaBlock(8, 8, use_fast_path="always")(torch.randn(1, 2, 8))
    assert "rfkit[cuda]" in str(info.value)
    for pkg in ("mamba_ssm", "causal_conv1d"):
        sys.modules.pop(pkg, None)


# --------------------------------------------------------------------------- prefix-sum scan
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_init", [False, True])
def test_prefix_matches_reference_outputs_and_grads(dtype, with_init):
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]
    for length in (1, 5, 31, 64, 100):
        tensors = _scan_inputs(2, 3, 4, length, dtype, seed=length)
        y_ref, h_ref, g_ref = _outputs_and_grads(selective_scan_ref, tensors, softplus=True, with_init=with_init)
        for chunk in (None, 1, 4, 64):
            y, h, g = _outputs_and_grads(
                rs.selective_scan_prefix, tensors, softplus=True, with_init=with_init, chunk_size=chunk
            )
            ctx = f"L={length} chunk={chunk} {dtype} init={with_init}"
            assert y.dtype == dtype
            torch.testing.assert_close(y, y_ref, **_tol(dtype), msg=lambda m: f"y {ctx}: {m}")
            torch.testing.assert_close(h, h_ref, **_tol(dtype), msg=lambda m: f"state {ctx}: {m}")
            for name, a, b in zip(names, g, g_ref):
                torch.testing.assert_close(a, b, **_tol(dtype, grad=True), msg=lambda m: f"grad {name} {ctx}: {m}")


def test_prefix_chunk_length_shrinks_to_keep_exp_finite():
    delta = torch.full((1, 2, 256), 0.01)
    assert rs._prefix_chunk_size(delta, 16.0, 60.0, 256) == 64  # 64 * 0.01 * 16 = 10.2
    assert rs._prefix_chunk_size(delta * 20, 16.0, 60.0, 256) == 16  # 16 * 0.2 * 16 = 51.2
    assert rs._prefix_chunk_size(delta * 500, 16.0, 60.0, 256) is None  # one token: 80 > 60


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prefix_large_delta_times_A_falls_back_and_stays_exact(dtype, monkeypatch):
    # |delta * A| up to 80 (float32) / 800 (float64) per token: the prefix form would overflow
    # exp even for one token, so the exact pairwise scan must take over.
    delta_max = 5.0 if dtype == torch.float32 else 50.0
    tensors = _scan_inputs(2, 4, 6, 50, dtype, delta_max=delta_max, a_min=-16.0, seed=7)
    calls = []
    real = rs.selective_scan_chunked
    monkeypatch.setattr(rs, "selective_scan_chunked", lambda *a, **k: calls.append(1) or real(*a, **k))
    y_ref, h_ref = _run_scan(selective_scan_ref, tensors, softplus=False, with_init=True)
    y, h = _run_scan(rs.selective_scan_prefix, tensors, softplus=False, with_init=True)
    assert calls, "the exact fallback did not run"
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(h, h_ref, **_tol(dtype))


# --------------------------------------------------------------------------- compiled CPU kernel
from rfkit.ops import cpu_kernels  # noqa: E402

# Only a machine without a C compiler skips these; with one, a kernel that fails to build fails
# the tests (the kernel functions raise when it is unavailable).
needs_kernel = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on PATH to build the CPU kernel"
)


@needs_kernel
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("optional", [True, False])
def test_cpu_kernel_matches_reference(with_init, optional):
    for length in (1, 7, 130):
        u, delta, A, B, C, D, z, _, h0 = _scan_inputs(2, 5, 16, length, torch.float32, delta_max=0.5, seed=length)
        kw = {"D": D, "z": z} if optional else {}
        init = h0 if with_init else None
        ref = [t.double() for t in (u, delta, A, B, C)]
        y_ref, h_ref = selective_scan_ref(
            *ref,
            **{k: v.double() for k, v in kw.items()},
            initial_state=None if init is None else init.double(),
            return_last_state=True,
        )
        y, h = cpu_kernels.selective_scan_cpu(u, delta, A, B, C, initial_state=init, **kw)
        assert y.dtype == torch.float32 and y.shape == u.shape and h.shape == (2, 5, 16)
        torch.testing.assert_close(y.double(), y_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h.double(), h_ref, atol=1e-4, rtol=1e-4)
        if init is not None:
            assert not torch.equal(h, init)  # the given state is not updated in place


@needs_kernel
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "python-threads"])
def test_cpu_kernel_thread_split_equals_one_thread(openmp, monkeypatch):
    """The channels split over 3 threads: OpenMP's (this machine's build) or Python's (a build
    without OpenMP) give one thread's result, bit for bit."""
    if openmp and not cpu_kernels.openmp():
        pytest.fail("the CPU kernels were built without OpenMP on a machine whose compiler has it")
    monkeypatch.setitem(cpu_kernels._state, "openmp", openmp)
    u, delta, A, B, C, D, z, _, h0 = _scan_inputs(3, 7, 16, 600, torch.float32, delta_max=0.3, seed=3)
    torch.set_num_threads(1)
    y1, h1 = cpu_kernels.selective_scan_cpu(u, delta, A, B, C, D, z, h0)
    torch.set_num_threads(3)
    try:
        y3, h3 = cpu_kernels.selective_scan_cpu(u, delta, A, B, C, D, z, h0)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(y1, y3) and torch.equal(h1, h3)


@needs_kernel
def test_block_uses_the_inference_kernel_without_grad_and_the_training_kernel_with_it(monkeypatch, caplog):
    monkeypatch.setattr(rm, "_LOGGED_PATHS", set())
    calls = []
    real, real_train = rm.selective_scan_cpu, rm.selective_scan_cpu_train
    monkeypatch.setattr(rm, "selective_scan_cpu", lambda *a, **k: calls.append("inference") or real(*a, **k))
    monkeypatch.setattr(rm, "selective_scan_cpu_train", lambda *a, **k: calls.append("training") or real_train(*a, **k))
    blk = MambaBlock(8, 6, use_fast_path="auto")
    x = torch.randn(2, 11, 8)
    with caplog.at_level(logging.INFO, logger="rfkit.models.mamba"):
        train_out, train_states = blk(x, return_states=True)  # parameters need grad: the training kernel
        assert calls == ["training"]
        with torch.no_grad():
            out, states = blk(x, return_states=True)
    assert calls == ["training", "inference"]
    torch.testing.assert_close(out, train_out.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(states, train_states):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
    msgs = [r.getMessage() for r in caplog.records if r.name == "rfkit.models.mamba"]
    assert msgs == ["mamba: compiled CPU scan kernel (training, with its backward)", "mamba: compiled CPU scan kernel (inference)"]
    never = MambaBlock(8, 6, use_fast_path="never")
    never(x).sum().backward()
    with torch.no_grad():
        never(x)
    assert calls == ["training", "inference"]  # "never": the PyTorch scan both ways


def _train_scan_grads(fn, inputs, with_init, dtype):
    """(y, last state, then the gradient of every input) of ``fn`` for a fixed weighting of y and
    of the last state, inputs cast to ``dtype``."""
    xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    y, h = fn(*xs[:5], initial_state=xs[5] if with_init else None)
    wy = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y)
    wh = torch.linspace(-0.5, 0.7, h.numel(), dtype=torch.float64).view_as(h)
    ((y.double() * wy).sum() + (h.double() * wh).sum()).backward()
    return [y.double(), h.double()] + [x.grad.double() for x in xs]


@needs_kernel
@pytest.mark.parametrize("with_init", [False, True])
def test_cpu_training_scan_matches_the_reference_outputs_and_grads(with_init):
    """The C training scan (no D, no z) against the float64 sequential reference: outputs, last
    state and the gradients of u, delta, A, B, C and the initial state, through y and through the
    last state, at lengths inside one checkpoint chunk, on its edges and across several."""
    chunk = cpu_kernels.TRAIN_CHUNK
    for length in (1, chunk - 1, chunk, chunk + 1, 2 * chunk + 7):
        u, delta, A, B, C, _, _, _, h0 = _scan_inputs(2, 5, 16, length, torch.float64, delta_max=0.5, seed=length)
        inputs = [u, delta, A, B, C] + ([h0] if with_init else [])

        def reference(*xs, initial_state):
            return selective_scan_ref(*xs, initial_state=initial_state, return_last_state=True)

        want = _train_scan_grads(reference, inputs, with_init, torch.float64)
        got = _train_scan_grads(cpu_kernels.selective_scan_cpu_train, inputs, with_init, torch.float32)
        names = ["y", "last state", "du", "ddelta", "dA", "dB", "dC", "dh0"]
        for name, a, b in zip(names, got, want):
            assert b.abs().sum() > 0 or (name == "dA" and length == 1 and not with_init), name  # one token from h = 0: no decay term
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"length {length}, {name}: {m}")


@needs_kernel
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "python-threads"])
def test_cpu_training_scan_thread_split_equals_one_thread(openmp, monkeypatch):
    """Forward split over rows and backward over batch rows, on 3 threads (OpenMP's or Python's)
    give one thread's outputs and gradients bit for bit."""
    monkeypatch.setitem(cpu_kernels._state, "openmp", openmp and cpu_kernels.openmp())
    u, delta, A, B, C, _, _, _, h0 = _scan_inputs(3, 7, 8, 150, torch.float32, delta_max=0.3, seed=5)
    inputs = [u, delta, A, B, C, h0]
    torch.set_num_threads(1)
    one = _train_scan_grads(cpu_kernels.selective_scan_cpu_train, inputs, True, torch.float32)
    torch.set_num_threads(3)
    try:
        three = _train_scan_grads(cpu_kernels.selective_scan_cpu_train, inputs, True, torch.float32)
    finally:
        torch.set_num_threads(1)
    for a, b in zip(one, three):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_training_through_the_cpu_kernel_equals_the_pytorch_scan(dtype):
    """A block's loss and every gradient (input and parameters, D and the gate included) through
    the C training scan equal the PyTorch scan's ("never"), with a left-padding mask and a given
    state; every gradient comes in its tensor's dtype (bf16, or float32 for A_log and D)."""
    torch.manual_seed(0)
    blocks = {path: MambaBlock(8, 6, d_state=4, use_fast_path=path, dtype=dtype) for path in ("auto", "never")}
    blocks["never"].load_state_dict(blocks["auto"].state_dict())
    x = torch.randn(2, 45, 8, dtype=dtype)
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, :5] = False
    conv, ssm = blocks["auto"].allocate_inference_cache(2)
    ssm.normal_()
    grads = {}
    for path, blk in blocks.items():
        xs = x.clone().requires_grad_()
        out, (_, last) = blk(xs, ssm_state=ssm, mask=mask, return_states=True)
        (out.float().square().sum() + last.square().sum()).backward()
        grads[path] = [xs.grad] + [p.grad for _, p in blk.named_parameters()]
        assert xs.grad.dtype == dtype
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for name, a, b in zip(["input"] + [n for n, _ in blocks["auto"].named_parameters()], grads["auto"], grads["never"]):
        assert a.dtype == b.dtype and b.abs().sum() > 0, name  # each in its parameter's dtype
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"grad {name}: {m}")


def test_cpu_kernel_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("RFKIT_KERNELS_DIR", raising=False)  # the cache's own kernels/ (conftest shares one)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(cpu_kernels, "_state", {"lib": None, "tried": False, "error": None})
    with caplog.at_level(logging.WARNING, logger="rfkit.ops.cpu_kernels"):
        assert not cpu_kernels.available()
    assert "no C compiler" in cpu_kernels.unavailable_reason()
    assert any("using the PyTorch scan" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_kernels.selective_scan_cpu(*_scan_inputs(1, 2, 4, 3, torch.float32)[:5])
    blk = MambaBlock(4, 4)
    with torch.no_grad():
        assert torch.isfinite(blk(torch.randn(1, 5, 4))).all()  # the PyTorch scan ran instead
    assert not list(tmp_path.glob("kernels/*.so"))


def test_a_compiler_without_openmp_gets_the_kernels_without_it_and_is_not_asked_twice(monkeypatch, tmp_path):
    """A compiler that rejects -fopenmp (Apple's clang, for one) still builds the kernels, without
    OpenMP (the window prefill's jobs then run on Python threads); the rejected flags are
    remembered, so the next process does not run the failing build again."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler on this machine: the CPU kernels cannot be tested")
    calls = tmp_path / "calls.txt"
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(  # -O3 becomes -O0: which flags the build takes is the question here, not the code's speed
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        'case " $* " in *" -fopenmp "*) echo "unsupported option -fopenmp" >&2; exit 1;; esac\n'
        'n=$#\nfor a in "$@"; do [ "$a" = "-O3" ] && a=-O0; set -- "$@" "$a"; done\nshift $n\n'
        f'exec {cc} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RFKIT_KERNELS_DIR", raising=False)
    monkeypatch.setenv("CC", str(wrapper))
    for attempt in (1, 2):
        monkeypatch.setattr(cpu_kernels, "_state", {"lib": None, "tried": False, "error": None, "openmp": False})
        assert cpu_kernels.available() and not cpu_kernels.openmp()
        builds = calls.read_text().splitlines()
        assert [" -fopenmp " in f" {line} " for line in builds] == [True, False]  # each tried once, ever
    y, state = cpu_kernels.selective_scan_cpu(*_scan_inputs(1, 2, 4, 3, torch.float32)[:5])
    assert torch.isfinite(y).all()


def test_the_library_is_kept_under_rfkit_kernels_dir_else_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RFKIT_KERNELS_DIR", raising=False)
    assert cpu_kernels.kernels_dir() == tmp_path / "cache" / "kernels"
    monkeypatch.setenv("RFKIT_KERNELS_DIR", str(tmp_path / "shared"))
    assert cpu_kernels.kernels_dir() == tmp_path / "shared"
    path = cpu_kernels._library_path(["-fopenmp"])
    assert path.parent == tmp_path / "shared" and path.name.startswith("mamba_cpu-") and path.suffix == ".so"


def test_cpu_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("RFKIT_CPU_KERNEL", "0")
    assert not cpu_kernels.available()


@needs_kernel
@pytest.mark.parametrize("conv_bias", [True, False])
def test_cpu_decode_step_equals_the_pytorch_step(conv_bias):
    torch.manual_seed(0)
    blk = MambaBlock(12, 10, dt_rank=3, conv_bias=conv_bias).eval()
    with torch.no_grad():
        blk.dt_proj.bias.add_(torch.randn(blk.d_inner))  # include softplus' linear region (> 20) too
        blk.dt_proj.bias[0] = 25.0
        blk.out_proj.weight.normal_()
    x = torch.randn(3, 7, 12)
    states = {}
    for mode in ("auto", "never"):
        blk.use_fast_path = mode
        conv, ssm = blk.allocate_inference_cache(3)
        with torch.no_grad():
            outs = [blk.step(x[:, t], conv, ssm)[0] for t in range(7)]
        states[mode] = (torch.cat(outs, dim=1), conv, ssm)
    for a, b in zip(states["auto"], states["never"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert states["auto"][2].abs().sum() > 0


@needs_kernel
def test_cpu_decode_step_is_used_only_for_float32_without_grad(monkeypatch):
    calls = []
    real = rm.mamba_step_cpu
    monkeypatch.setattr(rm, "mamba_step_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    blk = MambaBlock(8, 8)
    conv, ssm = blk.allocate_inference_cache(1)
    blk.step(torch.randn(1, 8), conv, ssm)  # parameters need grad
    with torch.no_grad():
        blk.double().step(torch.randn(1, 8, dtype=torch.float64), *blk.allocate_inference_cache(1))
        assert not calls
        blk.float().step(torch.randn(1, 8), *blk.allocate_inference_cache(1))
    assert calls == [1]


def test_prefill_states_are_contiguous_for_the_in_place_decode_step():
    blk = MambaBlock(8, 8)
    with torch.no_grad():
        _, (conv, ssm) = blk(torch.randn(2, 5, 8), return_states=True)
    assert conv.is_contiguous() and ssm.is_contiguous()
