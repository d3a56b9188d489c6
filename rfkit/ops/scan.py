"""Selective scans (the S6 recurrence of Mamba) in pure PyTorch.

* :func:`selective_scan_ref` -- the plain sequential recurrence, one Python iteration per token.
  It is the independent reference for the tests and is never used by the block.
* :func:`selective_scan_chunked` -- differentiable, loops over *chunks* of tokens only. Inside a
  chunk every state is obtained at once from pairwise decay weights built with a stable segment
  sum (no ``exp`` of a large positive number anywhere).
* :func:`selective_scan_prefix` -- differentiable prefix-sum form, O(L * D * N) work in a few
  large ops; the scan :class:`rfkit.models.mamba.MambaBlock` runs on CPU (with gradients) and on
  GPU without ``mamba_ssm``. Falls back to :func:`selective_scan_chunked` where it would overflow.

The compiled CPU kernel (inference only) is in :mod:`rfkit.ops.cpu_kernels`; the optional fused
CUDA kernels are chosen by the block itself.

Notation: ``B`` batch, ``L`` sequence length, ``D`` channels of the scan (``d_inner`` in the
block), ``N`` state size (``d_state``), ``T`` chunk length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Chunk length of selective_scan_chunked. Measured on the 2-core dev CPU (torch 2.13, float32),
# forward + backward of B=4, D=128, N=16, L=512 with D/z/softplus, best of 5 runs:
#     threads  chunk 8   chunk 16   chunk 32   chunk 64   (chunk 4)  | sequential selective_scan_ref
#        1     0.40 s    0.62 s     1.2 s      7.9 s      0.40 s     | 0.20 s   (load ~1)
#        2     0.34 s    0.41 s     2.6 s      6.9 s      0.36 s     | 0.23 s   (load ~0.3)
#        1     0.35 s    0.51 s     1.7 s      6.7 s      0.31 s     | 0.19 s   (load ~3)
#        2     0.99 s    1.2 s      8.4 s      10.1 s     1.4 s      | 0.98 s   (load ~3: OpenMP contention)
# The work per chunk grows as B*D*T*T*N and large chunks also pay for fresh multi-100-MB
# allocations, so small chunks win on CPU; 8 is the fastest of 8/16/32/64 in every run. (On CPU
# the chunked scan is not faster than the token loop; what it buys is autograd through a few
# large ops per chunk instead of a few small ops per token, which matters on GPU.)
DEFAULT_CHUNK_SIZE = 8


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a scan computes in for inputs of ``dtype``."""
    # float64 stays float64 (tests); everything else (bf16, fp16, fp32) is computed in float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_scan_shapes(u, delta, A, B, C, D, z, delta_bias, initial_state) -> None:
    if u.dim() != 3:
        raise ValueError(f"u must be (batch, dim, length), got shape {tuple(u.shape)}")
    bsz, dim, length = u.shape
    if delta.shape != u.shape:
        raise ValueError(f"delta must have the shape of u {tuple(u.shape)}, got {tuple(delta.shape)}")
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must be (dim={dim}, d_state), got shape {tuple(A.shape)}")
    n = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (bsz, n, length):
            raise ValueError(f"{name} must be (batch, d_state, length) = {(bsz, n, length)}, got {tuple(t.shape)}")
    if D is not None and tuple(D.shape) != (dim,):
        raise ValueError(f"D must be (dim,) = ({dim},), got {tuple(D.shape)}")
    if z is not None and z.shape != u.shape:
        raise ValueError(f"z must have the shape of u {tuple(u.shape)}, got {tuple(z.shape)}")
    if delta_bias is not None and tuple(delta_bias.shape) != (dim,):
        raise ValueError(f"delta_bias must be (dim,) = ({dim},), got {tuple(delta_bias.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (bsz, dim, n):
        raise ValueError(
            f"initial_state must be (batch, dim, d_state) = {(bsz, dim, n)}, got {tuple(initial_state.shape)}"
        )


def _prepare_delta(delta, delta_bias, delta_softplus, cdt):
    delta = delta.to(cdt)  # (B, D, L)
    if delta_bias is not None:
        delta = delta + delta_bias.to(cdt)[None, :, None]
    if delta_softplus:
        delta = F.softplus(delta)
    return delta


def _finish_output(y, u, D, z, cdt):
    # y (B, D, L) in cdt -> skip connection, gate
    if D is not None:
        y = y + D.to(cdt)[None, :, None] * u
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y


def selective_scan_ref(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_last_state=False,
):
    """Sequential selective scan, one Python iteration per token (test reference only).

    u, delta: (B, D, L); A: (D, N); B, C: (B, N, L); D: (D,); z: (B, D, L);
    delta_bias: (D,); initial_state: (B, D, N).

        h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t
        y_t = <C_t, h_t> + D * u_t,   then y = y * silu(z) when z is given

    Returns y (B, D, L) in u's dtype, and the last state (B, D, N) in the compute dtype (float32,
    or float64 for float64 inputs) when ``return_last_state``.
    """
    _check_scan_shapes(u, delta, A, B, C, D, z, delta_bias, initial_state)
    in_dtype = u.dtype
    cdt = compute_dtype(in_dtype)
    bsz, dim, length = u.shape
    n = A.shape[1]
    uf = u.to(cdt)
    delta = _prepare_delta(delta, delta_bias, delta_softplus, cdt)
    A, B, C = A.to(cdt), B.to(cdt), C.to(cdt)
    if initial_state is None:
        h = u.new_zeros((bsz, dim, n), dtype=cdt)  # (B, D, N)
    else:
        h = initial_state.to(cdt)
    ys = []
    for t in range(length):
        d_t = delta[:, :, t]  # (B, D)
        decay = torch.exp(d_t[:, :, None] * A[None])  # (B, D, N)
        inp = (d_t * uf[:, :, t])[:, :, None] * B[:, None, :, t]  # (B, D, N)
        h = decay * h + inp
        ys.append((h * C[:, None, :, t]).sum(-1))  # (B, D)
    y = torch.stack(ys, dim=-1) if ys else uf.new_zeros((bsz, dim, 0))  # (B, D, L)
    y = _finish_output(y, uf, D, z, cdt).to(in_dtype)
    return (y, h) if return_last_state else y


def _segsum(delta):
    """Stable segment sums of delta inside a chunk.

    delta (..., T) -> (..., T, T) with out[t, s] = sum_{k=s+1..t} delta_k for s <= t and exactly 0
    for s > t. Built with a masked cumsum rather than cum[t] - cum[s], so no cancellation.
    """
    T = delta.shape[-1]
    rep = delta[..., :, None].expand(*delta.shape, T)  # rep[..., k, s] = delta_k
    strict_lower = torch.ones(T, T, dtype=torch.bool, device=delta.device).tril(-1)  # k > s
    return torch.cumsum(rep.masked_fill(~strict_lower, 0.0), dim=-2)


def selective_scan_chunked(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_last_state=False,
    chunk_size: int | None = None,
):
    """Selective scan in pure PyTorch, parallel inside chunks, sequential over chunks only.

    Same arguments and results as :func:`selective_scan_ref`; differentiable w.r.t. every tensor
    argument. Computes in float32 (float64 for float64 inputs) and returns y in u's dtype; the
    last state is returned in the compute dtype.

    Inside a chunk of T tokens with seg[t, s] = delta_{s+1} + ... + delta_t (s <= t):

        h_t = sum_{s<=t} exp(A * seg[t, s]) * delta_s * B_s * u_s + exp(A * cum_t) * h_prev
        y_t = <C_t, h_t>

    The pairwise weights exp(A * seg) for s > t are exp(0) = 1 (seg is exactly 0 there, never a
    large number) and are cancelled by applying the causal mask to the small (B, T, T, N) product
    C_t * B_s instead of to the (B, D, T, T, N) weights, which is ~1.5-2.5x faster on CPU than a
    -inf mask on the large tensor. For A <= 0 and delta >= 0 (always the case in Mamba) every
    exponent is <= 0.
    """
    _check_scan_shapes(u, delta, A, B, C, D, z, delta_bias, initial_state)
    T = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
    if T < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    in_dtype = u.dtype
    cdt = compute_dtype(in_dtype)
    bsz, dim, length = u.shape
    n = A.shape[1]
    uf = u.to(cdt)  # (B, D, L)
    delta = _prepare_delta(delta, delta_bias, delta_softplus, cdt)  # (B, D, L)
    A = A.to(cdt)  # (D, N)
    Bt = B.to(cdt).transpose(1, 2)  # (B, L, N)
    Ct = C.to(cdt).transpose(1, 2)  # (B, L, N)
    A_pair = A[:, None, None, :]  # (D, 1, 1, N)
    x = delta * uf  # (B, D, L): the input delta_s * u_s (B_s applied below)
    causal = torch.ones(T, T, dtype=torch.bool, device=u.device).tril()  # [t, s]: s <= t

    h = None if initial_state is None else initial_state.to(cdt)  # (B, D, N)
    ys = []
    for c0 in range(0, length, T):
        c1 = min(c0 + T, length)
        t = c1 - c0
        d_c = delta[:, :, c0:c1]  # (B, D, t)
        x_c = x[:, :, c0:c1]  # (B, D, t)
        B_c = Bt[:, c0:c1]  # (B, t, N)
        C_c = Ct[:, c0:c1]  # (B, t, N)

        seg = _segsum(d_c)  # (B, D, t, t)
        W = torch.exp(seg[..., None] * A_pair)  # (B, D, t, t, N); 1 where s > t (masked via CB)
        CB = C_c[:, :, None, :] * B_c[:, None, :, :]  # (B, t, t, N): C_t * B_s
        CB = CB.masked_fill(~causal[:t, :t, None], 0.0)
        M = (W * CB[:, None]).sum(-1)  # (B, D, t, t)
        y_c = torch.einsum("bdts,bds->bdt", M, x_c)  # (B, D, t)

        # state at the end of the chunk from the chunk's inputs (last row of W is fully causal)
        h_in = torch.einsum("bdsn,bds,bsn->bdn", W[:, :, -1], x_c, B_c)  # (B, D, N)
        if h is None:
            h = h_in
        else:
            cum = torch.cumsum(d_c, dim=-1)  # (B, D, t), inclusive
            carry = torch.exp(cum[..., None] * A[:, None, :])  # (B, D, t, N): decay of h_prev
            y_c = y_c + torch.einsum("bdtn,btn,bdn->bdt", carry, C_c, h)
            h = h_in + carry[:, :, -1] * h
        ys.append(y_c)

    if ys:
        y = torch.cat(ys, dim=-1)  # (B, D, L)
    else:
        y = uf.new_zeros((bsz, dim, 0))
    if h is None:  # L == 0
        h = uf.new_zeros((bsz, dim, n))
    y = _finish_output(y, uf, D, z, cdt).to(in_dtype)
    return (y, h) if return_last_state else y


# Largest exponent the prefix-sum scan lets exp() see, per compute dtype (exp overflows at ~88.7
# in float32 and ~709.8 in float64); the margin leaves room for the sums of many such terms.
_PREFIX_EXP_LIMIT = {torch.float32: 60.0, torch.float64: 600.0}
PREFIX_CHUNK_SIZES = (64, 32, 16, 8, 4, 2, 1)


def _prefix_chunk_size(delta, neg_a_max: float, limit: float, length: int) -> int | None:
    """Largest chunk length whose decay exponents (chunk sum of delta times max |A|) stay within
    ``limit``; None when even single tokens exceed it."""
    for T in PREFIX_CHUNK_SIZES:
        if T > 1 and T >= 2 * length:
            continue
        pad = (-length) % T
        d = F.pad(delta, (0, pad)) if pad else delta
        worst = d.reshape(*d.shape[:-1], -1, T).sum(-1).amax().item() if d.numel() else 0.0
        if worst * neg_a_max <= limit:
            return T
    return None


def selective_scan_prefix(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_last_state=False,
    chunk_size: int | None = None,
):
    """Selective scan in pure PyTorch as prefix sums: O(L * D * N) work in a few large ops.

    Same arguments and results as :func:`selective_scan_ref`; differentiable. This is the scan
    the block runs on CPU (and on GPU without mamba_ssm). Inside a chunk of T tokens, with
    a_t = delta_1 + ... + delta_t counted from the chunk start and E_t = exp(-A * a_t) >= 1::

        h_t = (h_0 + sum_{s<=t} E_s * delta_s * B_s * u_s) / E_t

    which is one ``cumsum`` over all chunks at once; only the chunk-start states h_0 are carried
    sequentially, one small (B, D, N) update per chunk. Rounding stays relative to the newest
    term, so the sum is as accurate as the recurrence, as long as E never overflows: the chunk
    length (``chunk_size`` or the largest of 64, 32, ..., 1 that fits) is chosen so that
    max|A| * (sum of delta over a chunk) stays below 60 in float32 (600 in float64). When even
    single tokens exceed that, it falls back to :func:`selective_scan_chunked`, which has no
    such limit but does O(T) times more work.
    """
    _check_scan_shapes(u, delta, A, B, C, D, z, delta_bias, initial_state)
    in_dtype = u.dtype
    cdt = compute_dtype(in_dtype)
    bsz, dim, length = u.shape
    n = A.shape[1]
    delta_f = _prepare_delta(delta, delta_bias, delta_softplus, cdt)  # (B, D, L)
    neg_a = -A.to(cdt)  # (D, N), >= 0 in Mamba
    limit = _PREFIX_EXP_LIMIT[cdt]
    neg_a_max = float(neg_a.detach().amax()) if neg_a.numel() else 0.0
    if neg_a.numel() and float(neg_a.detach().amin()) < 0:
        T = None  # a growing mode (A > 0) has no overflow-free prefix form
    elif chunk_size is not None:
        T = check_positive_int("chunk_size", chunk_size)
        worst = _prefix_chunk_size(delta_f.detach(), neg_a_max, limit, length)
        T = T if worst is not None and T <= worst else worst
    else:
        T = _prefix_chunk_size(delta_f.detach(), neg_a_max, limit, length)
    if T is None:
        return selective_scan_chunked(
            u, delta_f, A, B, C, D, z, initial_state=initial_state, return_last_state=return_last_state
        )

    uf = u.to(cdt)
    pad = (-length) % T
    nc = (length + pad) // T
    # Padded tokens have delta = 0 and no input: they neither decay nor change the state.
    d = F.pad(delta_f, (0, pad)).view(bsz, dim, nc, T)  # (B, D, nc, T)
    x = F.pad(delta_f * uf, (0, pad)).view(bsz, dim, nc, T)  # (B, D, nc, T): delta_s * u_s
    Bt = F.pad(B.to(cdt), (0, pad)).view(bsz, n, nc, T).permute(0, 2, 3, 1)  # (B, nc, T, N)
    Ct = F.pad(C.to(cdt), (0, pad)).view(bsz, n, nc, T).permute(0, 2, 3, 1)  # (B, nc, T, N)

    a = torch.cumsum(d, dim=-1)  # (B, D, nc, T), inclusive, from the chunk start
    E = torch.exp(a[..., None] * neg_a[:, None, None, :])  # (B, D, nc, T, N), in [1, e^limit]
    S = torch.cumsum(E * x[..., None] * Bt[:, None], dim=-2)  # (B, D, nc, T, N)

    h = uf.new_zeros((bsz, dim, n)) if initial_state is None else initial_state.to(cdt)  # (B, D, N)
    starts = []
    E_end, S_end = E[:, :, :, -1], S[:, :, :, -1]  # (B, D, nc, N)
    for c in range(nc):
        starts.append(h)
        h = (h + S_end[:, :, c]) / E_end[:, :, c]
    H0 = torch.stack(starts, dim=2)  # (B, D, nc, N): state before each chunk
    H = (S + H0[:, :, :, None]) / E  # (B, D, nc, T, N): every state
    y = torch.einsum("bdctn,bctn->bdct", H, Ct).reshape(bsz, dim, nc * T)[:, :, :length]  # (B, D, L)
    y = _finish_output(y, uf, D, z, cdt).to(in_dtype)
    return (y, h) if return_last_state else y


def check_positive_int(name: str, value) -> int:
    """``value`` if it is an int >= 1 (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value

