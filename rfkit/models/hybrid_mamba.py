"""Sink + recent softmax attention with a selective state space (the paper's Mamba) for the evicted tokens.

:class:`HybridMambaAttention` is the mixer of :class:`rfkit.models.operators.HybridMambaOperator`:
RecurFormer's Mamba block, used as the *state* of the hybrid operator rather than as the whole
replacement. Every replaced query head keeps exact softmax attention, with its pretrained rotated
query and keys, over the first ``sink`` and the last ``window`` tokens (as
:class:`rfkit.models.window.WindowAttention`), normalised on its own: ``y_win``. The tokens that
have left the window (rank ``s <= t <= r - w`` for a query of rank ``r``: the set that
:class:`rfkit.models.hybrid.HybridWindowAttention` folds into its linear-attention state) are fed,
in rank order, to one selective state space (S6) per KV head, initialised from attention as
MambaInLlama does (the value is the input, the key gives ``B``, the query reads through ``C``)::

    x_t  = v_t                                    (hd,)   the evicted token's value
    B_t  = P_h^T k_t                              (N,)    its rotated key, projected
    dt_t = softplus(k_t . w_h + b_h)                      data-dependent step size
    A_h  = -exp(A_log_h)                          (N,)
    h   <- exp(dt_t A_h)[:, None] * h + dt_t B_t[:, None] x_t[None, :]      h (N, hd), once per evicted token
    C_r  = P_h^T q_r                              (N,)    the current query, through its KV head's P
    y_r  = y_win + g * hd^-0.5 * C_r^T h                  g: one gate per query head

``P_h`` (hd, N), ``w_h`` (hd,), ``b_h`` and ``A_log_h`` (N,) are learned per KV head (shared by its
query heads), ``g`` per query head. With ``window_gain`` each query head also learns a gain ``a``
on its window's output, ``y_r = a * y_win + g * hd^-0.5 * C_r^T h`` (``a`` starts at 1): at
``sink=0, window=1`` the window is the current token's value alone and ``a`` is Mamba's skip
``D``, so the block is a selective state space over the past tokens plus a learned skip, started
from the heads' own query, key and value projections (MambaInLlama's mapping). ``g`` starts at 0:
a freshly built block *is* the training-free sink + recent block, exactly. ``P`` starts as random
orthonormal columns, ``w`` at 0, ``b`` at softplus^-1(0.01) and ``A_log`` at log(1 .. N) (Mamba's
S4D-real start).
:meth:`HybridMambaAttention.calibrate` (the :class:`~rfkit.models.mixer.ReplacementMixer` hook that
attention transfer calls) sets ``P_h`` to the top ``N`` principal directions of the KV head's
rotated keys, so that ``C_r . B_t`` keeps the largest part of the score ``q_r . k_t``, and fits
every gate in closed form: least squares of (full attention - window) on the state's read-out.
:meth:`HybridMambaAttention.state_ablation` closes the gates for the "state off" evaluations.

Window dropout: in training mode, with probability ``window_dropout`` a forward uses a random
shorter window (between ``window // 4`` and ``window``; the hybrid's own draw), so the tokens
between the two must be carried by the state.

State, per layer: the window's ``(keys, values, seen)`` (sink slots and a ring of recent slots,
see :mod:`rfkit.models.window`) plus ``h`` ``(B, Hkv, N, hd)``: constant in the sequence length.
At head_dim 64, ``N = 16`` is 1,024 numbers per KV head, the K/V of 8 tokens: sink 4 + window 56
+ N 16 holds exactly the bytes of sink 4 + window 64. The window's three paths carry ``h`` too:

- decode step: :meth:`_before_write` folds the one key and value that the new token evicts from
  the ring into ``h``, in place (through :meth:`_fold_evicted` in the steady step);
  :meth:`_step_combine` adds the gated read-out.
- tiled path (inference and training): the window's first ``L`` recent keys in rank order
  (ring, then chunk; ranks ``seen - w + i``) are exactly what the chunk evicts, in order, and
  query ``i`` reads the state right after the ``i``-th: one chunked scan gives every read-out and
  the next ``h``. At a shorter drawn window ``w'`` query ``i`` reads after the ``(i + w - w')``-th:
  the first ``w - w'`` are folded into the scan's start in closed form, and the next ``h`` (after
  the ``L``-th) too.
- general rank-masked path (masks with holes; ``fast = False``, the reference): the ring's slots
  sorted by rank and the chunk form the evicted stream; query ``r`` reads the state after the
  stream's token of rank ``r - window`` (the window possibly shortened), so its ``C`` is placed at
  that step of the same scan. The next ``h`` folds the ranks ``<= seen' - 1 - w`` in closed form.

The scan (:meth:`HybridMambaAttention._scan`) is exact and differentiable: parallel inside chunks
of ``TILE`` steps (pairwise decays from segment sums, every exponent <= 0), sequential over the
chunks only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.precision import compute_dtype
from rfkit.models.window import TILE, WindowAttention
from rfkit.ops.scan import _segsum

# Initial step size dt (b = softplus^-1 of it, w = 0): a state dimension n keeps a token for
# about 1 / (n * DT_INIT) evicted tokens (100 tokens for n = 1, 6 for n = 16).
DT_INIT = 0.01


class HybridMambaAttention(WindowAttention):
    """Sink + recent softmax attention plus a gated selective state space (module docstring).

    Args:
        kv_for_query: For every replaced query head, the index of its KV head in this block.
        head_dim: Per-head width.
        window: Recent tokens attended exactly, the current one included.
        sink: First tokens attended exactly.
        scaling: Softmax scaling of the scores (also scales the state's read-out).
        state_dim: State size ``N`` per KV head (1 .. head_dim); the state holds ``N * hd``
            numbers per KV head.
        window_dropout: Probability that a training forward uses a shorter window.
        window_gain: Learn a gain per query head on the window's output (starts at 1; module
            docstring). Without it the window's output enters with weight 1.
    """

    def __init__(
        self,
        kv_for_query: list[int],
        head_dim: int,
        window: int,
        sink: int = 4,
        scaling: float | None = None,
        state_dim: int = 16,
        window_dropout: float = 0.0,
        window_gain: bool = False,
    ):
        super().__init__(kv_for_query, head_dim, window=window, sink=sink, scaling=scaling)
        n, hkv = int(state_dim), self.num_kv_heads
        if not 1 <= n <= head_dim:
            raise ValueError(f"state_dim must be in 1 .. head_dim ({head_dim}), got {state_dim!r}")
        self.state_dim = n
        self.window_dropout = float(window_dropout)
        self.proj = nn.Parameter(torch.linalg.qr(torch.randn(hkv, head_dim, n)).Q)  # P (Hkv, hd, N)
        self.dt_weight = nn.Parameter(torch.zeros(hkv, head_dim))
        self.dt_bias = nn.Parameter(torch.full((hkv,), math.log(math.expm1(DT_INIT))))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(hkv, 1))
        self.gate = nn.Parameter(torch.zeros(self.num_heads))
        if window_gain:
            self.window_gain = nn.Parameter(torch.ones(self.num_heads))
        else:
            self.register_parameter("window_gain", None)
        self._generator: torch.Generator | None = None

    def extra_repr(self) -> str:
        gain = ", window_gain=True" if self.window_gain is not None else ""
        return f"{super().extra_repr()}, state_dim={self.state_dim}, window_dropout={self.window_dropout}{gain}"

    # window dropout and the state ablation are the hybrid's own (same attributes, same draws)
    dropout_generator = HybridWindowAttention.dropout_generator
    _batch_window = HybridWindowAttention._batch_window
    train_window = HybridWindowAttention.train_window
    draw_for_batch = HybridWindowAttention.draw_for_batch
    _draw_window = HybridWindowAttention._draw_window
    has_state_ablation = True
    state_ablation = HybridWindowAttention.state_ablation

    # -- state ---------------------------------------------------------------------------------
    def empty_state(self, batch: int, device, dtype) -> tuple[torch.Tensor, ...]:
        """The window's K/V in ``dtype``, ``h`` in the compute dtype (float32 beside half-precision
        K/V: :mod:`rfkit.models.precision`)."""
        shape = (batch, self.num_kv_heads, self.state_dim, self.head_dim)
        return super().empty_state(batch, device, dtype) + (torch.zeros(shape, device=device, dtype=compute_dtype(dtype)),)

    def state_bytes(self, batch_size: int, dtype=torch.float32) -> int:
        itemsize = torch.empty((), dtype=compute_dtype(dtype)).element_size()  # h: float32 beside bf16 K/V
        ssm = self.num_kv_heads * self.state_dim * self.head_dim * itemsize
        return super().state_bytes(batch_size, dtype) + int(batch_size) * ssm

    def _kernel_ready(self, q: torch.Tensor, state) -> bool:
        """The compiled window kernels know no selective state: the PyTorch paths always run."""
        return False

    # -- pieces ----------------------------------------------------------------------------------
    @staticmethod
    def _cast(p: torch.Tensor, dtype) -> torch.Tensor:
        return p if p.dtype == dtype else p.to(dtype)

    def _group_param(self, p: torch.Tensor, dtype) -> torch.Tensor:
        """A per-KV-head parameter ``(Hkv, ...)`` per query group ``(G, ...)``."""
        return self._groups(self._cast(p, dtype).unsqueeze(0))[0]

    def _fold_inputs(self, keys: torch.Tensor):
        """``dt`` ``(B, Hkv, M)`` and ``B`` ``(B, Hkv, M, N)`` of evicted keys ``(B, Hkv, M, hd)``."""
        w, b = self._cast(self.dt_weight, keys.dtype), self._cast(self.dt_bias, keys.dtype)
        dt = F.softplus(torch.einsum("bhmd,hd->bhm", keys, w) + b[:, None])
        return dt, keys @ self._cast(self.proj, keys.dtype)

    def _reads(self, q: torch.Tensor) -> torch.Tensor:
        """``C`` ``(B, Hq, L, N)`` of queries ``(B, Hq, L, hd)``, each through its KV head's P."""
        return q @ self._per_query(self._cast(self.proj, q.dtype).unsqueeze(0))[0]

    def _gates(self, dtype, dims: int) -> torch.Tensor:
        """``g * scaling`` per query head as ``(G, rep)`` followed by ``dims`` unit axes."""
        return (self.gate * self.scaling).to(dtype).view(-1, self.rep, *[1] * dims)

    def _windowed(self, y: torch.Tensor, dims: int) -> torch.Tensor:
        """The window's output ``(B, G, rep, ...)`` (``dims`` trailing axes) times its gain, when learned."""
        if self.window_gain is None:
            return y
        return y * self.window_gain.to(y.dtype).view(-1, self.rep, *[1] * dims)

    def _kv_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Group tensor ``(B, G, ...)`` -> ``(B, Hkv, ...)`` (each KV head from its first query head)."""
        if self.grouped:
            return t
        first = torch.tensor([self.kv_for_query.index(h) for h in range(self.num_kv_heads)], device=t.device)
        return t.index_select(1, first)

    def _scan(self, h0, dt, Bk, x, C):
        """The read-outs of the evicted stream's states, per query group.

        ``h0`` ``(B, G, N, hd)`` the state before the stream; ``dt`` ``(B, G, M)`` (0 for a step that
        folds nothing), ``Bk`` ``(B, G, M, N)``, ``x`` ``(B, G, M, hd)``: the steps; ``C``
        ``(B, G, R, M, N)`` the reads, each at the step whose state it reads (0 elsewhere).
        Returns ``Y`` ``(B, G, R, M, hd)``, ``Y_j = C_j^T H_j`` with ``H_j`` the state after step
        ``j``, and the state after the last step ``(B, G, N, hd)``. Inside a chunk of T steps with
        ``a_t = dt_t A`` and ``seg[j, t] = a_{t+1} + ... + a_j``::

            H_j = exp(cum_j) H_start + sum_{t <= j} exp(seg[j, t]) dt_t B_t x_t^T
        """
        Bsz, G, M, N = Bk.shape
        R, hd, T = C.shape[2], x.shape[-1], TILE
        nC = -(-M // T)
        pad = nC * T - M
        if pad:
            dt, C = F.pad(dt, (0, pad)), F.pad(C, (0, 0, 0, pad))
            Bk, x = F.pad(Bk, (0, 0, 0, pad)), F.pad(x, (0, 0, 0, pad))
        A = -torch.exp(self._group_param(self.A_log, dt.dtype))  # (G, N)
        a = dt.view(Bsz, G, nC, T, 1) * A[None, :, None, None, :]  # (B, G, nC, T, N), <= 0
        cum = a.cumsum(3)
        causal = torch.ones(T, T, dtype=torch.bool, device=dt.device).tril()
        decay = torch.exp(_segsum(a.transpose(-1, -2))).masked_fill(~causal, 0)  # (B, G, nC, N, T, T)
        db = (dt[..., None] * Bk).view(Bsz, G, nC, T, N).transpose(-1, -2)  # dt_t B_t (B, G, nC, N, T)
        Cc, xc = C.reshape(Bsz, G, R, nC, T, N), x.reshape(Bsz, G, nC, T, hd)
        W = torch.einsum("bgrcjn,bgcnjt->bgrcjt", Cc, decay * db.unsqueeze(-2))  # (B, G, R, nC, T, T)
        Y = W @ xc.unsqueeze(2)  # within the chunk
        grow = (decay[..., -1, :] * db) @ xc  # (B, G, nC, N, hd): the chunk's own inputs at its end
        carry = torch.exp(cum[:, :, :, -1]).unsqueeze(-1)  # (B, G, nC, N, 1)
        H, starts = h0.to(dt.dtype), []
        for c in range(nC):
            starts.append(H)
            H = carry[:, :, c] * H + grow[:, :, c]
        start = torch.stack(starts, 2)  # (B, G, nC, N, hd)
        Y = Y + (Cc * torch.exp(cum).unsqueeze(2)) @ start.unsqueeze(2)  # from the chunk's start state
        return Y.reshape(Bsz, G, R, nC * T, hd)[:, :, :, :M], H

    def _fold(self, h0, dt, Bk, x):
        """``h0`` ``(B, Hkv, N, hd)`` after the steps of ``dt`` ``(B, Hkv, M)`` (0: skipped), in
        closed form: ``exp(A sum dt) h0 + sum_t exp(A sum_{u > t} dt_u) dt_t B_t x_t^T``."""
        rest = dt.flip(-1).cumsum(-1).flip(-1)  # sum_{u >= t}
        after = F.pad(rest[..., 1:], (0, 1))  # sum_{u > t}, no subtraction
        A = -torch.exp(self._cast(self.A_log, dt.dtype))[None, :, None, :]  # (1, Hkv, 1, N)
        weight = torch.exp(after[..., None] * A) * dt[..., None] * Bk  # (B, Hkv, M, N)
        return torch.exp(rest[..., :1, None] * A)[:, :, 0, :, None] * h0 + weight.transpose(-1, -2) @ x

    # -- tiled prefill ---------------------------------------------------------------------------
    def _combine(self, A, Z, m, q, ctx, state, seen: int):
        """The window's output plus the state's: the chunk evicts the recent keys of index
        ``0 .. L-1`` (rank ``seen - w + i``) in order, and query ``i`` reads the state after the
        ``(i + skip)``-th of them (``skip = self.window - window``: 0 but for a shorter drawn
        window, whose queries read the state further on)."""
        L = q.shape[2]
        skip = self.window - ctx["window"]
        old_k, old_v = ctx["rec_k"][:, :, : skip + L], ctx["rec_v"][:, :, : skip + L]
        dt, Bk = self._fold_inputs(old_k)
        dt = dt * ctx["rec_valid"][: skip + L].to(dt.dtype)  # ranks below the sink (or none) fold nothing
        C = self._grouped_queries(self._reads(q))  # (B, G, rep, L, N)
        h0 = state[3]
        if skip:
            h0 = self._fold(h0.to(dt.dtype), dt[..., :skip], Bk[:, :, :skip], old_v[:, :, :skip])
        tail = (dt[..., skip:], Bk[:, :, skip:], old_v[:, :, skip:])
        Y, h = self._scan(self._groups(h0), *(self._groups(t) for t in tail), C)
        h = self._kv_heads(h)
        if skip:  # the scan ran on past the L-th eviction: the next state is the one right after it
            h = self._fold(state[3].to(dt.dtype), dt[..., :L], Bk[:, :, :L], old_v[:, :, :L])
        ctx["ssm"] = h.to(state[3].dtype)
        return self._windowed(A / Z, 2) + self._gates(A.dtype, 2) * Y

    def _next_state(self, state, ctx, seen: int, L: int) -> tuple[torch.Tensor, ...]:
        return super()._next_state(state, ctx, seen, L) + (ctx["ssm"],)

    # -- one decode token ------------------------------------------------------------------------
    def _fold_evicted(self, state, slot: int, constants: dict) -> None:
        self._before_write(state, slot, None)

    _read_window = WindowAttention._combined_read

    def _before_write(self, state, slot, rows) -> None:
        """Fold the key and value that the new token evicts from the ring (rank ``seen - w``)
        into ``h``, in place."""
        keys, values, seen, h = state
        if rows is None:  # steady state: every row evicts a real old token (a slice: see the hybrid's)
            k_old, v_old = keys[:, :, slot : slot + 1, :][:, :, 0], values[:, :, slot : slot + 1, :][:, :, 0]  # (B, Hkv, hd)
        else:
            k_old, v_old = keys[rows, :, slot], values[rows, :, slot]
        k_old, v_old = k_old.to(h.dtype), v_old.to(h.dtype)  # K/V may be half precision, h is not
        dt, Bk = self._fold_inputs(k_old.unsqueeze(2))
        dt, Bk = dt[:, :, 0], Bk[:, :, 0]  # (B, Hkv), (B, Hkv, N)
        if rows is not None:
            dt = dt * (seen - self.window >= self.sink).to(dt.dtype)[:, None]
        decay = torch.exp(dt[..., None] * -torch.exp(self._cast(self.A_log, dt.dtype)))  # (B, Hkv, N)
        h.mul_(decay.unsqueeze(-1)).addcmul_((dt[..., None] * Bk).unsqueeze(-1), v_old.unsqueeze(-2))

    def _step_combine(self, A, Z, m, qg, state):
        C = qg @ self._group_param(self.proj, qg.dtype).unsqueeze(0)  # (B, G, rep, N)
        return self._windowed(A / Z, 1) + self._gates(A.dtype, 1) * (C @ self._groups(state[3]))

    # -- general rank-masked path (masks with holes, fast = False) --------------------------------
    # long chunks run as sub-chunks of hybrid.PREFILL_CHUNK tokens, carrying the state, exactly
    # as the hybrid's (it calls this class's _general_chunk)
    _general = HybridWindowAttention._general

    def _general_chunk(self, q, k, v, state, mask, window: int, return_states: bool):
        B, L = q.shape[0], q.shape[2]
        if not state:
            state = self.empty_state(B, q.device, k.dtype)
        y = WindowAttention._general(self, q, k, v, state, mask, window, return_states)
        y, window_state = y if return_states else (y, None)
        real = self._real(q, mask)
        read, h = self._general_reads(q, k, v, state, real, window, return_states)
        read = read * self._gates(read.dtype, 2).view(1, -1, 1, 1) * real[:, None, :, None].to(read.dtype)
        if self.window_gain is not None:  # (B, L, Hq * hd) in head order, as the gates
            gain = self.window_gain.to(y.dtype)[:, None]
            y = (y.view(B, L, self.num_heads, self.head_dim) * gain).view(B, L, self.d_out)
        y = y + read.transpose(1, 2).reshape(B, L, self.d_out)
        return (y, window_state + (h,)) if return_states else y

    def _general_reads(self, q, k, v, state, real, window: int, with_state: bool):
        """``C_r^T h`` per query ``(B, Hq, L, hd)`` (ungated, unscaled) and, when asked, the next
        ``h``. The evicted stream: the ring's slots sorted by rank (empty ones first, folding
        nothing), then the chunk; query ``r`` reads the state after its step of rank ``r - window``
        (or the carried state when the stream has no rank ``<= r - window``)."""
        s = self.sink
        B, L = q.shape[0], q.shape[2]
        rank, slot_rank = self._ranks(state[2], real)
        ring_rank, order = slot_rank[:, s:].sort(1)
        pick = order[:, None, :, None].expand(-1, self.num_kv_heads, -1, self.head_dim)
        cand_k = torch.cat([state[0][:, :, s:].gather(2, pick), k], 2)  # (B, Hkv, M, hd)
        cand_v = torch.cat([state[1][:, :, s:].gather(2, pick), v], 2)
        cand_rank = torch.cat([ring_rank, rank], 1)  # (B, M), -1 for empty slots and pads
        M = cand_rank.shape[1]
        dt, Bk = self._fold_inputs(cand_k)
        dt = dt * (cand_rank >= s)[:, None].to(dt.dtype)
        # each query's step: the stream's token of rank r - window, read by that query alone
        below = (cand_rank[:, None, :] >= 0) & (cand_rank[:, None, :] <= (rank - window)[:, :, None])  # (B, L, M)
        step = (below.long() * torch.arange(1, M + 1, device=q.device)).amax(-1) - 1  # (B, L), -1: none
        C = self._reads(q)  # (B, Hq, L, N)
        at = torch.where(step >= 0, step, M)[:, None, :, None].expand(-1, self.num_heads, -1, self.state_dim)
        placed = C.new_zeros(B, self.num_heads, M + 1, self.state_dim).scatter(2, at, C)[:, :, :M]
        steps = (self._groups(t) for t in (state[3], dt, Bk, cand_v))
        Y, _ = self._scan(*steps, self._grouped_queries(placed))
        Y = Y.reshape(B, self.num_heads, M, self.head_dim)
        read = Y.gather(2, step.clamp_min(0)[:, None, :, None].expand(-1, self.num_heads, -1, self.head_dim))
        read = torch.where((step >= 0)[:, None, :, None], read, C @ self._per_query(state[3]).to(C.dtype))
        if not with_state:
            return read, None
        limit = state[2] + real.long().sum(1) - 1 - self.window  # ranks <= limit have left the window
        fold = (cand_rank <= limit[:, None])[:, None].to(dt.dtype)
        return read, self._fold(state[3].to(dt.dtype), dt * fold, Bk, cand_v).to(state[3].dtype)

    # -- calibration -----------------------------------------------------------------------------
    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> dict:
        """Set ``P`` to the top ``N`` principal directions of each KV head's rotated keys
        (eigenvectors of ``K^T K``), then fit every gate in closed form: the least-squares ``g``
        of ``y_full - y_win ~ g * hd^-0.5 C^T h`` over the batch, with ``y_full`` the full causal
        softmax attention the heads had. A gate whose fit is undefined (no evicted token) stays 0.
        With ``window_gain`` the gain and the gate are fitted together: ``y_full ~ a * y_win + g *
        hd^-0.5 C^T h``.

        ``x`` is a batch of this block's inputs ``(B, L, d_in)`` from the original model, without
        padding. Returns per KV head the share of key energy that ``P`` keeps, and per query head
        the gate (and the gain) and the share of the residual ``y_full - y_win`` that the fit
        explains.
        """
        B, L, _ = x.shape
        q, k, v = self._split(x.to(compute_dtype(x.dtype)))
        kept = []
        for h in range(self.num_kv_heads):
            keys = k[:, h].reshape(-1, self.head_dim).double()
            energy, vectors = torch.linalg.eigh(keys.T @ keys)  # ascending
            self.proj[h].copy_(vectors[:, -self.state_dim :].flip(-1).to(self.proj.dtype))
            kept.append(float(energy[-self.state_dim :].sum() / energy.sum().clamp_min(1e-30)))
        full = F.scaled_dot_product_attention(
            q, self._per_query(k), self._per_query(v), is_causal=True, scale=self.scaling
        )  # (B, Hq, L, hd)
        win = WindowAttention._general(self, q, k, v, (), None, self.window, False)
        win = win.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        real = torch.ones(B, L, dtype=torch.bool, device=x.device)
        read, _ = self._general_reads(q, k, v, self.empty_state(B, x.device, k.dtype), real, self.window, False)
        read, full, win = (read * self.scaling).double(), full.double(), win.double()
        gate, gain = self._fit_gates(full, win, read)
        self.gate.copy_(gate.to(self.gate.dtype))
        resid = full - win
        err = full - gain[None, :, None, None] * win - gate[None, :, None, None] * read
        explained = 1 - (err * err).sum((0, 2, 3)) / (resid * resid).sum((0, 2, 3)).clamp_min(1e-30)
        report = {"gate": gate.tolist(), "explained": explained.tolist(), "key_energy": kept}
        if self.window_gain is not None:
            self.window_gain.copy_(gain.to(self.window_gain.dtype))
            report["window_gain"] = gain.tolist()
        return report

    def _fit_gates(self, full: torch.Tensor, win: torch.Tensor, read: torch.Tensor):
        """Per query head, the least-squares ``(g, a)`` of ``full ~ a * win + g * read`` (all
        ``(B, Hq, L, hd)``): ``a = 1`` held fixed unless the gain is learned. A head whose fit is
        undefined (no evicted token, or a singular system) keeps ``g = 0, a = 1``."""
        dims = (0, 2, 3)
        rr, rf = (read * read).sum(dims), (read * full).sum(dims)
        one = torch.ones_like(rr)
        if self.window_gain is None:
            num = rf - (read * win).sum(dims)  # the residual full - win on the read-out
            ok = (rr > 1e-30) & torch.isfinite(num / rr)
            return torch.where(ok, num / rr.clamp_min(1e-30), torch.zeros_like(rr)), one
        ww, wr, wf = (win * win).sum(dims), (win * read).sum(dims), (win * full).sum(dims)
        det = ww * rr - wr * wr
        ok = det > 1e-12 * (ww * rr).clamp_min(1e-30)
        safe = torch.where(ok, det, one)
        gate = torch.where(ok, (ww * rf - wr * wf) / safe, torch.zeros_like(rr))
        gain = torch.where(ok, (rr * wf - wr * rf) / safe, one)
        return gate, gain
