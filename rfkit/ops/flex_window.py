"""The window mixers' sink + window attention as one FlexAttention call, for GPUs.

The tiled path of :mod:`rfkit.models.window` computes the exact part of every window mixer
(:class:`~rfkit.models.window.WindowAttention`, the hybrid, the hybrid Mamba block) in tiles of
``TILE`` queries, each against the ``TILE + window - 1`` keys before it: a handful of batched
products and masks over ``L x (TILE + window - 1)`` scores per layer, the tile sized for a 2-core
CPU, every score, exponent and probability written to memory. On a GPU the same attention is one
fused block-sparse kernel: FlexAttention
(``torch.nn.attention.flex_attention``) with a mask that lets query ``i`` see the sink slots that
are filled by then and the ``window`` recent keys ending at itself, skipping every key block
outside that band. It returns the log-sum-exp of each query's scores beside the normalised
output, which is all the mixers' shared normaliser needs:

    the tiled path:  A = sum exp(s_t - m) v_t,  Z = sum exp(s_t - m),  m = max_t s_t
    this path:       A = out = A / Z,           Z = 1,                 m = lse = m + log Z

Every mixer combines the window through ``A / Z`` or, the hybrid, through
``(A + g e^{-m} a) / (Z + g e^{-m} zl)``; both are unchanged by that substitution (divide the
hybrid's numerator and denominator by ``Z``: ``e^{-m} / Z = e^{-lse}``). A hybrid read sharper
than trained (``sharpness`` ``tau != 1``, ``e^{-tau m}``) needs ``m`` itself and keeps the tiles.

Opt-in (``RFKIT_WINDOW_BACKEND=flex``, or ``WindowAttention.window_backend = "flex"``) until the
GPU check (``benchmarks/gpu/``, docs/gpu.md) has shown it correct and faster on a GPU: the default
stays the tiled path, which every device runs. On CUDA the call is compiled
(``torch.compile(flex_attention)``, FlexAttention's only fast form). Elsewhere the tiles keep
running (:func:`serves`): on a CPU FlexAttention has no backward and, uncompiled, holds every
score of the chunk; the CPU tests turn on :data:`CPU_EAGER` to compare its forward with the tiles. The mask's numbers (``seen``, the drawn ``window``) are tensors the mask
closes over, not Python constants, and a drawn window shorter than the ring is a mask over the
same keys, so window dropout neither changes the kernel's shapes nor recompiles it.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import OrderedDict

from rfkit.errors import RFKitError

log = logging.getLogger(__name__)

#: FlexAttention serves CPU forwards too (eagerly, forward only). Off by default: without its
#: compiled kernel FlexAttention materialises every score of a chunk (``L x (sink + window + L)``),
#: which the tiles never do, so on a CPU the tiles run and :func:`serves` says so once. The CPU
#: tests and the GPU check's rehearsal turn it on, to hold this path to the tiles where no GPU is.
CPU_EAGER = False
_told: set = set()
#: FlexAttention calls made in this process: tests and the GPU check read its change to tell
#: which forwards it served
served = 0

#: the backends a window mixer's exact part can run on (``WindowAttention.window_backend``)
BACKENDS = ("torch", "flex")
ENV = "RFKIT_WINDOW_BACKEND"

# block masks by (device, L, S, seen, sink, window): a training run reuses a handful of them
_MASKS: OrderedDict = OrderedDict()
_MAX_MASKS = 32
_compiled = None


class WindowBackendError(RFKitError):
    """An unknown window backend (the environment variable or the class attribute)."""


def resolve(backend: str | None, field: str = ENV) -> str:
    """``backend`` checked, or when None the one ``RFKIT_WINDOW_BACKEND`` names (``torch`` when
    unset); one line naming ``field`` for anything else. The ``rfkit`` console script asks it
    before any command runs, so a misspelt variable stops a run before a model loads."""
    if backend is None:
        backend = os.environ.get(ENV, "").strip() or "torch"
    if backend not in BACKENDS:
        raise WindowBackendError(f"{field}: {backend!r} is not allowed; allowed: {', '.join(BACKENDS)}")
    return backend


def serves(device) -> bool:
    """Whether FlexAttention serves tensors on ``device``: a CUDA device, or the CPU when
    :data:`CPU_EAGER` is on. The first refusal on a device type is one warning line."""
    kind = getattr(device, "type", str(device))
    if kind == "cuda" or (kind == "cpu" and CPU_EAGER):
        return True
    if kind not in _told:
        _told.add(kind)
        log.warning("%s=flex: FlexAttention serves CUDA devices; the window mixers keep their tiles on %s", ENV, kind)
    return False


def _mask(device, L: int, seen: int, sink: int, ring: int, window: int):
    """The block mask of a chunk of ``L`` queries (ranks ``seen ..``) over ``sink + ring + L``
    keys: the sink slots, then the recent keys in rank order from rank ``seen - ring``, of which a
    query sees the last ``window`` up to itself."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    key = (str(device), L, seen, sink, ring, window)
    if key in _MASKS:
        _MASKS.move_to_end(key)
        return _MASKS[key]
    seen_t = torch.tensor(seen, device=device)
    # query i sees recent index j (rank seen - ring + j) for ring - window < j - i <= ring, and
    # j >= ring + sink - seen: ranks below the sink (or none yet) are not recent keys
    near_t = torch.tensor(ring - window, device=device)
    far_t = torch.tensor(ring, device=device)
    first_t = torch.tensor(ring + sink - seen, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        j = kv_idx - sink
        in_sink = kv_idx < sink
        sink_ok = kv_idx <= q_idx + seen_t  # the slot is filled by the query's rank
        recent_ok = (j - q_idx > near_t) & (j - q_idx <= far_t) & (j >= first_t)
        return (in_sink & sink_ok) | (~in_sink & recent_ok)

    block_mask = create_block_mask(mask_mod, None, None, L, sink + ring + L, device=device)
    _MASKS[key] = block_mask
    while len(_MASKS) > _MAX_MASKS:
        _MASKS.popitem(last=False)
    return block_mask


def _flex():
    """FlexAttention, compiled once per process on CUDA (its fast form), eager elsewhere."""
    global _compiled
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled is None:
        _compiled = torch.compile(flex_attention)  # a second length recompiles once, for any length
    return flex_attention, _compiled


def window_attention(q, keys, values, *, seen: int, sink: int, ring: int, window: int, scaling: float, gqa: bool):
    """Sink + window attention of a chunk: ``(out, lse)``, ``out`` ``(B, Hq, L, hd)`` and the
    natural log-sum-exp of each query's scaled scores ``lse`` ``(B, Hq, L)``.

    ``q`` ``(B, Hq, L, hd)`` are the chunk's rotated queries, ranks ``seen .. seen + L - 1``;
    ``keys`` / ``values`` ``(B, Hk, sink + ring + L, hd)`` the ``sink`` sink slots, then the
    recent keys in rank order starting at rank ``seen - ring`` (the ring before the chunk, then
    the chunk). Query of rank ``r`` sees the sink slots of rank ``<= r`` and the recent keys of
    rank ``r - window < j <= r`` that are not sink tokens (``window <= ring``: a training forward's
    drawn window is a mask, not a shorter key tensor, so the compiled kernel sees one shape
    whatever the draw). ``gqa``: ``Hq`` is a multiple of ``Hk``, query head ``h`` reading KV head
    ``h // (Hq / Hk)``; otherwise ``Hk == Hq``."""
    L, S = q.shape[2], keys.shape[2]
    if S != sink + ring + L or not 1 <= window <= ring:
        raise ValueError(f"window_attention: {S} keys for {L} queries, window {window}; expected sink + ring + L = "
                         f"{sink + ring + L} keys and 1 <= window <= ring = {ring}")  # fmt: skip
    global served
    block_mask = _mask(q.device, L, int(seen), int(sink), int(ring), int(window))
    served += 1
    eager, compiled = _flex()
    fn = compiled if q.device.type == "cuda" else eager
    with warnings.catch_warnings():  # eager FlexAttention (the CPU's) warns that it is not compiled
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        if _aux_request() is None:  # torch before 2.9
            return fn(q, keys, values, block_mask=block_mask, scale=scaling, enable_gqa=gqa, return_lse=True)
        out, aux = fn(q, keys, values, block_mask=block_mask, scale=scaling, enable_gqa=gqa, return_aux=_aux_request()(lse=True))
    return out, aux.lse


def _aux_request():
    """FlexAttention's ``AuxRequest`` (torch 2.9 and later, where ``return_lse`` is deprecated), or None."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return None
    return AuxRequest
