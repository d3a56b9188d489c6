"""Mamba (S6) block used to replace attention heads, plus the selective-scan kernels behind it.

Two implementations of the selective scan live here:

* :func:`selective_scan_ref` -- the plain sequential recurrence, one Python iteration per token.
  It is the independent reference for the tests and is never used by the block.
* :func:`selective_scan_chunked` -- pure PyTorch, differentiable, loops over *chunks* of tokens
  only. Inside a chunk every state is obtained at once from pairwise decay weights built with a
  stable segment sum (no ``exp`` of a large positive number anywhere).

When the optional CUDA packages are installed (``pip install rfkit[cuda]``: ``mamba_ssm`` and
``causal_conv1d``) and the tensors live on a GPU, :class:`MambaBlock` can use their fused
kernels instead. Importing this module never requires them.

Notation: ``B`` batch, ``L`` sequence length, ``D`` channels of the scan (``d_inner`` in the
block), ``N`` state size (``d_state``), ``T`` chunk length.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from rfkit.ops import cpu_kernels
from rfkit.ops.cpu_kernels import mamba_step_cpu, selective_scan_cpu

log = logging.getLogger(__name__)

# Optional fused kernels. Any failure while importing them (missing package, CUDA/ABI mismatch
# of the compiled extension, broken triton) only disables the fast path.
_FUSED_IMPORT_ERRORS: list[str] = []
try:
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
except Exception as exc:  # noqa: BLE001 - an optional accelerator must never break the import
    selective_scan_fn = None
    _FUSED_IMPORT_ERRORS.append(f"mamba_ssm.selective_scan_fn: {type(exc).__name__}: {exc}")
try:
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
except Exception as exc:  # noqa: BLE001
    causal_conv1d_fn = None
    causal_conv1d_update = None
    _FUSED_IMPORT_ERRORS.append(f"causal_conv1d: {type(exc).__name__}: {exc}")
try:
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
except Exception as exc:  # noqa: BLE001
    selective_state_update = None
    _FUSED_IMPORT_ERRORS.append(f"mamba_ssm.selective_state_update: {type(exc).__name__}: {exc}")

FAST_PATH_CHOICES = ("auto", "always", "never")

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

_LOGGED_PATHS: set[str] = set()
_MSG_FUSED = "mamba: fused CUDA kernels (mamba_ssm)"
_MSG_TORCH = "mamba: pure-PyTorch scan"
_MSG_CPU = "mamba: compiled CPU scan kernel (inference)"


def fused_kernels_available() -> bool:
    """True when every optional fused kernel imported."""
    return (
        selective_scan_fn is not None
        and causal_conv1d_fn is not None
        and causal_conv1d_update is not None
        and selective_state_update is not None
    )


def _log_path_once(message: str) -> None:
    # One info line per process for each path that actually runs.
    if message not in _LOGGED_PATHS:
        _LOGGED_PATHS.add(message)
        log.info(message)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
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
    cdt = _compute_dtype(in_dtype)
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
    cdt = _compute_dtype(in_dtype)
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
    cdt = _compute_dtype(in_dtype)
    bsz, dim, length = u.shape
    n = A.shape[1]
    delta_f = _prepare_delta(delta, delta_bias, delta_softplus, cdt)  # (B, D, L)
    neg_a = -A.to(cdt)  # (D, N), >= 0 in Mamba
    limit = _PREFIX_EXP_LIMIT[cdt]
    neg_a_max = float(neg_a.detach().amax()) if neg_a.numel() else 0.0
    if neg_a.numel() and float(neg_a.detach().amin()) < 0:
        T = None  # a growing mode (A > 0) has no overflow-free prefix form
    elif chunk_size is not None:
        T = _check_positive_int("chunk_size", chunk_size)
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


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class MambaBlock(nn.Module):
    """Mamba (S6) mixer mapping (B, L, d_in) -> (B, L, d_out).

    Layout and initialisation follow the reference Mamba block (``in_proj`` -> depthwise causal
    ``conv1d`` + SiLU -> ``x_proj`` -> ``dt_proj`` -> selective scan gated by SiLU(z) ->
    ``out_proj``), with separate input and output widths so a block can stand in for a subset of
    attention heads.

    Args:
        d_in, d_out: input / output feature sizes.
        d_state: SSM state size N. d_conv: causal conv kernel size. expand: d_inner = expand * d_in.
        dt_rank: rank of the delta projection, or "auto" = ceil(d_in / 16).
        dt_min, dt_max, dt_init_floor: range of the initial step sizes (log-uniform) and floor.
        conv_bias: bias of the conv. bias: bias of in_proj / out_proj.
        use_fast_path: "auto" (fused kernels when installed and on CUDA), "always" (fused or a
            RuntimeError), "never" (pure PyTorch).
        layer_idx: optional index of the layer (for caches).
        chunk_size: chunk length of the PyTorch scan (default :data:`DEFAULT_CHUNK_SIZE`).
        device, dtype: factory arguments for the parameters.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min=0.001,
        dt_max=0.1,
        dt_init_floor=1e-4,
        conv_bias=True,
        bias=False,
        use_fast_path: str = "auto",
        layer_idx: int | None = None,
        *,
        chunk_size: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.d_in = _check_positive_int("d_in", d_in)
        self.d_out = _check_positive_int("d_out", d_out)
        self.d_state = _check_positive_int("d_state", d_state)
        self.d_conv = _check_positive_int("d_conv", d_conv)
        self.expand = _check_positive_int("expand", expand)
        if dt_rank == "auto":
            dt_rank = math.ceil(d_in / 16)
        elif isinstance(dt_rank, str):
            raise ValueError(f"dt_rank must be a positive int or 'auto', got {dt_rank!r}")
        self.dt_rank = _check_positive_int("dt_rank", dt_rank)
        dt_min = _check_positive_float("dt_min", dt_min)
        dt_max = _check_positive_float("dt_max", dt_max)
        if dt_min > dt_max:
            raise ValueError(f"dt_min must be <= dt_max, got dt_min={dt_min!r} > dt_max={dt_max!r}")
        dt_init_floor = _check_positive_float("dt_init_floor", dt_init_floor)
        if use_fast_path not in FAST_PATH_CHOICES:
            raise ValueError(f"use_fast_path must be one of {FAST_PATH_CHOICES}, got {use_fast_path!r}")
        if layer_idx is not None and (isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0):
            raise ValueError(f"layer_idx must be None or a non-negative int, got {layer_idx!r}")
        if chunk_size is not None:
            _check_positive_int("chunk_size", chunk_size)
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        self.chunk_size = chunk_size
        self.d_inner = self.expand * self.d_in
        fk = {"device": device, "dtype": dtype}

        self.in_proj = nn.Linear(self.d_in, 2 * self.d_inner, bias=bias, **fk)
        self.conv1d = nn.Conv1d(
            self.d_inner,
            self.d_inner,
            kernel_size=self.d_conv,
            groups=self.d_inner,
            padding=self.d_conv - 1,
            bias=conv_bias,
            **fk,
        )
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False, **fk)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **fk)
        self.out_proj = nn.Linear(self.d_inner, self.d_out, bias=bias, **fk)

        # A = -exp(A_log) with A_log[d, n] = log(n + 1): the S4D-real initialisation.
        a = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=device)
        self.A_log = nn.Parameter(torch.log(a).repeat(self.d_inner, 1))  # (d_inner, d_state)
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))  # (d_inner,)
        self.D._no_weight_decay = True

        self._init_dt_proj(dt_min, dt_max, dt_init_floor)

    @torch.no_grad()
    def _init_dt_proj(self, dt_min: float, dt_max: float, dt_init_floor: float) -> None:
        std = self.dt_rank**-0.5
        nn.init.uniform_(self.dt_proj.weight, -std, std)
        # dt log-uniform in [dt_min, dt_max], floored; bias = softplus^-1(dt) = dt + log(1 - exp(-dt))
        w = self.dt_proj.weight
        u = torch.rand(self.d_inner, device=w.device, dtype=torch.float32)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))
        self.dt_proj.bias.copy_(inv_dt)
        self.dt_proj.bias._no_reinit = True

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in}, d_out={self.d_out}, d_inner={self.d_inner}, d_state={self.d_state}, "
            f"d_conv={self.d_conv}, dt_rank={self.dt_rank}, use_fast_path={self.use_fast_path!r}"
        )

    # ------------------------------------------------------------------ path choice
    def _fast(self, ref: torch.Tensor) -> bool:
        """Whether the fused kernels run for a tensor on ref's device; logs the path once."""
        if self.use_fast_path == "never":
            fast = False
        elif self.use_fast_path == "auto":
            fast = fused_kernels_available() and ref.is_cuda
        else:  # "always"
            if not fused_kernels_available():
                raise RuntimeError(
                    "MambaBlock(use_fast_path='always') needs the fused Mamba kernels, which could not be "
                    "imported (" + "; ".join(_FUSED_IMPORT_ERRORS) + "). Install them with "
                    "`pip install rfkit[cuda]` (mamba-ssm, causal-conv1d; needs a CUDA GPU) or use "
                    "use_fast_path='auto' or 'never'."
                )
            if not ref.is_cuda:
                raise RuntimeError(
                    f"MambaBlock(use_fast_path='always') needs CUDA tensors for the fused kernels "
                    f"(`pip install rfkit[cuda]`), got a tensor on {ref.device}; move the model to a GPU or "
                    f"use use_fast_path='auto' or 'never'."
                )
            fast = True
        if fast:
            _log_path_once(_MSG_FUSED)
        return fast

    def _cpu_kernel(self, ref: torch.Tensor, inputs: torch.Tensor) -> bool:
        """Whether the compiled CPU scan runs: CPU, float32/16 (not float64), no gradient needed,
        use_fast_path != "never", and the kernel built (see :mod:`rfkit.ops.cpu_kernels`)."""
        if self.use_fast_path == "never" or ref.device.type != "cpu" or ref.dtype == torch.float64:
            return False
        if torch.is_grad_enabled() and (inputs.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        if not cpu_kernels.available():
            return False
        _log_path_once(_MSG_CPU)
        return True

    def _cpu_step(self, ref: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> bool:
        """Whether the compiled CPU decode step runs: as :meth:`_cpu_kernel`, plus float32
        weights and contiguous float32 states (the kernel updates them in place)."""
        tensors = (
            conv_state, ssm_state, self.conv1d.weight, self.x_proj.weight, self.dt_proj.weight, self.dt_proj.bias,
            self.A_log, self.D,
        )  # fmt: skip
        for t in tensors:
            if t.dtype != torch.float32 or not t.is_contiguous():
                return False
        bias = self.conv1d.bias
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return False
        return self._cpu_kernel(ref, ref)

    # ------------------------------------------------------------------ caches
    def allocate_inference_cache(self, batch_size: int, dtype=None, device=None):
        """Zero (conv_state (B, d_inner, d_conv), ssm_state (B, d_inner, d_state)).

        dtype defaults to the conv weight's dtype for the conv state and the dt_proj weight's
        dtype for the SSM state; device to the parameters' device.
        """
        device = self.conv1d.weight.device if device is None else device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self.dt_proj.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def state_bytes(self, batch_size: int, dtype=torch.float32) -> int:
        """Bytes of one (conv_state, ssm_state) pair for batch_size sequences stored in dtype."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return int(batch_size) * self.d_inner * (self.d_conv + self.d_state) * itemsize

    # ------------------------------------------------------------------ forward
    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]  # (d_inner, d_conv)

    def forward(self, hidden_states, conv_state=None, ssm_state=None, mask=None, return_states=False):
        """hidden_states (B, L, d_in) -> (B, L, d_out) [, (conv_state, ssm_state)].

        conv_state (B, d_inner, d_conv) / ssm_state (B, d_inner, d_state): continue from a previous
        chunk (not modified in place). mask (B, L), 1/True for real tokens: masked positions
        (left padding) feed zeros to the conv and use delta = 0, so they leave the state untouched;
        their outputs are meaningless. Only left padding gives the same states as the unpadded
        sequence (a masked position in the middle still shifts the conv window).
        With return_states, also returns the new states: conv_state = the last d_conv conv inputs
        (zero-padded on the left / continued from the old conv_state), ssm_state = last h, in the
        dtype of the given states (else the parameters' dtype).
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.d_in:
            raise ValueError(f"hidden_states must be (batch, length, {self.d_in}), got {tuple(hidden_states.shape)}")
        bsz, length, _ = hidden_states.shape
        if mask is not None and tuple(mask.shape) != (bsz, length):
            raise ValueError(f"mask must be (batch, length) = {(bsz, length)}, got {tuple(mask.shape)}")
        for name, st, last in (("conv_state", conv_state, self.d_conv), ("ssm_state", ssm_state, self.d_state)):
            if st is not None and tuple(st.shape) != (bsz, self.d_inner, last):
                raise ValueError(f"{name} must be {(bsz, self.d_inner, last)}, got {tuple(st.shape)}")
        fast = self._fast(hidden_states)

        xz = self.in_proj(hidden_states).transpose(1, 2)  # (B, 2*d_inner, L)
        x, z = xz.chunk(2, dim=1)  # (B, d_inner, L) each
        m = None
        if mask is not None:
            m = mask.to(device=x.device, dtype=x.dtype)[:, None, :]  # (B, 1, L)
            x = x * m  # masked positions feed zeros to the conv

        # --- causal depthwise conv + SiLU
        weight = self._conv_weight()  # (d_inner, d_conv)
        if fast and conv_state is None:
            xc = causal_conv1d_fn(x.contiguous(), weight, self.conv1d.bias, activation="silu")  # (B, d_inner, L)
        else:
            if conv_state is None:
                prev = x.new_zeros((bsz, self.d_inner, self.d_conv - 1))
            else:
                prev = conv_state[:, :, 1:].to(x.dtype)  # (B, d_inner, d_conv-1)
            xpad = torch.cat([prev, x], dim=-1)  # (B, d_inner, d_conv-1+L)
            xc = F.silu(F.conv1d(xpad, self.conv1d.weight, self.conv1d.bias, groups=self.d_inner))  # (B, d_inner, L)
        new_conv_state = None
        if return_states:
            old = conv_state.to(x.dtype) if conv_state is not None else x.new_zeros((bsz, self.d_inner, self.d_conv))
            new_conv_state = torch.cat([old, x[:, :, -self.d_conv :]], dim=-1)[:, :, -self.d_conv :].contiguous()
            new_conv_state = new_conv_state.to(conv_state.dtype if conv_state is not None else self.conv1d.weight.dtype)

        # --- input-dependent SSM parameters
        x_dbl = self.x_proj(xc.transpose(1, 2))  # (B, L, dt_rank + 2N)
        dt, Bm, Cm = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight, self.dt_proj.bias)  # (B, L, d_inner)
        cdt = _compute_dtype(dt.dtype)  # float32 (float64 for a float64 block)
        delta = F.softplus(dt.to(cdt)).transpose(1, 2)  # (B, d_inner, L)
        if m is not None:
            delta = delta * m.to(cdt)  # delta = 0: exp(0*A) = 1 and no input -> state passes through
        Bm = Bm.transpose(1, 2).contiguous()  # (B, N, L)
        Cm = Cm.transpose(1, 2).contiguous()  # (B, N, L)
        A = -torch.exp(self.A_log.to(cdt))  # (d_inner, N)
        D = self.D.to(cdt)

        if fast and ssm_state is None:
            res = selective_scan_fn(
                xc.contiguous(),
                delta.to(xc.dtype).contiguous(),
                A,
                Bm,
                Cm,
                D,
                z=z.contiguous(),
                delta_bias=None,
                delta_softplus=False,
                return_last_state=return_states,
            )
        elif self._cpu_kernel(xc, hidden_states):
            y, last = selective_scan_cpu(xc, delta, A, Bm, Cm, D, z=z, initial_state=ssm_state)
            res = (y.to(xc.dtype), last) if return_states else y.to(xc.dtype)
        else:
            _log_path_once(_MSG_TORCH)
            res = selective_scan_prefix(
                xc,
                delta,
                A,
                Bm,
                Cm,
                D,
                z=z,
                initial_state=ssm_state,
                return_last_state=return_states,
                chunk_size=self.chunk_size,
            )
        if return_states:
            y, last = res
            last = last.to(ssm_state.dtype if ssm_state is not None else self.dt_proj.weight.dtype)
        else:
            y = res
        out = self.out_proj(y.to(hidden_states.dtype).transpose(1, 2))  # (B, L, d_out)
        if return_states:
            return out, (new_conv_state, last)
        return out

    # ------------------------------------------------------------------ decoding
    def step(self, hidden_states, conv_state, ssm_state):
        """Decode one token: hidden_states (B, 1, d_in) or (B, d_in) -> (out (B, 1, d_out), conv_state, ssm_state).

        conv_state (B, d_inner, d_conv) and ssm_state (B, d_inner, d_state) are updated in place
        (as the fused kernels do) and returned.
        """
        if hidden_states.dim() == 3:
            if hidden_states.shape[1] != 1:
                raise ValueError(f"step() takes one token, got hidden_states of shape {tuple(hidden_states.shape)}")
            hidden_states = hidden_states[:, 0]
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.d_in:
            raise ValueError(f"hidden_states must be (batch, 1, {self.d_in}) or (batch, {self.d_in}), got {tuple(hidden_states.shape)}")
        bsz = hidden_states.shape[0]
        if tuple(conv_state.shape) != (bsz, self.d_inner, self.d_conv):
            raise ValueError(f"conv_state must be {(bsz, self.d_inner, self.d_conv)}, got {tuple(conv_state.shape)}")
        if tuple(ssm_state.shape) != (bsz, self.d_inner, self.d_state):
            raise ValueError(f"ssm_state must be {(bsz, self.d_inner, self.d_state)}, got {tuple(ssm_state.shape)}")
        fast = self._fast(hidden_states)

        xz = self.in_proj(hidden_states)  # (B, 2*d_inner)
        if not fast and self._cpu_step(hidden_states, conv_state, ssm_state):
            y = mamba_step_cpu(self, xz, conv_state, ssm_state)  # (B, d_inner); states updated in place
            return self.out_proj(y.to(hidden_states.dtype))[:, None, :], conv_state, ssm_state
        x, z = xz.chunk(2, dim=-1)  # (B, d_inner) each
        weight = self._conv_weight()  # (d_inner, d_conv)
        cdt = _compute_dtype(x.dtype)
        A = -torch.exp(self.A_log.to(cdt))  # (d_inner, N)

        if not fast:
            _log_path_once(_MSG_TORCH)
        if fast:
            x = causal_conv1d_update(x, conv_state, weight, self.conv1d.bias, activation="silu")  # (B, d_inner)
        else:
            conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
            conv_state[:, :, -1] = x.to(conv_state.dtype)
            x = (conv_state.to(weight.dtype) * weight).sum(-1)  # (B, d_inner)
            if self.conv1d.bias is not None:
                x = x + self.conv1d.bias
            x = F.silu(x).to(z.dtype)

        x_db = self.x_proj(x)  # (B, dt_rank + 2N)
        dt, Bm, Cm = torch.split(x_db, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)  # (B, d_inner), bias added with the softplus

        if fast:
            y = selective_state_update(
                ssm_state, x, dt, A, Bm, Cm, self.D, z=z, dt_bias=self.dt_proj.bias, dt_softplus=True
            )  # (B, d_inner)
        else:
            delta = F.softplus(dt.to(cdt) + self.dt_proj.bias.to(cdt))  # (B, d_inner)
            xf = x.to(cdt)
            dA = torch.exp(delta[:, :, None] * A)  # (B, d_inner, N)
            dBx = (delta * xf)[:, :, None] * Bm.to(cdt)[:, None, :]  # (B, d_inner, N)
            h = ssm_state.to(cdt) * dA + dBx  # (B, d_inner, N)
            ssm_state.copy_(h)
            y = (h * Cm.to(cdt)[:, None, :]).sum(-1) + self.D.to(cdt) * xf  # (B, d_inner)
            y = (y * F.silu(z.to(cdt))).to(z.dtype)
        out = self.out_proj(y.to(hidden_states.dtype))[:, None, :]  # (B, 1, d_out)
        return out, conv_state, ssm_state
