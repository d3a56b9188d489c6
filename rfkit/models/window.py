"""Window attention mixers: replaced heads keep attending, but only to a fixed set of tokens.

Two operators of :mod:`rfkit.models.operators` build :class:`WindowAttention`:

- ``SlidingWindowOperator(window=w)``: each replaced head attends to the last ``w`` tokens
  (itself included), as RazorAttention does for its non-retrieval heads.
- ``SinkRecentOperator(sink=s, window=w)``: the first ``s`` tokens (attention sinks) plus the
  last ``w``, as DuoAttention's streaming heads and StreamingLLM do.

The heads keep their pretrained query and key projections (RoPE applied as in the original), so
no training is needed. Their cache is a constant-size state that rides on the same cache object
as the Mamba state (:func:`rfkit.models.cache.mixer_state_store`), so the cache accounting,
``rfkit bench cache`` and ``generate`` treat all operators alike.

Input (the ``qkv`` operator input, see :class:`rfkit.models.operators.ReplacementOperator`): one tensor
``(B, L, Hq*hd + 2*Hkv*hd)`` holding the replaced heads' rotated queries, then their KV heads'
rotated keys and values.

State, per layer: ``(sink_k, sink_v, recent_k, recent_v, seen)``: ``sink_*`` ``(B, Hkv, s, hd)``
hold the first ``s`` real tokens, ``recent_*`` ``(B, Hkv, w, hd)`` the last ``w`` real tokens in
order (empty slots first), ``seen`` ``(B,)`` the number of real tokens so far. Every token has a
rank (its index among the sequence's real tokens); pad tokens have none, so a left-padded prompt
leaves the same state as the unpadded one. A query of rank ``r`` sees the keys of rank ``j <= r``
with ``r - j < w`` or ``j < s``. Slots of the recent buffer whose rank is below ``s`` are left
out of the attention, since the sink buffer holds the same token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class WindowAttention(nn.Module):
    """Attention of ``num_heads`` query heads over a sink + recent window of their KV heads.

    Args:
        kv_for_query: For every replaced query head, the index of its KV head among this
            block's KV heads (GQA; one entry per query head).
        head_dim: Per-head width.
        window: Recent tokens kept, the current one included (w >= 1).
        sink: First tokens kept (s >= 0).
        scaling: Softmax scaling of the scores (the model's ``head_dim ** -0.5``).
    """

    def __init__(self, kv_for_query: list[int], head_dim: int, window: int, sink: int = 0, scaling: float | None = None):
        super().__init__()
        self.kv_for_query = list(kv_for_query)
        self.num_heads = len(self.kv_for_query)
        self.num_kv_heads = max(self.kv_for_query) + 1
        self.head_dim, self.window, self.sink = head_dim, int(window), int(sink)
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.d_in = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.d_out = self.num_heads * head_dim
        self._gather: dict = {}

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, sink={self.sink}, window={self.window}"

    # -- state ---------------------------------------------------------------------------------
    def empty_state(self, batch: int, device, dtype) -> tuple[torch.Tensor, ...]:
        h, d = self.num_kv_heads, self.head_dim
        return (
            torch.zeros(batch, h, self.sink, d, device=device, dtype=dtype),
            torch.zeros(batch, h, self.sink, d, device=device, dtype=dtype),
            torch.zeros(batch, h, self.window, d, device=device, dtype=dtype),
            torch.zeros(batch, h, self.window, d, device=device, dtype=dtype),
            torch.zeros(batch, device=device, dtype=torch.long),
        )

    def state_bytes(self, batch_size: int, dtype=torch.float32) -> int:
        """Bytes of one state for ``batch_size`` sequences with K/V stored in ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        kv = 2 * (self.sink + self.window) * self.num_kv_heads * self.head_dim * itemsize
        return int(batch_size) * (kv + torch.empty((), dtype=torch.long).element_size())

    # -- forward -------------------------------------------------------------------------------
    def _split(self, x: torch.Tensor):
        B, L, _ = x.shape
        hd, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = x.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        return (
            q.view(B, L, hq, hd).transpose(1, 2),
            k.view(B, L, hkv, hd).transpose(1, 2),
            v.view(B, L, hkv, hd).transpose(1, 2),
        )

    def _per_query(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, S, hd) -> (B, Hq, S, hd): each query head's KV head."""
        key = t.device
        if key not in self._gather:
            self._gather[key] = torch.tensor(self.kv_for_query, dtype=torch.long, device=t.device)
        return t.index_select(1, self._gather[key])

    def _ranks(self, seen: torch.Tensor, real: torch.Tensor):
        """Ranks (index among the sequence's real tokens, -1 where there is none) of the chunk's
        tokens ``(B, L)``, of the sink slots ``(B, s)`` and of the recent slots ``(B, w)``."""
        s, w = self.sink, self.window
        rank = torch.where(real, seen[:, None] + real.long().cumsum(1) - 1, -1)
        slots = torch.arange(max(s, w), device=real.device)
        sink_rank = torch.where(slots[None, :s] < seen[:, None], slots[None, :s], -1)
        rec_rank = seen[:, None] - w + slots[None, :w]
        return rank, sink_rank, torch.where(rec_rank >= 0, rec_rank, -1)

    def _visible(self, q_rank: torch.Tensor, key_rank: torch.Tensor, window: int) -> torch.Tensor:
        """(B, L, S) bool: query of rank r sees key of rank j <= r with r - j < window or j < sink.
        Rows with no visible key (pad queries) see every key; their output is zeroed later."""
        qr, kr = q_rank[:, :, None], key_rank[:, None, :]
        allowed = (kr >= 0) & (kr <= qr) & ((qr - kr < window) | (kr < self.sink))
        return allowed | ~allowed.any(-1, keepdim=True)

    def _window_keys(self, state, k: torch.Tensor, v: torch.Tensor, rank, sink_rank, rec_rank):
        """Keys, values and ranks the chunk's queries may attend to: sink slots, recent slots
        (those of rank below ``sink`` are hidden: the sink buffer holds them), chunk tokens."""
        sink_k, sink_v, rec_k, rec_v = state[:4]
        rec_visible = torch.where(rec_rank >= self.sink, rec_rank, -1)
        keys = torch.cat([sink_k, rec_k, k], dim=2)
        values = torch.cat([sink_v, rec_v, v], dim=2)
        return keys, values, torch.cat([sink_rank, rec_visible, rank], dim=1)

    def _next_window_state(self, state, k, v, rank, sink_rank, rec_rank, real):
        """The sink + recent state after the chunk."""
        sink_k, sink_v, rec_k, rec_v, seen = state[:5]
        s, w = self.sink, self.window
        B = k.shape[0]
        slots = torch.arange(max(s, w), device=k.device)
        new_seen = seen + real.long().sum(1)
        new_sink_k, new_sink_v = self._pick(
            torch.cat([sink_rank, rank], 1), torch.cat([sink_k, k], 2), torch.cat([sink_v, v], 2), slots[None, :s].expand(B, s)
        )
        target = new_seen[:, None] - w + slots[None, :w]
        new_rec_k, new_rec_v = self._pick(torch.cat([rec_rank, rank], 1), torch.cat([rec_k, k], 2), torch.cat([rec_v, v], 2), target)
        return new_sink_k, new_sink_v, new_rec_k, new_rec_v, new_seen

    def _real(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, L = x.shape[:2]
        return torch.ones(B, L, dtype=torch.bool, device=x.device) if mask is None else mask.to(torch.bool)

    def forward(self, x: torch.Tensor, *state, return_states: bool = False, mask: torch.Tensor | None = None):
        B, L, _ = x.shape
        q, k, v = self._split(x)
        if not state:
            state = self.empty_state(B, x.device, k.dtype)
        real = self._real(x, mask)
        rank, sink_rank, rec_rank = self._ranks(state[4], real)
        keys, values, key_rank = self._window_keys(state, k, v, rank, sink_rank, rec_rank)
        allowed = self._visible(rank, key_rank, self.window)
        out = F.scaled_dot_product_attention(
            q, self._per_query(keys), self._per_query(values), attn_mask=allowed[:, None], scale=self.scaling
        )
        out = out * real[:, None, :, None].to(out.dtype)
        out = out.transpose(1, 2).reshape(B, L, self.d_out)
        if not return_states:
            return out
        return out, self._next_window_state(state, k, v, rank, sink_rank, rec_rank, real)

    @staticmethod
    def _pick(ranks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, target: torch.Tensor):
        """The entries of ``keys``/``values`` (B, H, S, hd) whose rank (B, S) equals ``target``
        (B, T); zeros where no entry has that rank."""
        match = (ranks[:, None, :] == target[:, :, None]) & (target[:, :, None] >= 0)  # (B, T, S)
        index = match.float().argmax(-1)  # (B, T)
        found = match.any(-1)
        gather = index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
        keep = found[:, None, :, None].to(keys.dtype)
        return keys.gather(2, gather) * keep, values.gather(2, gather) * keep

    def step(self, x: torch.Tensor, *state):
        """One decode token (B, 1, d_in): ``(out, *state)``."""
        out, new = self(x, *state, return_states=True)
        return (out, *new)
