"""Sink + recent softmax attention with a linear-attention state for the tokens that left the window.

:class:`HybridWindowAttention` is the mixer of :class:`rfkit.models.operators.HybridOperator`. Every
replaced query head keeps exact softmax attention, with its pretrained rotated query and keys,
over the first ``sink`` and the last ``window`` tokens (as :class:`rfkit.models.window.WindowAttention`).
Tokens that have left the window (rank ``s <= t <= r - w`` for a query of rank ``r``) are not
dropped: they are summed into a fixed-size linear-attention state per KV head,

    S = sum_t phi(k_t) v_t^T   (f, hd)        z = sum_t phi(k_t)   (f,)

with a small learned feature map ``phi(x) = [softmax(x W), softmax(-x W)]`` (``W`` (hd, f/2), one per
KV head, shared by its query heads). Both parts share one softmax normaliser::

    m   = max of the query's window scores
    A   = sum_win exp(s_t - m) v_t            Z  = sum_win exp(s_t - m)
    a   = phi(q) S                            zl = phi(q) . z
    g   = relu(gate_h) * exp(log_scale_h)     (one per query head)
    y   = (A + g e^{-m} a) / (Z + g e^{-m} zl)

``g e^{-m} phi(q).phi(k)`` stands in for ``exp(s_t - m)``, the weight a full softmax head gives an
old token, so the old tokens compete with the window on the softmax's own scale. ``gate`` starts
at 0: a freshly built block *is* the training-free sink + recent block, exactly, and training
(attention transfer, then distillation) can only move it from that known-good start.
:meth:`HybridWindowAttention.calibrate` (the :class:`~rfkit.models.mixer.ReplacementMixer` hook that
attention transfer calls) sets ``log_scale`` in closed form from the teacher's attention before
training opens the gate; :meth:`HybridWindowAttention.state_ablation` closes the gate for the
"state off" evaluations.

Sharpness (``sharpness``, ``tau >= 1``, 1 by default): ``e^{-m}`` becomes ``e^{-tau m}``, so the
state's share falls faster as the window's best score ``m`` rises (and rises where ``m < 0``). The
bounded feature map cannot lower the old tokens' weight when one window token matches the query
far better than the rest (the answer to a question written in the sentence before it), and a
trained state can outweigh the copy the window would make; ``tau > 1`` gives the window more of
that weight. A fixed setting, not a learned weight, recorded in the operator's config like the
window, so a trained model can be read at another value.

State decay (``decay_horizon``, off by default): a learned horizon ``H`` per KV head,
``gamma = exp(-1/H)``; a token that left the window ``a`` tokens ago weighs ``gamma^a`` in ``S`` and
``z`` (``S <- gamma S + phi(k) v^T`` per token), so the state holds about the last ``H`` evicted
tokens at any length and reads at 8k as it did on the blocks it was trained on.

Window dropout: in training mode, with probability ``window_dropout`` a forward uses a random
shorter window (between ``window // 4`` and ``window``), so the tokens between the two must be
carried by the state. Without it a trained state can stay unused (the window alone already
fits short text well).

State, per layer: the window's ``(keys, values, seen)`` (sink slots and a ring of recent slots,
see :mod:`rfkit.models.window`) plus ``S`` ``(B, Hkv, f, hd)`` and ``z`` ``(B, Hkv, f)``: constant in
the sequence length. The window's three paths carry the state too: a decode step folds exactly
the one key its new token evicts from the ring (one feature-map call on one key, ``S`` and ``z``
updated in place); the tiled path (inference and training) computes the linear part in chunks of
``TILE`` tokens (exact causal linear attention inside a chunk, ``S`` and ``z`` carried between
chunks; at a shorter drawn window the ring's oldest keys are folded in first); the general
rank-masked path serves masks with holes and ``fast = False``, the reference.

One module because each of the hybrid's paths extends the matching path of
:class:`~rfkit.models.window.WindowAttention` with the same state sums and normaliser; apart,
the formula above would be spread over several files.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from rfkit.models.precision import compute_dtype
from rfkit.models.window import TILE, WindowAttention
from rfkit.ops import triton_state

# exp(-m) is evaluated with m clamped from below, so a query whose window scores are all very
# negative cannot overflow the old tokens' weight.
_MIN_MAX_SCORE = -60.0
# The general path (masks with holes, fast = False) runs long chunks in sub-chunks of this many
# tokens (its scores are L x (window + L)).
PREFILL_CHUNK = 1024


def _phi(proj: torch.Tensor) -> torch.Tensor:
    """Feature map from the projection ``x W``: ``[softmax(xW), softmax(-xW)]``."""
    return torch.cat([proj.softmax(-1), (-proj).softmax(-1)], dim=-1)


class HybridWindowAttention(WindowAttention):
    """Sink + recent softmax attention plus a gated linear-attention state (module docstring).

    Args:
        kv_for_query: For every replaced query head, the index of its KV head in this block.
        head_dim: Per-head width.
        window: Recent tokens attended exactly, the current one included.
        sink: First tokens attended exactly.
        scaling: Softmax scaling of the scores.
        feature_dim: Width ``f`` of the feature map (even); the state holds ``f * (hd + 1)``
            numbers per KV head.
        window_dropout: Probability that a training forward uses a shorter window.
        decay_horizon: Initial horizon ``H`` of the learned per-KV-head state decay
            ``gamma = exp(-1 / H)`` (module docstring); ``None``: no decay.
        sharpness: ``tau >= 1`` in the state's weight ``g e^{-tau m}`` (module docstring); 1: the
            softmax's own scale.
    """

    #: the state part of the tiled prefill and of training forwards: "torch" (chunked PyTorch
    #: products, every device) or "triton" (rfkit.ops.triton_state: CUDA devices, float32; PyTorch
    #: elsewhere); None: what RFKIT_STATE_BACKEND names, "torch" when unset
    state_backend: str | None = None

    def __init__(
        self,
        kv_for_query: list[int],
        head_dim: int,
        window: int,
        sink: int = 4,
        scaling: float | None = None,
        feature_dim: int = 16,
        window_dropout: float = 0.0,
        decay_horizon: float | None = None,
        sharpness: float = 1.0,
    ):
        super().__init__(kv_for_query, head_dim, window=window, sink=sink, scaling=scaling)
        self.sharpness = float(sharpness)
        self.feature_dim = int(feature_dim)
        self.window_dropout = float(window_dropout)
        half = self.feature_dim // 2
        self.feature_map = nn.Parameter(torch.randn(self.num_kv_heads, head_dim, half) * head_dim**-0.5)
        self.gate = nn.Parameter(torch.zeros(self.num_heads))
        self.log_scale = nn.Parameter(torch.zeros(self.num_heads))
        # log H per KV head (learned): gamma = exp(-1/H). Absent without decay, so models saved
        # before it existed load unchanged.
        self.decay_horizon = None if decay_horizon is None else float(decay_horizon)
        horizon = None if decay_horizon is None else torch.full((self.num_kv_heads,), math.log(float(decay_horizon)))
        self.log_horizon = None if horizon is None else nn.Parameter(horizon)
        self._generator: torch.Generator | None = None

    def extra_repr(self) -> str:
        decay = "" if self.decay_horizon is None else f", decay_horizon={self.decay_horizon:g}"
        sharp = "" if self.sharpness == 1.0 else f", sharpness={self.sharpness:g}"
        return f"{super().extra_repr()}, feature_dim={self.feature_dim}, window_dropout={self.window_dropout}{decay}{sharp}"

    # -- state ---------------------------------------------------------------------------------
    def empty_state(self, batch: int, device, dtype) -> tuple[torch.Tensor, ...]:
        """The window's K/V in ``dtype``, the sums ``S`` and ``z`` in the compute dtype (float32
        beside half-precision K/V: :mod:`rfkit.models.precision`)."""
        f, h, d = self.feature_dim, self.num_kv_heads, self.head_dim
        sums = compute_dtype(dtype)
        return super().empty_state(batch, device, dtype) + (
            torch.zeros(batch, h, f, d, device=device, dtype=sums),
            torch.zeros(batch, h, f, device=device, dtype=sums),
        )

    def state_bytes(self, batch_size: int, dtype=torch.float32) -> int:
        itemsize = torch.empty((), dtype=compute_dtype(dtype)).element_size()  # the sums: float32 beside bf16 K/V
        linear = self.num_kv_heads * self.feature_dim * (self.head_dim + 1) * itemsize
        return super().state_bytes(batch_size, dtype) + int(batch_size) * linear

    # -- pieces ----------------------------------------------------------------------------------
    def features(self, x: torch.Tensor, per_query: bool) -> torch.Tensor:
        """phi(x) ``(B, H, L, f)`` for keys (``per_query=False``, H = KV heads) or queries (each
        query head uses its KV head's map)."""
        w = self._per_query(self.feature_map.unsqueeze(0))[0] if per_query else self.feature_map
        return _phi(x @ w.to(x.dtype).unsqueeze(0))

    def _group_maps(self) -> torch.Tensor:
        """Feature maps per query group (G, hd, f/2)."""
        return self.feature_map if self.grouped else self._per_query(self.feature_map.unsqueeze(0))[0]

    def old_weight(self) -> torch.Tensor:
        """``g`` per query head ``(Hq,)``: 0 while the gate is closed."""
        return self.gate.clamp_min(0) * self.log_scale.exp()

    def dropout_generator(self) -> torch.Generator:
        """The block's own random stream for window dropout, seeded on first use from the global
        one (so ``seed_everything`` decides it). Checkpoints save and restore its state
        (``RecurFormerModule.on_save_checkpoint``), so a resumed fit draws the same windows."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())))
        return self._generator

    #: the window drawn for the current training batch (draw_for_batch), None: each forward draws
    _batch_window: int | None = None

    def train_window(self) -> int:
        """The window of a training forward: the batch's draw when one was made
        (:meth:`draw_for_batch`: a recomputed forward sees the same), else a fresh draw."""
        return self._batch_window if self._batch_window is not None else self._draw_window()

    def draw_for_batch(self, active: bool = True) -> None:
        """Draw the training window of the coming batch from the block's own stream (``active=False``:
        back to one draw per forward)."""
        self._batch_window = self._draw_window() if active else None

    def _draw_window(self) -> int:
        if self.window_dropout <= 0 or self.window < 2:
            return self.window
        generator = self.dropout_generator()  # float32 explicitly: bf16-true sets a bf16 default dtype
        if float(torch.rand((), generator=generator, dtype=torch.float32)) >= self.window_dropout:
            return self.window
        low = max(1, self.window // 4)
        return int(torch.randint(low, self.window + 1, (), generator=generator))

    def log_decay(self) -> torch.Tensor | None:
        """``log gamma = -1 / H`` per KV head ``(Hkv,)`` (H at least one token), or None without
        decay. A token that left the window ``a`` steps ago weighs ``gamma ** a``."""
        if self.log_horizon is None:
            return None
        return -torch.exp(-self.log_horizon.clamp_min(0.0))

    def _powers(self, exponent: torch.Tensor, heads: str, dtype) -> torch.Tensor:
        """``gamma ** exponent`` (exponent >= 0, any shape) per head: ``(H, *exponent.shape)``
        with H the KV heads (``"kv"``), the query heads (``"query"``) or the query groups of
        the tiled paths (``"group"``)."""
        log_gamma = self.log_decay().to(dtype)
        if heads == "query" or (heads == "group" and not self.grouped):
            log_gamma = log_gamma.index_select(0, self._per_query_index(log_gamma.device))
        return torch.exp(log_gamma.view(-1, *[1] * exponent.dim()) * exponent.to(dtype))

    def kernel_decay(self) -> torch.Tensor | None:
        """``gamma`` per KV head as contiguous float32 (the compiled kernels read it), or None."""
        if self.log_horizon is None:
            return None
        return self._cached(("decay",), lambda: self.log_decay().exp().to(torch.float32).contiguous())

    def _weights_train(self) -> bool:
        """Whether autograd records the gate or the scale (then ``g`` is used as it is: ``log g``
        has no gradient at a closed gate)."""
        return torch.is_grad_enabled() and (self.gate.requires_grad or self.log_scale.requires_grad)

    def _log_weight(self, dtype) -> torch.Tensor:
        """``log g`` per query head as (G, rep, 1), ``-inf`` where the gate is closed (inference:
        kept until the weights change)."""
        return self._cached(("log", dtype), lambda: (self.gate.clamp_min(0).log() + self.log_scale).to(dtype).view(-1, self.rep, 1))

    def kernel_weights(self) -> torch.Tensor:
        """``g`` per query head as contiguous float32 (the compiled step reads it)."""
        return self._cached(("kernel",), lambda: self.old_weight().to(torch.float32).contiguous())

    def _cached(self, name: tuple, make) -> torch.Tensor:
        """A value derived from the gate, scale and decay, computed without autograd and kept
        until any changes (their in-place version counters and storage)."""
        params = [p for p in (self.gate, self.log_scale, self.log_horizon) if p is not None]
        key = tuple(p._version for p in params) + tuple(p.data_ptr() for p in params)
        cache = self.__dict__.setdefault("_derived", {})
        if cache.get(name, (None,))[0] != key:
            with torch.no_grad():
                cache[name] = (key, make())
        return cache[name][1]

    def _kernel_ready(self, q: torch.Tensor, state) -> bool:
        fmap = self.feature_map
        return fmap.dtype == torch.float32 and fmap.device.type == "cpu" and fmap.is_contiguous() and super()._kernel_ready(q, state)

    def _train_kernel_computes_me(self) -> bool:
        return type(self) is HybridWindowAttention  # the kernel's formula: window + this state

    def _flex_computes_me(self) -> bool:
        # e^{-tau m} / Z is e^{-lse} only at tau = 1: a sharper read needs the window's max itself
        return self.sharpness == 1.0

    def _maps(self, dtype) -> torch.Tensor:
        return self.feature_map if self.feature_map.dtype == dtype else self.feature_map.to(dtype)

    def _minus_tau_m(self, m: torch.Tensor) -> torch.Tensor:
        """``-tau m`` with ``m`` clamped from below: the exponent of the state's weight
        ``g e^{-tau m}`` (``tau`` the sharpness)."""
        m = m.clamp_min(_MIN_MAX_SCORE)
        return -m if self.sharpness == 1.0 else m * -self.sharpness

    def _mix(self, A, Z, m, a, zl):
        """``(A + c a) / (Z + c zl)`` with ``c = g e^{-tau m}`` (``g`` per query head; the rep axis
        third, queries second to last)."""
        if self._weights_train():  # the general path's g e^{-tau m}
            g = self.old_weight().to(A.dtype).view(-1, self.rep, 1)
            c = (g.unsqueeze(-1) if A.dim() == 5 else g) * torch.exp(self._minus_tau_m(m))
        else:
            log_g = self._log_weight(A.dtype)
            c = torch.exp((log_g.unsqueeze(-1) if A.dim() == 5 else log_g) + self._minus_tau_m(m))
        return torch.addcmul(A, c, a) / torch.addcmul(Z, c, zl)

    # -- tiled prefill ---------------------------------------------------------------------------
    def _combine(self, A, Z, m, q, ctx, state, seen: int):
        """Window sums plus the linear part: query ``i`` reads the state and the recent keys up to
        index ``i + skip`` (rank ``seen + i - window``, ``skip = self.window - window``), causal
        linear attention in chunks of TILE over the keys from index ``skip`` on, from the state
        with the first ``skip`` keys folded in."""
        B, _, L, hd = q.shape
        C = TILE
        nC = -(-L // C)
        pad = nC * C - L
        skip = self.window - ctx["window"]
        maps = self._group_maps()
        maps = maps if maps.dtype == q.dtype else maps.to(q.dtype)
        qg = self._grouped_queries(q)  # (B, G, rep, L, hd)
        phi_q = _phi(qg @ maps[None, :, None])  # (B, G, rep, L, f)
        old_k, old_v = ctx["rec_k"][:, :, : skip + L], ctx["rec_v"][:, :, : skip + L]  # ranks seen - w + i
        phi_k = _phi(old_k @ self._maps(q.dtype)[None]) * ctx["rec_valid"][: skip + L, None].to(q.dtype)
        ctx["fold"] = (phi_k[:, :, :L], old_v[:, :, :L])  # what the next state adds to S and z
        S0, z0 = state[3], state[4]
        if skip:
            S0, z0 = self._folded(S0, z0, phi_k[:, :, :skip], old_v[:, :, :skip])
        phi_k, old_v = self._groups(phi_k[:, :, skip:]), self._groups(old_v[:, :, skip:])
        S0, z0 = self._groups(S0), self._groups(z0)
        if self._state_kernel_ready(q):
            a, zl = self._kernel_state(phi_q, phi_k, old_v, S0, z0)
            return self._mix(A, Z, m, a, zl)
        if pad:
            phi_q = F.pad(phi_q, (0, 0, 0, pad))
            phi_k, old_v = F.pad(phi_k, (0, 0, 0, pad)), F.pad(old_v, (0, 0, 0, pad))
        G, f = phi_k.shape[1], phi_k.shape[-1]
        pq = phi_q.view(B, G, self.rep, nC, C, f)
        pk, pv = phi_k.view(B, G, nC, C, f), old_v.reshape(B, G, nC, C, hd)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        intra = (pq @ pk.transpose(-1, -2).unsqueeze(2)).masked_fill(~causal, 0)  # (B, G, rep, nC, C, C)
        if self.log_horizon is None:
            kv = pk.transpose(-1, -2) @ pv  # (B, G, nC, f, hd)
            ksum = pk.sum(-2)  # (B, G, nC, f)
            S_before = S0[:, :, None] + kv.cumsum(2) - kv
            z_before = z0[:, :, None] + ksum.cumsum(2) - ksum
        else:
            pq, intra, S_before, z_before = self._decayed_chunks(pq, pk, pv, intra, S0, z0)
        a = pq @ S_before.unsqueeze(2) + intra @ pv.unsqueeze(2)  # (B, G, rep, nC, C, hd)
        zl = pq @ z_before.unsqueeze(2).unsqueeze(-1) + intra.sum(-1, keepdim=True)
        flat = lambda t: t.reshape(B, G, self.rep, nC * C, t.shape[-1])[:, :, :, :L]  # noqa: E731
        return self._mix(A, Z, m, flat(a), flat(zl))

    def _state_kernel_ready(self, q: torch.Tensor) -> bool:
        """Whether the Triton kernels (:mod:`rfkit.ops.triton_state`) run the state part: chosen
        (``state_backend``), float32 (the compute dtype of float32 and bf16 models), on CUDA (or on
        the CPU under Triton's interpreter, ``triton_state.CPU_INTERPRET``: tests and rehearsal)."""
        field = triton_state.ENV if self.state_backend is None else "HybridWindowAttention.state_backend"
        if triton_state.resolve(self.state_backend, field) == "torch" or q.dtype != torch.float32:
            return False
        return triton_state.serves(q.device, self.feature_dim)

    def _kernel_state(self, phi_q, phi_k, old_v, S0, z0):
        """``a`` (B, G, rep, L, hd) and ``zl`` (.., 1) through the Triton kernels: the values with a
        column of ones appended (its output is ``zl``), ``z0`` beside ``S0`` the same way, the decay
        per query group (0: none)."""
        ones = old_v.new_ones(*old_v.shape[:-1], 1)
        lam = self.log_decay()
        if lam is None:
            lam = torch.zeros(phi_k.shape[1], device=phi_k.device)
        elif not self.grouped:
            lam = lam.index_select(0, self._per_query_index(lam.device))
        out = triton_state.decayed_linear_state(
            phi_q, phi_k, torch.cat([old_v, ones], -1), torch.cat([S0, z0.unsqueeze(-1)], -1), lam
        )
        hd = old_v.shape[-1]
        return out[..., :hd], out[..., hd:]

    def _decayed_chunks(self, pq, pk, pv, intra, S0, z0):
        """The chunked linear part with the decay. Query ``i`` reads ``H_i = gamma^(i+1) S0 +
        sum_{t <= i} gamma^(i-t) phi(k_t) v_t``; with ``i = cC + u`` that is ``gamma^(u+1) P_c``
        plus the chunk's own tokens weighted ``gamma^(u-t)``, where ``P_c`` (the state after
        index ``cC - 1``) is ``gamma^(cC) S0 + sum_{c' < c} gamma^(C(c-1-c')) K_c'`` and ``K_c'``
        the chunk's tokens weighted to its end. Every power has a non-negative exponent."""
        nC, C = pk.shape[2], pk.shape[3]
        u, c = torch.arange(C, device=pk.device), torch.arange(nC, device=pk.device)
        power = lambda e: self._powers(e, "group", pk.dtype)  # noqa: E731
        intra = intra * power((u[:, None] - u[None, :]).clamp_min(0))[None, :, None, None]  # (G, C, C)
        to_end = power(C - 1 - u)  # (G, C)
        wk = pk * to_end[None, :, None, :, None]
        kv, ksum = wk.transpose(-1, -2) @ pv, wk.sum(-2)  # (B, G, nC, f, hd), (B, G, nC, f)
        lag = c[:, None] - 1 - c[None, :]
        carry = power(C * lag.clamp_min(0)) * (lag >= 0)  # (G, nC, nC)
        start = power(C * c)  # (G, nC): gamma^(cC)
        S_before = torch.einsum("gcd,bgdfh->bgcfh", carry, kv) + start[None, :, :, None, None] * S0[:, :, None]
        z_before = torch.einsum("gcd,bgdf->bgcf", carry, ksum) + start[None, :, :, None] * z0[:, :, None]
        pq = pq * power(u + 1)[None, :, None, None, :, None]  # (B, G, rep, nC, C, f)
        return pq, intra, S_before, z_before

    def _next_state(self, state, ctx, seen: int, L: int) -> tuple[torch.Tensor, ...]:
        return super()._next_state(state, ctx, seen, L) + self._folded(state[3], state[4], *ctx["fold"])

    def _folded(self, S0, z0, phi_k, old_v):
        """``S`` and ``z`` (KV heads) after folding the keys ``phi_k`` (B, Hkv, n, f) with their
        values, in order, into ``S0`` and ``z0``."""
        n = phi_k.shape[2]
        if self.log_horizon is not None:  # the state moves n steps: S0 decays by gamma^n, index t by gamma^(n-1-t)
            t = torch.arange(n, device=phi_k.device)
            phi_k = phi_k * self._powers(n - 1 - t, "kv", phi_k.dtype)[None, :, :, None]
            gamma_n = self._powers(torch.tensor(float(n), dtype=S0.dtype), "kv", S0.dtype)  # (Hkv,)
            S0, z0 = S0 * gamma_n[None, :, None, None], z0 * gamma_n[None, :, None]
        return S0 + phi_k.transpose(-1, -2) @ old_v, z0 + phi_k.sum(2)

    # -- one decode token ------------------------------------------------------------------------
    def step_constants(self, dtype, device) -> dict:
        """The decode step's weights in ``dtype``: the feature maps with their negation appended,
        as ``(.., hd, 2, f/2)`` so that one einsum and one softmax over the last axis give ``phi``
        in halves, per KV head and per query group; ``log g`` per query head ``(G, rep, 1)`` and
        the decay ``gamma`` per KV head (None without decay)."""
        both = lambda maps: torch.cat([maps, -maps], -1).to(device, dtype).unflatten(-1, (2, -1))  # noqa: E731
        gamma = None if self.log_horizon is None else self.log_decay().exp().to(device, dtype)
        return {
            "maps": both(self.feature_map),  # (Hkv, hd, 2, f/2)
            "group_maps": both(self._group_maps()),  # (G, hd, 2, f/2)
            "log_g": self._log_weight(dtype).to(device),  # (G, rep, 1)
            "one": torch.ones((), dtype=dtype, device=device),
            "gamma_S": None if gamma is None else gamma.view(1, -1, 1, 1, 1),
            "gamma_z": None if gamma is None else gamma.view(1, -1, 1, 1, 1),
        }

    def step_views(self, state) -> dict:
        """``S`` ``(B, Hkv, 2, f/2, hd)`` and ``z`` ``(B, Hkv, 2, f/2, 1)``: the sums by halves of
        ``phi``, as the steady step's einsums read and write them (``z``'s last axis broadcasts
        over ``hd`` in the read)."""
        return {"S": state[3].unflatten(2, (2, -1)), "z": state[4].unflatten(2, (2, -1)).unsqueeze(-1)}

    def _fold_evicted(self, state, slot: int, constants: dict) -> None:
        """Fold the key and value in ``slot`` (rank ``seen - w``, real in the steady state) into
        ``S`` and ``z`` (through their views in ``constants``), after aging them by one token."""
        keys, values = state[0], state[1]
        S, z = constants["S"], constants["z"]
        # (B, Hkv, 1, hd): a slice, not an index, so that a compiled step keeps the slot symbolic
        k_old, v_old = keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1]
        if constants["cast"]:  # half-precision K/V beside float32 sums
            k_old, v_old = k_old.to(S.dtype), v_old.to(S.dtype)
        phi = torch.einsum("bhqd,hdkf->bhkfq", k_old, constants["maps"]).softmax(-2)  # (B, Hkv, 2, f/2, 1)
        if constants["gamma_S"] is not None:
            S.mul_(constants["gamma_S"])
            z.mul_(constants["gamma_z"])
        S.add_(torch.einsum("bhkfq,bhqd->bhkfd", phi, v_old))
        z.add_(phi)

    def _read_window(self, q, keys, values, state, constants: dict) -> torch.Tensor:
        """The token's output ``(B, 1, d_out)``: softmax over the ``s + w`` slots and the state's
        read-out under one normaliser. With ``lse`` the log-sum-exp of the window scores and
        ``o`` the window's softmax output, ``(A + c a) / (Z + c zl)`` with ``c = g e^{-m}`` is
        ``(o + w a) / (1 + w zl)`` with ``w = g e^{-lse}`` (``lse`` clamped from below where the
        other paths clamp ``m``; the two agree unless every window score is below -60); with a
        sharpness ``tau != 1``, ``c = g e^{-tau m}`` and ``w = g e^{m - tau m - lse}``, ``m`` clamped. A KV
        head's query heads stand where SDPA expects query positions, ``(B, G, rep, hd)`` (as for
        the kept heads), so ``o`` is one SDPA call and ``lse`` and ``zl`` come out ``(B, G, rep, 1)``."""
        S, z = constants["S"], constants["z"]
        if constants["cast"]:
            dtype = q.dtype
            q, keys, values = q.to(S.dtype), keys.to(S.dtype), values.to(S.dtype)
        qg = q.view(-1, self.num_heads // self.rep, self.rep, self.head_dim)  # (B, G, rep, hd)
        keys, values, S, z = (t if self.grouped else self._per_query(t) for t in (keys, values, S, z))
        scores = torch.einsum("bgrd,bgsd->bgrs", qg, keys).mul_(self.scaling)
        lse = scores.logsumexp(-1, keepdim=True)
        o = F.scaled_dot_product_attention(qg, keys, values, scale=self.scaling)
        phi_q = torch.einsum("bgrd,gdkf->bgrkf", qg, constants["group_maps"]).softmax(-1)  # (B, G, rep, 2, f/2)
        a = torch.einsum("bgrkf,bgkfd->bgrd", phi_q, S)
        zl = torch.einsum("bgrkf,bgkfe->bgre", phi_q, z)
        if self.sharpness == 1.0:
            w = (constants["log_g"] - lse.clamp_min(_MIN_MAX_SCORE)).exp_()
        else:
            m = scores.amax(-1, keepdim=True).clamp_min(_MIN_MAX_SCORE)
            w = (constants["log_g"] + m + self._minus_tau_m(m) - lse).exp_()
        y = torch.addcmul(o, w, a).div_(torch.addcmul(constants["one"], w, zl)).reshape(-1, 1, self.d_out)
        return y.to(dtype) if constants["cast"] else y

    def _before_write(self, state, slot, rows) -> None:
        """Fold the key that the new token evicts from each row's ring slot ``slot[b]`` (rank
        ``seen - w``, if that is a real token past the sink) into S, z (the per-row step)."""
        keys, values, seen, S, z = state
        k_old, v_old = keys[rows, :, slot], values[rows, :, slot]
        k_old, v_old = k_old.to(S.dtype), v_old.to(S.dtype)  # K/V may be half precision, the sums are not
        phi = _phi(k_old.unsqueeze(2) @ self._maps(k_old.dtype))[:, :, 0]  # (B, Hkv, f)
        phi = phi * (seen - self.window >= self.sink).to(phi.dtype)[:, None, None]
        if self.log_horizon is not None:  # every step ages the state by one token
            gamma = self._cached(("gamma", S.dtype, S.device), lambda: self.log_decay().exp().to(S.device, S.dtype))
            S.mul_(gamma[None, :, None, None])
            z.mul_(gamma[None, :, None])
        S.addcmul_(phi.unsqueeze(-1), v_old.unsqueeze(-2))
        z.add_(phi)

    def _step_combine(self, A, Z, m, qg, state):
        S, z = self._groups(state[3]), self._groups(state[4])
        maps = self._group_maps()
        phi_q = _phi(qg @ (maps if maps.dtype == qg.dtype else maps.to(qg.dtype)))  # (B, G, rep, f)
        a = phi_q @ S  # (B, G, rep, hd)
        zl = phi_q @ z.unsqueeze(-1)
        return self._mix(A, Z, m, a, zl)

    # -- general rank-masked path (masks with holes, fast = False) --------------------------------
    def _general(self, q, k, v, state, mask, window: int, return_states: bool):
        """(B, L, d_out) [, next state] with rank masks, at ``window`` (a training forward's may
        be shorter than the block's). A chunk longer than ``PREFILL_CHUNK`` tokens runs as
        consecutive sub-chunks that carry the state."""
        L = q.shape[2]
        if L <= PREFILL_CHUNK:
            return self._general_chunk(q, k, v, state, mask, window, return_states)
        outs = []
        for start in range(0, L, PREFILL_CHUNK):
            part = slice(start, start + PREFILL_CHUNK)
            chunk = (t[:, :, part] for t in (q, k, v))
            y, state = self._general_chunk(*chunk, state, None if mask is None else mask[:, part], window, True)
            outs.append(y)
        y = torch.cat(outs, 1)
        return (y, state) if return_states else y

    def _general_chunk(self, q, k, v, state, mask, window: int, return_states: bool):
        out, parts = self._attend(q, k, v, state, mask, window, return_states)
        A, Z, a, zl, m = parts
        g = self.old_weight().to(A.dtype)[None, :, None, None] * torch.exp(self._minus_tau_m(m))
        y = (A + g * a) / (Z + g * zl)  # (B, Hq, L, hd)
        B, L = q.shape[0], q.shape[2]
        y = y * out["real"][:, None, :, None].to(y.dtype)
        y = y.transpose(1, 2).reshape(B, L, self.d_out)
        return (y, out["state"]) if return_states else y

    def _attend(self, q, k, v, state, mask, window: int, with_state: bool):
        """Window part (A, Z, m), linear part (a, zl) and, when needed, the next state."""
        B = q.shape[0]
        if not state:
            state = self.empty_state(B, q.device, k.dtype)
        kv_sum, k_sum = state[3], state[4]
        real = self._real(q, mask)
        rank, slot_rank = self._ranks(state[2], real)

        # exact softmax over sink + window, unnormalised, with its running max m
        keys, values = torch.cat([state[0], k], 2), torch.cat([state[1], v], 2)
        allowed = self._visible(rank, torch.cat([slot_rank, rank], 1), window)[:, None]  # (B, 1, L, S)
        scores = (q @ self._per_query(keys).transpose(-1, -2)) * self.scaling  # (B, Hq, L, S)
        scores = scores.masked_fill(~allowed, float("-inf"))
        m = scores.amax(-1, keepdim=True)  # (B, Hq, L, 1)
        p = torch.exp(scores - m)
        A = p @ self._per_query(values)  # (B, Hq, L, hd)
        Z = p.sum(-1, keepdim=True)

        # linear attention over the tokens that left the window: the state holds ranks
        # s .. seen-1-w; the ring slots and the chunk hold the rest, masked by rank
        s = self.sink
        cand_k, cand_v = torch.cat([state[0][:, :, s:], k], 2), torch.cat([state[1][:, :, s:], v], 2)
        cand_rank = torch.cat([slot_rank[:, s:], rank], 1)  # (B, w + L)
        old = (cand_rank[:, None, :] >= self.sink) & (cand_rank[:, None, :] <= rank[:, :, None] - window)  # (B, L, w+L)
        phi_q = self.features(q, per_query=True)  # (B, Hq, L, f)
        phi_k = self.features(cand_k, per_query=False)  # (B, Hkv, w+L, f)
        lin = (phi_q @ self._per_query(phi_k).transpose(-1, -2)) * old[:, None].to(q.dtype)  # (B, Hq, L, w+L)
        a_state, zl_state = phi_q @ self._per_query(kv_sum), phi_q @ self._per_query(k_sum.unsqueeze(-1))
        if self.log_horizon is not None:
            # a token of rank j weighs gamma^(r - window - j) for a query of rank r; the state,
            # whose youngest token has rank seen - 1 - self.window, is aged to the query
            age = (rank[:, :, None] - window - cand_rank[:, None, :]).clamp_min(0)  # (B, L, w+L)
            lin = lin * self._powers(age, "query", q.dtype).transpose(0, 1)
            state_age = (rank - window - (state[2][:, None] - 1 - self.window)).clamp_min(0)  # (B, L)
            aged = self._powers(state_age, "query", q.dtype).transpose(0, 1)[..., None]  # (B, Hq, L, 1)
            a_state, zl_state = a_state * aged, zl_state * aged
        a = lin @ self._per_query(cand_v) + a_state
        zl = lin.sum(-1, keepdim=True) + zl_state

        out = {"real": real, "state": None}
        if with_state:
            window_state = self._next_window_state(state, k, v, rank, slot_rank, real)
            limit = window_state[2] - 1 - self.window  # ranks <= limit are old after the chunk
            fold = ((cand_rank >= self.sink) & (cand_rank <= limit[:, None]) & (cand_rank >= 0)).to(k.dtype)
            phi_fold = phi_k * fold[:, None, :, None]
            if self.log_horizon is not None:  # weights relative to the new youngest rank, limit
                ages = (limit[:, None] - cand_rank).clamp_min(0)  # (B, w+L)
                phi_fold = phi_fold * self._powers(ages, "kv", k.dtype).transpose(0, 1)[..., None]
                moved = self._powers(window_state[2] - state[2], "kv", k.dtype).transpose(0, 1)  # (B, Hkv)
                kv_sum, k_sum = kv_sum * moved[..., None, None], k_sum * moved[..., None]
            out["state"] = window_state + (kv_sum + phi_fold.transpose(-1, -2) @ cand_v, k_sum + phi_fold.sum(2))
        return out, (A, Z, a, zl, m)

    # -- calibration -----------------------------------------------------------------------------
    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> dict:
        """Set ``log_scale`` so that, in geometric mean over queries that have old tokens,
        ``g e^{-tau m} sum_old phi(q).phi(k)`` equals the mass ``sum_old exp(s_t - m)`` that full
        softmax attention gives those tokens; then open the gate (``gate = 1``).

        ``x`` is a batch of this block's inputs ``(B, L, d_in)`` from the original model, without
        padding. Returns the per-head log-scales and the share of softmax mass outside the window.
        """
        B, L, _ = x.shape
        q, k, _ = self._split(x.to(compute_dtype(x.dtype)))
        pos = torch.arange(L, device=x.device)
        i, j = pos[:, None], pos[None, :]
        causal = j <= i
        win = causal & ((i - j < self.window) | (j < self.sink))
        old = causal & ~win
        scores = (q @ self._per_query(k).transpose(-1, -2)) * self.scaling  # (B, Hq, L, L)
        m = scores.masked_fill(~win, float("-inf")).amax(-1, keepdim=True)
        true_old = torch.exp(scores - m).masked_fill(~old, 0).sum(-1)  # (B, Hq, L)
        true_win = torch.exp(scores - m).masked_fill(~win, 0).sum(-1)
        phi = (self.features(q, True) @ self._per_query(self.features(k, False)).transpose(-1, -2)).masked_fill(~old, 0)
        if self.log_horizon is not None:
            phi = phi * self._powers((i - self.window - j).clamp_min(0), "query", phi.dtype)
        lin_old = phi.sum(-1) * torch.exp(self._minus_tau_m(m.squeeze(-1)))
        has_old = old.any(-1)[None, None].expand_as(true_old)
        logs, share = [], []
        for h in range(self.num_heads):
            sel = has_old[:, h]
            t, lo = true_old[:, h][sel].clamp_min(1e-30), lin_old[:, h][sel].clamp_min(1e-30)
            value = float(t.log().mean() - lo.log().mean()) if t.numel() else 0.0
            logs.append(value if math.isfinite(value) else 0.0)
            share.append(float((true_old[:, h] / (true_old[:, h] + true_win[:, h])).mean()))
        self.log_scale.copy_(torch.tensor(logs, dtype=self.log_scale.dtype))
        self.gate.fill_(1.0)
        return {"log_scale": logs, "old_share": share}

    # -- state ablation --------------------------------------------------------------------------
    has_state_ablation = True

    @contextlib.contextmanager
    def state_ablation(self):
        """Within the block, the gate is closed: the trained window alone, the same cache (the
        "state off" rows of ``rfkit eval context`` and ``rfkit sweep --trained``). The gate is
        restored exactly on exit."""
        saved = self.gate.detach().clone()
        try:
            with torch.no_grad():
                self.gate.zero_()
            yield
        finally:
            with torch.no_grad():
                self.gate.copy_(saved)

