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
:meth:`HybridWindowAttention.calibrate` sets ``log_scale`` in closed form from the teacher's
attention before training opens the gate.

Window dropout: in training mode, with probability ``window_dropout`` a forward uses a random
shorter window (between ``window // 4`` and ``window``), so the tokens between the two must be
carried by the state. Without it a trained state can stay unused (the window alone already
fits short text well).

State, per layer: the window's ``(sink_k, sink_v, recent_k, recent_v, seen)`` plus ``S``
``(B, Hkv, f, hd)`` and ``z`` ``(B, Hkv, f)``: constant in the sequence length.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from rfkit.models.window import WindowAttention

# exp(-m) is evaluated with m clamped from below, so a query whose window scores are all very
# negative cannot overflow the old tokens' weight.
_MIN_MAX_SCORE = -60.0
# Longer chunks are processed in sub-chunks of this many tokens (scores are L x (window + L)).
PREFILL_CHUNK = 1024


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
    """

    def __init__(
        self,
        kv_for_query: list[int],
        head_dim: int,
        window: int,
        sink: int = 4,
        scaling: float | None = None,
        feature_dim: int = 16,
        window_dropout: float = 0.0,
    ):
        super().__init__(kv_for_query, head_dim, window=window, sink=sink, scaling=scaling)
        self.feature_dim = int(feature_dim)
        self.window_dropout = float(window_dropout)
        half = self.feature_dim // 2
        self.feature_map = nn.Parameter(torch.randn(self.num_kv_heads, head_dim, half) * head_dim**-0.5)
        self.gate = nn.Parameter(torch.zeros(self.num_heads))
        self.log_scale = nn.Parameter(torch.zeros(self.num_heads))
        self._generator: torch.Generator | None = None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_dim={self.feature_dim}, window_dropout={self.window_dropout}"

    # -- state ---------------------------------------------------------------------------------
    def empty_state(self, batch: int, device, dtype) -> tuple[torch.Tensor, ...]:
        f, h, d = self.feature_dim, self.num_kv_heads, self.head_dim
        return super().empty_state(batch, device, dtype) + (
            torch.zeros(batch, h, f, d, device=device, dtype=dtype),
            torch.zeros(batch, h, f, device=device, dtype=dtype),
        )

    def state_bytes(self, batch_size: int, dtype=torch.float32) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        linear = self.num_kv_heads * self.feature_dim * (self.head_dim + 1) * itemsize
        return super().state_bytes(batch_size, dtype) + int(batch_size) * linear

    # -- pieces ----------------------------------------------------------------------------------
    def features(self, x: torch.Tensor, per_query: bool) -> torch.Tensor:
        """phi(x) ``(B, H, L, f)`` for keys (``per_query=False``, H = KV heads) or queries (each
        query head uses its KV head's map)."""
        w = self._per_query(self.feature_map.unsqueeze(0))[0] if per_query else self.feature_map
        proj = torch.einsum("bhld,hdf->bhlf", x, w.to(x.dtype))
        return torch.cat([proj.softmax(-1), (-proj).softmax(-1)], dim=-1)

    def old_weight(self) -> torch.Tensor:
        """``g`` per query head ``(Hq,)``: 0 while the gate is closed."""
        return self.gate.clamp_min(0) * self.log_scale.exp()

    def _train_window(self) -> int:
        if not self.training or self.window_dropout <= 0 or self.window < 2:
            return self.window
        if float(torch.rand((), generator=self._generator)) >= self.window_dropout:
            return self.window
        low = max(1, self.window // 4)
        return int(torch.randint(low, self.window + 1, (), generator=self._generator))

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *state, return_states: bool = False, mask: torch.Tensor | None = None):
        """``x`` (B, L, d_in) -> (B, L, d_out) [, next state]. A chunk longer than
        ``PREFILL_CHUNK`` tokens runs as consecutive sub-chunks that carry the state (the same
        result: the state is exact), so memory stays linear in L instead of L x L."""
        window = self._train_window()  # one window for the whole forward
        L = x.shape[1]
        if L <= PREFILL_CHUNK:
            return self._forward_chunk(x, state, mask, window, return_states)
        outs = []
        for start in range(0, L, PREFILL_CHUNK):
            part = slice(start, start + PREFILL_CHUNK)
            y, state = self._forward_chunk(x[:, part], state, None if mask is None else mask[:, part], window, True)
            outs.append(y)
        y = torch.cat(outs, 1)
        return (y, state) if return_states else y

    def _forward_chunk(self, x, state, mask, window: int, return_states: bool):
        out, parts = self._attend(x, state, mask, window, return_states)
        A, Z, a, zl, m = parts
        g = self.old_weight().to(A.dtype)[None, :, None, None] * torch.exp(-m.clamp_min(_MIN_MAX_SCORE))
        y = (A + g * a) / (Z + g * zl)  # (B, Hq, L, hd)
        B, L = x.shape[:2]
        y = y * out["real"][:, None, :, None].to(y.dtype)
        y = y.transpose(1, 2).reshape(B, L, self.d_out)
        return (y, out["state"]) if return_states else y

    def _attend(self, x, state, mask, window: int, with_state: bool):
        """Window part (A, Z, m), linear part (a, zl) and, when needed, the next state."""
        B, L, _ = x.shape
        q, k, v = self._split(x)
        if not state:
            state = self.empty_state(B, x.device, k.dtype)
        kv_sum, k_sum = state[5], state[6]
        real = self._real(x, mask)
        rank, sink_rank, rec_rank = self._ranks(state[4], real)

        # exact softmax over sink + window, unnormalised, with its running max m
        keys, values, key_rank = self._window_keys(state, k, v, rank, sink_rank, rec_rank)
        allowed = self._visible(rank, key_rank, window)[:, None]  # (B, 1, L, S)
        scores = (q @ self._per_query(keys).transpose(-1, -2)) * self.scaling  # (B, Hq, L, S)
        scores = scores.masked_fill(~allowed, float("-inf"))
        m = scores.amax(-1, keepdim=True)  # (B, Hq, L, 1)
        p = torch.exp(scores - m)
        A = p @ self._per_query(values)  # (B, Hq, L, hd)
        Z = p.sum(-1, keepdim=True)

        # linear attention over the tokens that left the window: the state holds ranks
        # s .. seen-1-w; the recent slots and the chunk hold the rest, masked by rank
        cand_k, cand_v = torch.cat([state[2], k], 2), torch.cat([state[3], v], 2)
        cand_rank = torch.cat([rec_rank, rank], 1)  # (B, w + L)
        old = (cand_rank[:, None, :] >= self.sink) & (cand_rank[:, None, :] <= rank[:, :, None] - window)  # (B, L, w+L)
        phi_q = self.features(q, per_query=True)  # (B, Hq, L, f)
        phi_k = self.features(cand_k, per_query=False)  # (B, Hkv, w+L, f)
        lin = (phi_q @ self._per_query(phi_k).transpose(-1, -2)) * old[:, None].to(q.dtype)  # (B, Hq, L, w+L)
        a = lin @ self._per_query(cand_v) + phi_q @ self._per_query(kv_sum)
        zl = lin.sum(-1, keepdim=True) + phi_q @ self._per_query(k_sum.unsqueeze(-1))

        out = {"real": real, "state": None}
        if with_state:
            window_state = self._next_window_state(state, k, v, rank, sink_rank, rec_rank, real)
            limit = window_state[4] - 1 - self.window  # ranks <= limit are old after the chunk
            fold = ((cand_rank >= self.sink) & (cand_rank <= limit[:, None]) & (cand_rank >= 0)).to(k.dtype)
            phi_fold = phi_k * fold[:, None, :, None]
            out["state"] = window_state + (kv_sum + phi_fold.transpose(-1, -2) @ cand_v, k_sum + phi_fold.sum(2))
        return out, (A, Z, a, zl, m)

    # -- calibration -----------------------------------------------------------------------------
    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> dict:
        """Set ``log_scale`` so that, in geometric mean over queries that have old tokens,
        ``g e^{-m} sum_old phi(q).phi(k)`` equals the mass ``sum_old exp(s_t - m)`` that full
        softmax attention gives those tokens; then open the gate (``gate = 1``).

        ``x`` is a batch of this block's inputs ``(B, L, d_in)`` from the original model, without
        padding. Returns the per-head log-scales and the share of softmax mass outside the window.
        """
        B, L, _ = x.shape
        q, k, _ = self._split(x)
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
        lin_old = phi.sum(-1) * torch.exp(-m.squeeze(-1).clamp_min(_MIN_MAX_SCORE))
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


@contextlib.contextmanager
def state_off(model: nn.Module):
    """Within the block, every hybrid block of ``model`` runs with its gate closed: its trained
    window alone, the ablation that shows what the state adds (the cache is unchanged)."""
    blocks = [m for m in model.modules() if isinstance(m, HybridWindowAttention)]
    saved = [b.gate.detach().clone() for b in blocks]
    try:
        with torch.no_grad():
            for b in blocks:
                b.gate.zero_()
        yield len(blocks)
    finally:
        with torch.no_grad():
            for b, g in zip(blocks, saved):
                b.gate.copy_(g)
