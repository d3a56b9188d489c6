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

State, per layer: ``(keys, values, seen)``. ``keys`` / ``values`` ``(B, Hkv, s + w, hd)`` are a
fixed buffer: slots ``0 .. s-1`` hold the first ``s`` real tokens (the sink), slots ``s .. s+w-1``
a ring of the last ``w`` real tokens, the token of rank ``r >= s`` in slot ``s + r % w``. Tokens of
rank below ``s`` live in the sink only. ``seen`` ``(B,)`` counts the real tokens so far. Every token
has a rank (its index among the sequence's real tokens); pad tokens have none, so a left-padded
prompt leaves the same state as the unpadded one. A query of rank ``r`` sees the keys of rank
``j <= r`` with ``r - j < w`` or ``j < s``.

Three paths compute the same thing (tested against each other and a naive masked attention in
float64):

- :meth:`WindowAttention.step`, one decode token: writes the new key into its ring slot in place
  and attends to the ``s + w`` slots; no allocation of a new state.
- the tiled path (inference and training, no padding or left padding): queries in tiles of
  ``TILE``; a tile attends to the sink and to the ``TILE + w - 1`` keys ending at its last query
  (one strided view of the keys, no copy per tile), so work and memory are linear in the length.
  A training forward runs it at the window it drew (window dropout: possibly shorter than
  ``w``; the state keeps its ``w`` ring slots) and backpropagates through it; the compiled CPU
  kernel serves only forwards that need no gradient, at the full window.
- the general rank-masked path (``L x (s + w + L)`` scores), kept for masks with holes that are
  not left padding, and as the reference: ``WindowAttention.fast = False`` sends every forward,
  training too, through it.

One module because the three paths read and write one state layout (sink slots and a ring) and
are held to each other in the tests; apart, a change to the layout would have to be made in
several files at once.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from rfkit.models.mixer import ReplacementMixer
from rfkit.models.precision import compute_dtype
from rfkit.models.rotary import rotation_matrix
from rfkit.ops import cpu_kernels, flex_window

# Queries per tile of the tiled prefill (the tile attends to TILE + window - 1 recent keys).
# 32 measured fastest on the 2-core CPU at window 56 (16: the same, 64: +12%, 128: +47%).
TILE = 32
# A long prefill runs in pieces of this many tokens that carry the state, so the transient
# buffers stay bounded at any length.
PREFILL_CHUNK = 1024
# The dtypes of the activations and the window's K/V that the compiled step takes (its sums are
# float32 with both: rfkit.ops.cpu_kernels.WINDOW_STEP_ENTRIES). Kept here, not read from
# cpu_kernels, whose stand-in in an exported model has nothing but functions.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def compile_decode_steps(model: torch.nn.Module, **options) -> int:
    """Compile the steady decode step of every window mixer in ``model`` (``torch.compile(...,
    fullgraph=True, dynamic=True, **options)``, e.g. ``mode="reduce-overhead"``, which asks for
    CUDA graphs: docs/generation.md); returns how many. The CPU float32 and bf16 paths keep their
    C step, which is faster there."""
    mixers = [m for m in model.modules() if isinstance(m, WindowAttention)]
    for mixer in mixers:
        mixer.compile_step(**options)
    return len(mixers)


def _rotated(q: torch.Tensor, k: torch.Tensor, rotation) -> tuple[torch.Tensor, torch.Tensor]:
    """The token's query and key rotated by ``rotation`` (``(cos, sin)``) in one product, as the
    converted layer's decode step rotates its heads (:func:`rfkit.models.rotary.rotation_matrix`)."""
    matrix = rotation_matrix(*rotation)
    return q @ matrix, k @ matrix


def ring_ranks(seen: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """(B, w): rank held by each ring slot after ``seen`` real tokens, -1 where empty.

    Slot ``j`` holds the newest rank ``r < seen`` with ``r % w == j``, if that rank is ``>= sink``."""
    j = torch.arange(window, device=seen.device)
    last = seen[:, None] - 1
    rank = last - torch.remainder(last - j[None, :], window)
    return torch.where(rank >= sink, rank, -1)


def left_padding(mask: torch.Tensor) -> list[int] | None:
    """Pad tokens per row when every row of ``mask`` (B, L) is pads then real tokens, else None."""
    real = mask.to(torch.bool)
    count = real.sum(1)
    L = real.shape[1]
    expected = torch.arange(L, device=real.device)[None, :] >= (L - count)[:, None]
    if not torch.equal(real, expected):
        return None
    return (L - count).tolist()


class WindowAttention(ReplacementMixer):
    """Attention of ``num_heads`` query heads over a sink + recent window of their KV heads.

    Args:
        kv_for_query: For every replaced query head, the index of its KV head among this
            block's KV heads (GQA; one entry per query head).
        head_dim: Per-head width.
        window: Recent tokens kept, the current one included (w >= 1).
        sink: First tokens kept (s >= 0).
        scaling: Softmax scaling of the scores (the model's ``head_dim ** -0.5``).
    """

    #: False sends every forward (training too) through the general rank-masked path (tests
    #: compare the two)
    fast: bool = True
    #: the compiled CPU step (rfkit/ops/kernels/window_cpu.c) for float32 and bf16 decoding on CPU,
    #: and the compiled prefill; False keeps the PyTorch paths, their twins
    use_kernel: bool = True
    #: the window part of the tiled prefill and of training forwards: "torch" (the tiles, every
    #: device) or "flex" (one FlexAttention call, rfkit.ops.flex_window: CUDA devices; the tiles
    #: elsewhere); None: what RFKIT_WINDOW_BACKEND names, "torch" when unset
    window_backend: str | None = None
    #: takes activations in the model's dtype: computes in float32 for half precision, keeps the
    #: window's K/V in the activations' dtype (rfkit.models.precision)
    handles_dtype = True

    def __init__(self, kv_for_query: list[int], head_dim: int, window: int, sink: int = 0, scaling: float | None = None):
        super().__init__()
        self.kv_for_query = list(kv_for_query)
        self.num_heads = len(self.kv_for_query)
        self.num_kv_heads = max(self.kv_for_query) + 1
        self.head_dim, self.window, self.sink = head_dim, int(window), int(sink)
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.d_in = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.d_out = self.num_heads * head_dim
        # Query heads grouped by KV head, in order and equally many per group (always so for
        # kv_group selection): queries are viewed as (B, Hkv, rep, L, hd) and keys are never
        # copied per query head. Otherwise every query head is its own group.
        rep = self.num_heads // self.num_kv_heads
        self.grouped = self.kv_for_query == [g for g in range(self.num_kv_heads) for _ in range(rep)]
        self.rep = rep if self.grouped else 1
        self._gather: dict = {}

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, sink={self.sink}, window={self.window}"

    # -- state ---------------------------------------------------------------------------------
    def empty_state(self, batch: int, device, dtype) -> tuple[torch.Tensor, ...]:
        shape = (batch, self.num_kv_heads, self.sink + self.window, self.head_dim)
        return (
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(batch, device=device, dtype=torch.long),
        )

    def state_bytes(self, batch_size: int, dtype=torch.float32) -> int:
        """Bytes of one state for ``batch_size`` sequences with K/V stored in ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        kv = 2 * (self.sink + self.window) * self.num_kv_heads * self.head_dim * itemsize
        return int(batch_size) * (kv + torch.empty((), dtype=torch.long).element_size())

    def slot_ranks(self, seen: torch.Tensor) -> torch.Tensor:
        """(B, s + w): rank held by each slot of the state after ``seen`` tokens, -1 where empty."""
        sink = torch.arange(self.sink, device=seen.device)[None, :].expand(seen.shape[0], -1)
        return torch.cat([torch.where(sink < seen[:, None], sink, -1), ring_ranks(seen, self.sink, self.window)], 1)

    # -- shared pieces -------------------------------------------------------------------------
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
        """(B, Hkv, ...) -> (B, Hq, ...): each query head's KV head."""
        return t.index_select(1, self._per_query_index(t.device))

    def _groups(self, t: torch.Tensor) -> torch.Tensor:
        """KV-head tensor (B, Hkv, ...) -> (B, G, ...), one entry per query group."""
        return t if self.grouped else self._per_query(t)

    def _grouped_queries(self, q: torch.Tensor) -> torch.Tensor:
        """(B, Hq, L, hd) -> (B, G, rep, L, hd)."""
        B, _, L, hd = q.shape
        return q.reshape(B, -1, self.rep, L, hd)

    def _real(self, q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, L = q.shape[0], q.shape[2]
        return torch.ones(B, L, dtype=torch.bool, device=q.device) if mask is None else mask.to(torch.bool)

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        """(B, G, rep, L, hd) or (B, Hq, L, hd) -> (B, L, Hq * hd)."""
        B, L = y.shape[0], y.shape[-2]
        return y.reshape(B, self.num_heads, L, self.head_dim).transpose(1, 2).reshape(B, L, self.d_out)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x, *state, return_states: bool = False, mask: torch.Tensor | None = None):
        """``x`` (B, L, d_in) -> (B, L, d_out) [, next state]; ``x`` may also be the split
        ``(q, k, v)`` that :meth:`attend` takes (the converted layer passes them so, through the
        module's call, so that wrappers such as an FSDP unit gather the weights first)."""
        q, k, v = x if isinstance(x, tuple) else self._split(x)
        return self.attend(q, k, v, *state, return_states=return_states, mask=mask)

    def attend(self, q, k, v, *state, return_states: bool = False, mask: torch.Tensor | None = None):
        """As :meth:`forward`, from the rotated queries (B, Hq, L, hd), keys and values
        (B, Hkv, L, hd) that the converted layer has already split by head."""
        if self.training and not state and mask is None and not return_states and self._train_kernel_ready(q):
            y = cpu_kernels.window_train_cpu(self, q, k, v, self.train_window())
            return y if y.dtype == q.dtype else y.to(q.dtype)
        return self._in_compute_dtype(self._attend_paths, q, k, v, state, return_states, mask)

    def _in_compute_dtype(self, fn, q, k, v, state, return_states: bool, *args):
        """``fn(q, k, v, state, return_states, *args)`` computed in the compute dtype (float32 for
        half-precision activations; :mod:`rfkit.models.precision`): the output comes back in the
        activations' dtype and the window's K/V in the dtype they are kept in; the recurrent sums
        stay in the compute dtype. For float32 and float64 activations it is ``fn`` itself."""
        dtype = q.dtype
        work = compute_dtype(dtype)
        if dtype == work:
            return fn(q, k, v, state, return_states, *args)
        if not state:
            state = self.empty_state(q.shape[0], q.device, k.dtype)
        kv_dtype = state[0].dtype
        up = tuple(t.to(work) if t.is_floating_point() else t for t in state)
        out = fn(q.to(work), k.to(work), v.to(work), up, return_states, *args)
        if not return_states:
            return out.to(dtype)
        y, new = out
        return y.to(dtype), (new[0].to(kv_dtype), new[1].to(kv_dtype), *new[2:])

    def _attend_paths(self, q, k, v, state, return_states: bool, mask: torch.Tensor | None):
        """The path an inference or training call takes (module docstring), in one dtype. A
        training forward draws its window once, whichever path then serves it."""
        window = self.train_window() if self.training else self.window
        if not self.fast:
            return self._general(q, k, v, state, mask, window, return_states)
        if mask is not None:
            pads = left_padding(mask)
            if pads is None:
                return self._general(q, k, v, state, mask, window, return_states)
            return self._prefill_rows(q, k, v, state, pads, return_states, window)
        if not state:  # a fresh state (every training forward): no row has seen a token, nothing to read
            state, seen = self.empty_state(q.shape[0], q.device, k.dtype), 0
        else:  # read on the host (a device sync): the rows' counts decide the path
            counts = state[2]
            if q.shape[0] > 1 and not bool((counts == counts[0]).all()):
                return self._prefill_rows(q, k, v, state, [0] * q.shape[0], return_states, window)
            seen = int(counts[0])
        y, new = self._prefill(q, k, v, state, seen, return_states, window)
        return (y, new) if return_states else y

    def train_window(self) -> int:
        """The window a training forward uses (the hybrid shortens it at random)."""
        return self.window

    def _prefill_rows(self, q, k, v, state, pads: list[int], return_states: bool, window: int):
        """Left-padded (or unevenly advanced) batch: each row's real tokens run on their own."""
        B, L = q.shape[0], q.shape[2]
        if not state:
            state = self.empty_state(B, q.device, k.dtype)
        y = q.new_zeros(B, L, self.d_out)
        rows = []
        for b, pad in enumerate(pads):
            row_state = tuple(t[b : b + 1] for t in state)
            if pad < L:
                one = (t[b : b + 1, :, pad:] for t in (q, k, v))
                y_b, row_state = self._prefill(*one, row_state, int(row_state[2][0]), True, window)
                y[b, pad:] = y_b[0]
            rows.append(row_state)
        if not return_states:
            return y
        return y, tuple(torch.cat(parts, 0) for parts in zip(*rows))

    def _prefill(self, q, k, v, state, seen: int, return_states: bool, window: int):
        """Tiled forward of one chunk at ``window`` (<= ``self.window``), every row having
        ``seen`` tokens before it. The PyTorch tiles run in pieces of PREFILL_CHUNK tokens (also
        what autograd keeps stays linear in the length); the compiled kernel, whose memory does
        not grow with the length, takes the chunk whole. The kernel has no backward and knows
        only the full window: a forward that needs a gradient, or a shorter window, never
        reaches it; nor does any training-mode forward, so that activation checkpointing's
        recompute takes the path its forward took whatever the grad flags then (FSDP's unsharded
        weights, a reentrant checkpoint's no-grad first pass)."""
        outs = []
        L = q.shape[2]
        kernel = (
            not self.training and window == self.window and not self._needs_grad(q, k, v, state) and self._kernel_ready(q, state)
        )
        flex = not kernel and self._flex_ready(q, k, v, state)
        piece_len = L if kernel or flex else PREFILL_CHUNK  # FlexAttention's memory is linear in L too
        for start in range(0, L, piece_len):
            piece = slice(start, start + piece_len)
            last = start + piece_len >= L
            parts = (q[:, :, piece], k[:, :, piece], v[:, :, piece])
            y, state = self._prefill_piece(*parts, state, seen + start, return_states or not last, window, kernel, flex)
            outs.append(y)
        y = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        return y, state

    def _needs_grad(self, q, k, v, state) -> bool:
        """Whether autograd records this forward: any input, state tensor or weight of the block
        requires a gradient (a frozen model's first trained block gets queries that do not)."""
        if not torch.is_grad_enabled():
            return False
        return any(t.requires_grad for t in (q, k, v, *state)) or any(p.requires_grad for p in self.parameters())

    def _prefill_piece(self, q, k, v, state, seen: int, with_state: bool, window: int, kernel: bool, flex: bool = False):
        ctx = self._context(state, k, v, seen, window)
        if kernel:
            y, linear = cpu_kernels.window_prefill_cpu(self, q, ctx, state, seen)
            new = WindowAttention._next_state(self, state, ctx, seen, q.shape[2]) + linear if with_state else None
            return y, new
        A, Z, m = self._flex_window_sums(q, ctx, seen) if flex else self._window_sums(q, ctx, seen)
        y = self._combine(A, Z, m, q, ctx, state, seen)
        new = self._next_state(state, ctx, seen, q.shape[2]) if with_state else None
        return self._output(y), new

    def _context(self, state, k, v, seen: int, window: int) -> dict:
        """The sink keys and the recent keys in rank order: the ring (ranks seen-w .. seen-1,
        ``w`` the block's window) followed by the chunk, with each recent key's validity (rank >=
        sink), and the ``window`` the queries attend over (a drawn training window may be
        shorter than ``w``: the ring's oldest ``w - window`` keys are then outside it)."""
        s, w = self.sink, self.window
        keys, values = state[0], state[1]
        L = k.shape[2]
        shift = seen % w
        ring_k, ring_v = keys[:, :, s:], values[:, :, s:]
        if shift:
            ring_k, ring_v = torch.roll(ring_k, -shift, 2), torch.roll(ring_v, -shift, 2)
        sink_k, sink_v = keys[:, :, :s], values[:, :, :s]
        if seen < s:  # the chunk's first tokens are sink tokens
            n = min(s, seen + L) - seen
            sink_k, sink_v = sink_k.clone(), sink_v.clone()
            sink_k[:, :, seen : seen + n], sink_v[:, :, seen : seen + n] = k[:, :, :n], v[:, :, :n]
        rec_rank = torch.arange(seen - w, seen + L, device=k.device)
        return {
            "sink_k": sink_k,
            "sink_v": sink_v,
            "rec_k": torch.cat([ring_k, k], 2),  # (B, Hkv, w + L, hd), rank seen - w + index
            "rec_v": torch.cat([ring_v, v], 2),
            "rec_valid": rec_rank >= max(s, 0),
            "length": L,
            "window": window,
        }

    def _window_sums(self, q, ctx, seen: int):
        """Unnormalised exact attention over the window: ``A`` (B, G, rep, L, hd), ``Z`` and the
        running max ``m`` (B, G, rep, L, 1), in tiles of TILE queries. At a window shorter than
        the block's, the recent keys start ``self.window - w`` keys later (the same layout)."""
        s, w = self.sink, ctx["window"]
        skip = self.window - w
        B, _, L, hd = q.shape
        T = TILE
        nT = -(-L // T)
        qg = self._grouped_queries(q * self.scaling)  # (B, G, rep, L, hd)
        if nT * T != L:
            qg = F.pad(qg, (0, 0, 0, nT * T - L))
        qt = qg.view(B, qg.shape[1], self.rep, nT, T, hd)
        span = T + w - 1
        rec_k, rec_v = self._groups(ctx["rec_k"][:, :, skip:]), self._groups(ctx["rec_v"][:, :, skip:])
        need = nT * T + w  # recent index of the last padded query is w - 1 + nT * T
        extra = need - rec_k.shape[2]
        if extra > 0:
            rec_k, rec_v = F.pad(rec_k, (0, 0, 0, extra)), F.pad(rec_v, (0, 0, 0, extra))
        # tile t's keys: recent indices 1 + tT .. tT + T + w - 1 (a strided view, no copy)
        k_tiles = rec_k[:, :, 1:].unfold(2, span, T)[:, :, :nT]  # (B, G, nT, hd, span)
        v_tiles = rec_v[:, :, 1:].unfold(2, span, T)[:, :, :nT]
        scores = qt @ k_tiles.unsqueeze(2)  # (B, G, rep, nT, T, span)
        valid = torch.cat([ctx["rec_valid"][skip:], ctx["rec_valid"].new_zeros(max(0, extra))])
        valid = valid[1:].unfold(0, span, T)[:nT]  # (nT, span)
        qi = torch.arange(T, device=q.device)[:, None]
        kj = torch.arange(span, device=q.device)[None, :]
        band = (kj >= qi) & (kj <= qi + w - 1)  # (T, span)
        allowed = band[None] & valid[:, None, :]  # (nT, T, span)
        scores = scores.masked_fill(~allowed, float("-inf"))
        m = scores.amax(-1, keepdim=True)
        if s:
            sink_scores = torch.einsum("bgrld,bgsd->bgrls", qg, self._groups(ctx["sink_k"]))  # (B, G, rep, nT*T, s)
            rank = seen + torch.arange(nT * T, device=q.device)
            sink_ok = torch.arange(s, device=q.device)[None, :] <= rank[:, None]  # (nT*T, s)
            sink_scores = sink_scores.masked_fill(~sink_ok, float("-inf")).view(B, -1, self.rep, nT, T, s)
            m = torch.maximum(m, sink_scores.amax(-1, keepdim=True))
        m = m.clamp_min(torch.finfo(m.dtype).min)  # rows with no key at all (padding queries)
        p = torch.exp(scores - m)
        A = torch.einsum("bgrtqs,bgtds->bgrtqd", p, v_tiles)
        Z = p.sum(-1, keepdim=True)
        if s:
            ps = torch.exp(sink_scores - m)
            A = A + torch.einsum("bgrtqs,bgsd->bgrtqd", ps, self._groups(ctx["sink_v"]))
            Z = Z + ps.sum(-1, keepdim=True)
        G = qg.shape[1]
        flat = lambda t: t.reshape(B, G, self.rep, nT * T, t.shape[-1])[:, :, :, :L]  # noqa: E731
        return flat(A), flat(Z), flat(m)

    def _flex_ready(self, q, k, v, state) -> bool:
        """FlexAttention serves the window part (:mod:`rfkit.ops.flex_window`): chosen
        (``window_backend``), on CUDA (or on the CPU with ``flex_window.CPU_EAGER``, for
        a forward without a gradient: the CPU has no FlexAttention backward), for a block whose
        combination reads the window through its log-sum-exp alone (:meth:`_flex_computes_me`)."""
        field = flex_window.ENV if self.window_backend is None else "WindowAttention.window_backend"
        if flex_window.resolve(self.window_backend, field) == "torch" or not flex_window.serves(q.device):
            return False
        if q.device.type != "cuda" and self._needs_grad(q, k, v, state):
            return False
        return self._flex_computes_me()

    def _flex_computes_me(self) -> bool:
        """Whether this block's combination of the window sums holds with ``A = out``, ``Z = 1``
        and ``m`` the log-sum-exp (:mod:`rfkit.ops.flex_window`): true for ``A / Z``."""
        return True

    def _flex_window_sums(self, q, ctx, seen: int):
        """:meth:`_window_sums` through one FlexAttention call: ``A`` the normalised output, ``Z``
        ones and ``m`` the log-sum-exp, in the same shapes (B, G, rep, L, hd / 1)."""
        B, _, L, hd = q.shape
        keys = torch.cat([ctx["sink_k"], ctx["rec_k"]], 2)  # (B, Hkv, s + w + L, hd), w the ring's slots
        values = torch.cat([ctx["sink_v"], ctx["rec_v"]], 2)
        if not self.grouped:  # every query head its own group: its KV head's keys, per query head
            keys, values = self._per_query(keys), self._per_query(values)
        out, lse = flex_window.window_attention(
            q, keys, values, seen=seen, sink=self.sink, ring=self.window, window=ctx["window"], scaling=self.scaling,
            gqa=self.grouped and self.rep > 1,
        )  # fmt: skip
        G = q.shape[1] // self.rep
        A = out.view(B, G, self.rep, L, hd)
        m = lse.view(B, G, self.rep, L, 1).to(A.dtype)
        return A, torch.ones_like(m), m

    def _combine(self, A, Z, m, q, ctx, state, seen: int):
        """The output (B, G, rep, L, hd) from the window sums (the hybrid adds its state here)."""
        return A / Z

    def _next_state(self, state, ctx, seen: int, L: int) -> tuple[torch.Tensor, ...]:
        """The state after the chunk: sink, the last w recent keys back into their ring slots."""
        s, w = self.sink, self.window
        new_seen = seen + L
        rec_k, rec_v = ctx["rec_k"][:, :, -w:], ctx["rec_v"][:, :, -w:]  # ranks new_seen - w ...
        keep = ctx["rec_valid"][-w:][None, None, :, None].to(rec_k.dtype)
        shift = new_seen % w
        ring_k, ring_v = torch.roll(rec_k * keep, shift, 2), torch.roll(rec_v * keep, shift, 2)
        keys = torch.cat([ctx["sink_k"], ring_k], 2)
        values = torch.cat([ctx["sink_v"], ring_v], 2)
        return keys, values, torch.full_like(state[2], new_seen)

    # -- one decode token ----------------------------------------------------------------------
    def step(self, x: torch.Tensor, *state, seen: int | None = None):
        """One decode token (B, 1, d_in): ``(out, *state)``, the state updated in place
        (``seen``: as :meth:`step_qkv`)."""
        return self.step_qkv(*self._split(x), *state, seen=seen)

    #: ``step_qkv`` takes ``seen=``: the tokens every row has seen, when the caller knows it on the
    #: host (the converted layer counts them); the step then needs no per-row bookkeeping
    takes_seen = True
    #: the compiled steady step (:meth:`compile_step`), None: eager
    _compiled_steady = None

    #: ``step_qkv`` takes ``rotation=``: the query and key unrotated with the token's rotary
    #: ``(cos, sin)``, rotated by the step (inside the compiled C step, which then takes them as
    #: views of the layer's packed projection: no rotation and no split of its own)
    takes_rotation = True

    def step_qkv(self, q, k, v, *state, seen: int | None = None, rotation=None):
        """As :meth:`step`, from the token's rotated query, key and value split by head
        ``(B, H, 1, hd)``; or, with ``rotation`` (``(cos, sin)``, each ``(B, 1, hd)``), from its
        unrotated query and key, rotated here as :func:`rfkit.models.rotary.rotation_matrix` does.

        ``seen`` is the number of real tokens every row has seen before this one, when the caller
        knows it (None: rows may differ, e.g. after a left-padded prompt). Past the first
        ``sink + window`` tokens the slot the token goes to is then a host integer and the step is
        one fixed sequence of tensor ops, the same on every device, with no host sync
        (:meth:`_steady_step`; :meth:`compile_step` compiles it). Otherwise every row's slot is
        computed on the device (:meth:`_row_step`). On CPU in float32, and in bf16 with the window's
        K/V in bf16, the compiled C step runs (:meth:`_kernel_ready`)."""
        if not self.fast or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            if rotation is not None:
                q, k = _rotated(q, k, rotation)
            general = lambda q, k, v, state, _, mask: self._general(q, k, v, state, mask, self.window, True)  # noqa: E731
            out, new = self._in_compute_dtype(general, q, k, v, state, True, None)  # keep autograd intact
            return (out, *new)
        plan = self._step_plan(q, state)
        if plan["kernel"]:
            return (cpu_kernels.window_step_planned(plan, q, k, v, rotation), *state)
        if rotation is not None:
            q, k = _rotated(q, k, rotation)
        if seen is not None and seen >= self.sink + self.window:
            steady = self._compiled_steady or self._steady_step
            return (steady(q, k, v, state, self.sink + seen % self.window, plan["constants"]), *state)
        return (self._row_step(q, k, v, state), *state)

    def compile_step(self, **options) -> None:
        """Run the steady decode step through ``torch.compile(fullgraph=True, dynamic=True,
        **options)`` from now on (the slot is a symbolic integer: one graph for every step)."""
        self._compiled_steady = torch.compile(self._steady_step, fullgraph=True, dynamic=True, **options)

    def _step_plan(self, q: torch.Tensor, state) -> dict:
        """What the decode steps of one state share, worked out on its first step and kept while the
        state's tensors are the same objects (a new prefill or a beam reorder makes new ones):
        whether the compiled C step applies, its pointers, :meth:`step_constants` and
        :meth:`step_views`."""
        plan = self.__dict__.get("_plan")
        if plan is not None and len(plan["state"]) == len(state) and all(ref() is t for ref, t in zip(plan["state"], state)):
            return plan
        kernel = self._kernel_ready(q, state)
        work = compute_dtype(q.dtype)
        with torch.no_grad():
            constants = dict(self.step_constants(work, q.device), cast=q.dtype != work or state[0].dtype != work)
            constants.update(self.step_views(state))
        plan = {"state": [weakref.ref(t) for t in state], "kernel": kernel, "constants": constants}
        if kernel:
            plan.update(cpu_kernels.window_step_plan(self, state))
        self.__dict__["_plan"] = plan
        return plan

    def step_views(self, state) -> dict:
        """Views of the state's tensors in the shapes the steady step reads them in (none for plain
        window attention), made once per state by :meth:`_step_plan` (a view is a tensor call): the
        plan is remade whenever any of the state's tensors is replaced, so its views always alias
        the current state (splitting or adding an axis is a view for any strides)."""
        return {}

    def step_constants(self, dtype, device) -> dict:
        """Tensors derived from the weights that every decode step reads (none for plain window
        attention); computed once per state by :meth:`_step_plan`, so weights changed in the middle
        of a generation take effect at the next prefill."""
        return {}

    def _steady_step(self, q, k, v, state, slot: int, constants: dict) -> torch.Tensor:
        """One token, every row past ``sink + window`` tokens, ``slot`` (host int) the ring slot it
        evicts and fills: the same ops on every device and step. Returns ``(B, 1, d_out)``."""
        keys, values, seen = state[0], state[1], state[2]
        self._fold_evicted(state, slot, constants)
        keys[:, :, slot : slot + 1] = k
        values[:, :, slot : slot + 1] = v
        seen.add_(1)
        return self._read_window(q, keys, values, state, constants)

    def _fold_evicted(self, state, slot: int, constants: dict) -> None:
        """Hook before the new token overwrites ``slot`` in the steady step (the hybrid folds the
        evicted key into its state)."""

    def _read_window(self, q, keys, values, state, constants: dict) -> torch.Tensor:
        """The step's output ``(B, 1, d_out)`` in ``q``'s dtype: attention of the token's query over
        the ``s + w`` slots, all real in the steady state (computed in float32 for half precision)."""
        if constants["cast"]:
            dtype = q.dtype
            q, keys, values = (t.to(compute_dtype(dtype)) for t in (q, keys, values))
        if not self.grouped:
            keys, values = self._per_query(keys), self._per_query(values)
        y = F.scaled_dot_product_attention(q, keys, values, scale=self.scaling, enable_gqa=self.rep > 1)
        y = y.reshape(-1, 1, self.d_out)
        return y.to(dtype) if constants["cast"] else y

    def _combined_read(self, q, keys, values, state, constants: dict) -> torch.Tensor:
        """:meth:`_read_window` for a subclass that adds its state through :meth:`_step_combine`."""
        dtype = q.dtype
        work = compute_dtype(dtype)
        q, keys, values = (t if not constants["cast"] else t.to(work) for t in (q, keys, values))
        return self._read_and_combine(q, keys, values, state).reshape(-1, 1, self.d_out).to(dtype)

    def _read_and_combine(self, q, keys, values, state, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The token's query ``(B, Hq, 1, hd)`` over the ``s + w`` slots (only the ``allowed`` ones,
        ``(B, s + w)``, where given), all in one dtype: the window's unnormalised sums, then
        :meth:`_step_combine`; ``(B, G, rep, hd)``."""
        qg = self._grouped_queries(q)[:, :, :, 0]  # (B, G, rep, hd)
        scores = (qg * self.scaling) @ self._groups(keys).transpose(-1, -2)  # (B, G, rep, s + w)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - m)
        return self._step_combine(p @ self._groups(values), p.sum(-1, keepdim=True), m, qg, state)

    def _row_step(self, q, k, v, state) -> torch.Tensor:
        """One token with each row's slot computed on the device: rows at different counts (a
        left-padded prompt) and the first ``s + w`` tokens, where some slots are still empty."""
        B = q.shape[0]
        dtype, work = q.dtype, compute_dtype(q.dtype)  # half-precision activations: computed in float32
        q, k, v = (t if t.dtype == work else t.to(work) for t in (q, k, v))
        keys, values, seen = state[0], state[1], state[2]
        s, w = self.sink, self.window
        rows = torch.arange(B, device=q.device)
        ring_slot = s + torch.remainder(seen, w)
        self._before_write(state, ring_slot, rows)
        slot = torch.where(seen < s, seen, ring_slot)
        keys[rows, :, slot] = k[:, :, 0].to(keys.dtype)
        values[rows, :, slot] = v[:, :, 0].to(values.dtype)
        allowed = self.slot_ranks(seen + 1) >= 0  # (B, s + w)
        keys, values = (t if t.dtype == work else t.to(work) for t in (keys, values))  # the window: s + w tokens
        y = self._read_and_combine(q, keys, values, state, allowed)
        seen.add_(1)
        return y.reshape(B, 1, self.d_out).to(dtype)

    def _kernel_ready(self, q: torch.Tensor, state) -> bool:
        """The compiled step applies: inference on CPU with the activations and the window's K/V in
        one dtype the kernel takes (float32, or bf16 beside float32 sums: a bf16 model's precision
        policy; :data:`KERNEL_DTYPES`), contiguous state, kernel built. The prefill asks it in the
        compute dtype (float32 for bf16 activations: :meth:`_in_compute_dtype`)."""
        if not self.use_kernel or q.device.type != "cpu" or q.dtype not in KERNEL_DTYPES:
            return False
        if state[0].dtype != q.dtype or state[1].dtype != q.dtype or state[2].dtype != torch.long:
            return False
        if any(t.dtype != torch.float32 for t in state[3:]) or not all(t.is_contiguous() for t in state):
            return False
        return cpu_kernels.available()

    def _train_kernel_ready(self, q: torch.Tensor) -> bool:
        """The compiled training forward and backward applies (:func:`rfkit.ops.cpu_kernels.window_train_cpu`):
        a training-mode forward of a whole block from an empty state, without padding, through the
        tiled path (``fast``), on CPU, computed in float32 (bf16 activations too: their compute
        dtype, :mod:`rfkit.models.precision`), weights float32, kernel built. It asks nothing of
        the grad flags, so that an activation checkpoint's recompute takes the path its forward took."""
        if not (self.use_kernel and self.fast and self._train_kernel_computes_me()):
            return False
        if q.device.type != "cpu" or compute_dtype(q.dtype) != torch.float32:
            return False
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in self.parameters()):
            return False
        return cpu_kernels.available()

    def _train_kernel_computes_me(self) -> bool:
        """Whether the training kernel's formula is this block's: plain window attention here (the
        hybrid says so for itself); a subclass that adds to the window (HybridMambaAttention's
        Mamba state) is not, unless it says so."""
        return type(self) is WindowAttention

    def kernel_index(self) -> torch.Tensor:
        """``kv_for_query`` as a CPU int64 tensor (the compiled step reads it)."""
        return self._per_query_index(torch.device("cpu"))

    def _per_query_index(self, device) -> torch.Tensor:
        if device not in self._gather:
            self._gather[device] = torch.tensor(self.kv_for_query, dtype=torch.long, device=device)
        return self._gather[device]

    def _before_write(self, state, slot, rows) -> None:
        """Hook run before the new token overwrites ``slot`` in :meth:`_row_step` (the hybrid folds
        the evicted key)."""

    def _step_combine(self, A, Z, m, qg, state):
        return A / Z

    # -- general rank-masked path --------------------------------------------------------------
    def _ranks(self, seen: torch.Tensor, real: torch.Tensor):
        """Ranks (index among the sequence's real tokens, -1 where there is none) of the chunk's
        tokens ``(B, L)`` and of the state's slots ``(B, s + w)``."""
        rank = torch.where(real, seen[:, None] + real.long().cumsum(1) - 1, -1)
        return rank, self.slot_ranks(seen)

    def _visible(self, q_rank: torch.Tensor, key_rank: torch.Tensor, window: int) -> torch.Tensor:
        """(B, L, S) bool: query of rank r sees key of rank j <= r with r - j < window or j < sink.
        Rows with no visible key (pad queries) see every key; their output is zeroed later."""
        qr, kr = q_rank[:, :, None], key_rank[:, None, :]
        allowed = (kr >= 0) & (kr <= qr) & ((qr - kr < window) | (kr < self.sink))
        return allowed | ~allowed.any(-1, keepdim=True)

    def _next_window_state(self, state, k, v, rank, slot_rank, real):
        """The sink + ring state after the chunk (general path)."""
        new_seen = state[2] + real.long().sum(1)
        keys, values = self._pick(
            torch.cat([slot_rank, rank], 1), torch.cat([state[0], k], 2), torch.cat([state[1], v], 2), self.slot_ranks(new_seen)
        )
        return keys, values, new_seen

    def _general(self, q, k, v, state, mask, window: int, return_states: bool):
        B, L = q.shape[0], q.shape[2]
        if not state:
            state = self.empty_state(B, q.device, k.dtype)
        real = self._real(q, mask)
        rank, slot_rank = self._ranks(state[2], real)
        keys, values = torch.cat([state[0], k], 2), torch.cat([state[1], v], 2)
        allowed = self._visible(rank, torch.cat([slot_rank, rank], 1), window)
        out = F.scaled_dot_product_attention(
            q, self._per_query(keys), self._per_query(values), attn_mask=allowed[:, None], scale=self.scaling
        )
        out = out * real[:, None, :, None].to(out.dtype)
        out = out.transpose(1, 2).reshape(B, L, self.d_out)
        if not return_states:
            return out
        return out, self._next_window_state(state, k, v, rank, slot_rank, real)

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
