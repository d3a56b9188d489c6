"""Cache accounting for converted models: K/V of kept heads plus the mixers' constant state.

Kept heads use the ordinary transformers cache (any ``Cache``: the ``DynamicCache`` that
``generate`` creates, or one the user passes in); each converted layer stores only its kept
KV heads there. The mixers' states (Mamba conv and SSM state, the window's sink + recent K/V,
the hybrids' sums) sit in a dict on the same cache object, keyed by ``layer_idx``, so they travel
with it, and the cache's batch operations move them row for row (:class:`MixerStatesCache`:
beam search reorders them with the K/V).
"""

from __future__ import annotations

import inspect

import torch
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from rfkit.errors import RFKitError

_STATE_ATTR = "rfkit_mixer_states"
_COUNT_ATTR = "rfkit_mixer_counts"
#: the name under which the installed transformers passes the KV cache: ``cache`` from 5.24,
#: ``past_key_values`` before
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def output_cache(out):
    """The cache a model call returned, read under the installed name (:data:`CACHE_ARG`): from
    transformers 5.24 reading ``past_key_values`` logs a deprecation warning."""
    return out.get(CACHE_ARG)


def cache_kwargs(cache) -> dict:
    """``{name: cache}`` for a model call that continues from ``cache``, under the name the
    installed transformers takes (:data:`CACHE_ARG`)."""
    return {CACHE_ARG: cache}


def mixer_state_store(cache) -> dict:
    """The per-layer mixer states held by ``cache`` (created on first use, when the cache also
    learns to move them: :class:`MixerStatesCache`)."""
    store = getattr(cache, _STATE_ATTR, None)
    if store is None:
        store = {}
        setattr(cache, _STATE_ATTR, store)
        cache.__class__ = _tracking_class(type(cache))
    return store


def mixer_counts(cache) -> dict:
    """Per layer, the tokens every row of the cache's mixer states has seen, counted on the host
    by the converted layers (None once rows differ: a padded chunk). A decode step reads its
    ring slot from it instead of from the device (``WindowAttention.step_qkv``'s ``seen``)."""
    counts = getattr(cache, _COUNT_ATTR, None)
    if counts is None:
        counts = {}
        setattr(cache, _COUNT_ATTR, counts)
    return counts


class CacheCropError(RFKitError):
    """A converted model's cache was asked to give tokens back; one line for the user."""


CROP_MESSAGE = (
    "the cache of an rfkit-converted model cannot be cropped: its replaced heads hold a recurrent or "
    "sink + window state that cannot give tokens back. Assisted, speculative and prompt-lookup decoding "
    "need that; greedy, sampling and beam search do not"
)


class MixerStatesCache:
    """What a cache that holds mixer states adds to its own class (``DynamicCache``, ``StaticCache``,
    a cache the user passed in): the batch operations of transformers' Cache API move the states
    with the K/V, row for row, so beam search continues every beam from its own state.

    - ``reorder_cache(beam_idx)`` (beam search), ``batch_select_indices(indices)`` and
      ``batch_repeat_interleave(repeats)`` apply the same row operation to every state tensor;
    - ``crop`` of any token raises :class:`CacheCropError` (a recurrent state cannot give tokens
      back), and ``is_croppable`` is False once a state exists, so ``generate`` refuses assisted
      decoding with its own message before it would crop;
    - ``reset()`` drops the states with the K/V.

    :func:`mixer_state_store` mixes it into the cache's class when the first state is stored.
    """

    def _rows(self, op) -> None:
        store = getattr(self, _STATE_ATTR, None) or {}
        for layer, states in store.items():
            store[layer] = tuple(op(t) for t in states)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0 and getattr(self, _STATE_ATTR, None):
            raise CacheCropError(CROP_MESSAGE)
        super().crop(tokens_to_remove)

    def reset(self):
        super().reset()
        getattr(self, _STATE_ATTR, {}).clear()
        getattr(self, _COUNT_ATTR, {}).clear()

    @property
    def is_croppable(self) -> bool:
        return not getattr(self, _STATE_ATTR, None) and super().is_croppable


_TRACKING: dict[type, type] = {}


def _tracking_class(cls: type) -> type:
    """``cls`` with :class:`MixerStatesCache` mixed in (made once per cache class)."""
    if issubclass(cls, MixerStatesCache):
        return cls
    if cls not in _TRACKING:
        _TRACKING[cls] = type(cls.__name__, (MixerStatesCache, cls), {"__module__": __name__, "__qualname__": cls.__qualname__})
    return _TRACKING[cls]


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def cache_bytes(cache) -> dict:
    """Bytes actually held by a cache: ``{"kv": ..., "state": ..., "total": ...}``."""
    kv = 0
    for layer in getattr(cache, "layers", []):
        kv += _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(getattr(layer, "values", None))
    state = sum(_tensor_bytes(t) for states in mixer_state_store(cache).values() for t in states)
    return {"kv": kv, "state": state, "total": kv + state}


@torch.no_grad()
def measure_cache(model, input_ids: torch.Tensor) -> dict:
    """Prefill ``input_ids`` (B, L) with ``use_cache=True`` and measure what the cache holds.

    Returns bytes of K/V, of mixer state, their total, and K/V bytes per token (the part that
    grows with the sequence).
    """
    was_training = model.training
    model.eval()
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)  # the cache, not the logits
    model.train(was_training)
    measured = cache_bytes(output_cache(out))
    tokens = input_ids.numel()
    measured["tokens"] = tokens
    measured["kv_bytes_per_token"] = measured["kv"] / tokens
    return measured


class _HeadlessDynamicLayer(DynamicLayer):
    """The ``DynamicLayer`` of a layer with no kept heads: its K/V have zero heads.

    ``DynamicLayer.get_seq_length`` answers 0 for empty (``numel() == 0``) tensors, so a
    zero-head layer would report an empty cache. When that layer is layer 0, which is the one the
    model asks for the past length, positions of later chunks restart at 0 (when ``position_ids``
    are not given) and the 4-D mask built for decode steps covers 1 key instead of all of them
    (left-padded ``generate`` then attends to pad tokens). This layer reports the number of tokens
    recorded instead; everything else (crop, reorder, reset) is ``DynamicLayer``'s.
    """

    #: decode tokens counted on the host (:func:`advance_headless`), beside the zero-head K/V's length
    decoded = 0

    def get_seq_length(self) -> int:
        keys = self.keys if self.is_initialized else None
        return (keys.shape[-2] if keys is not None and keys.dim() == 4 else 0) + self.decoded

    def reset(self) -> None:
        self.decoded = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.decoded:  # the host-counted tokens go first
            taken = min(self.decoded, -tokens_to_remove)
            self.decoded -= taken
            tokens_to_remove += taken
        super().crop(tokens_to_remove)


def advance_headless(cache, layer_idx: int) -> bool:
    """Count one decode token for a no-kept-heads layer without a tensor call: True when the
    cache layer is a :class:`_HeadlessDynamicLayer` already holding the prompt (the converted
    layer's decode step), False when the caller must record the token through ``cache.update``."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return False
    layer = layers[layer_idx]
    if type(layer) is not _HeadlessDynamicLayer or not layer.is_initialized:
        return False
    layer.decoded += 1
    return True


def count_headless_tokens(cache, layer_idx: int) -> None:
    """Make the cache layer of a no-kept-heads layer count its tokens (see _HeadlessDynamicLayer).

    Only plain ``DynamicLayer`` needs it: static and sliding layers count with
    ``cumulative_length`` already.
    """
    layers = getattr(cache, "layers", None)
    if layers is not None and layer_idx < len(layers) and type(layers[layer_idx]) is DynamicLayer:
        layers[layer_idx].__class__ = _HeadlessDynamicLayer
