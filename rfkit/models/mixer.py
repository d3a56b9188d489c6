"""What the pipeline may ask of a mixer beyond running it: the optional hooks of :class:`ReplacementMixer`.

A mixer is the module an operator's ``build`` returns (the call contract is in
:mod:`rfkit.models.operators`). Two steps of the pipeline ask every mixer something that only
some operators have an answer to, and they ask through this interface, never by testing types:

* **calibration** (attention transfer, :func:`rfkit.training.transfer.transfer`): before the
  gradient steps, every converted layer's mixer gets ``mixer.calibrate(x)`` with a batch of its
  own inputs from the original model ``(B, L, d_in)``, without padding. A mixer that sets
  weights from it returns a dict (recorded in the transfer report under ``calibration``, and
  the block then skips the least-squares read-out); the default does nothing and returns None.
* **state ablation** (``rfkit eval context``'s ``converted, state off`` row, ``rfkit sweep
  --trained``'s ``..., state off`` rows): a mixer whose output mixes a window with a state it
  can switch off sets ``has_state_ablation = True`` and implements ``state_ablation()``, a
  context manager within which it runs without that state (same cache) and after which it is
  exactly as before. The default has none.

* **training draws** (:meth:`ReplacementMixer.draw_for_batch`): before every training batch
  ``rfkit fit`` asks each mixer to draw what its training forwards randomise (the hybrids' shortened
  window) and to use that draw until the next one. A forward that activation checkpointing runs
  again in backward then sees the window the first run saw (a private random stream is not
  restored by the recompute). The default draws nothing.
* **dtypes** (:attr:`ReplacementMixer.handles_dtype`): the converted layer hands a mixer the
  model's activations (bf16 in the GPU recipes) while the mixer's weights are float32
  (:mod:`rfkit.models.precision`). A mixer that sets ``handles_dtype = True`` takes them as they
  are and returns its output in their dtype (the built-in mixers: they compute in float32 and keep
  their window's K/V in the activations' dtype); otherwise the layer casts the input to the mixer's
  weights' dtype and the output back.

Subclass :class:`ReplacementMixer` to get the defaults. A plain ``nn.Module`` mixer (a plugin
written before this interface) is treated as having the defaults: :func:`calibrate_mixer`,
:func:`ablatable_mixers`, :func:`ablate_states` and :func:`draw_for_batch` are how the pipeline asks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class ReplacementMixer(nn.Module):
    """Base of the mixers that operators build: the optional hooks, with their defaults."""

    #: whether :meth:`state_ablation` switches a state off (evaluations add a "state off" row)
    has_state_ablation: bool = False
    #: whether the mixer takes activations in the model's dtype itself (module docstring)
    handles_dtype: bool = False

    def cache_dtype(self, kv_dtype: torch.dtype) -> torch.dtype:
        """The dtype to pass :meth:`state_bytes` for the state a model's forward leaves in its cache
        when the model's K/V are ``kv_dtype``. The default: ``kv_dtype`` (a window of K/V)."""
        return kv_dtype

    def draw_for_batch(self, active: bool = True) -> None:
        """Draw the randomness of this mixer's training forwards for the coming training batch and
        use it in every forward until the next call (``active=False``: stop, each training
        forward draws its own again). The default draws nothing."""

    def calibrate(self, x: torch.Tensor) -> dict | None:
        """Set weights in closed form from ``x``, a batch of this mixer's inputs from the original
        model ``(B, L, d_in)``, before attention transfer trains it. Return what was set (a dict,
        kept in the transfer report), or None for "nothing calibrated" (the default)."""
        return None

    @contextlib.contextmanager
    def state_ablation(self) -> Iterator[None]:
        """Within the block, run without the state (only where :attr:`has_state_ablation`);
        restore it exactly on exit. The default changes nothing."""
        yield


def calibrate_mixer(mixer: nn.Module, x: torch.Tensor) -> dict | None:
    """``mixer.calibrate(x)``; None for a mixer without the hook."""
    hook = getattr(mixer, "calibrate", None)
    return hook(x) if callable(hook) else None


def ablatable_mixers(model: nn.Module) -> list[nn.Module]:
    """The mixers of ``model`` that can switch their state off, in module order."""
    return [m for m in model.modules() if getattr(m, "has_state_ablation", False) is True]


@contextlib.contextmanager
def ablate_states(model: nn.Module) -> Iterator[int]:
    """Within the block, every mixer of ``model`` that has a state ablation runs without its state
    (its window alone: the ablation that shows what the state adds; the cache is unchanged).
    Yields how many mixers that is (0: nothing to ablate, the model runs as it is)."""
    mixers = ablatable_mixers(model)
    with contextlib.ExitStack() as stack:
        for mixer in mixers:
            stack.enter_context(mixer.state_ablation())
        yield len(mixers)


def draw_for_batch(model: nn.Module, active: bool = True) -> int:
    """``draw_for_batch(active)`` on every mixer of ``model`` that has the hook (see the module
    docstring); returns how many mixers were asked."""
    hooks = [m.draw_for_batch for m in model.modules() if callable(getattr(m, "draw_for_batch", None))]
    for hook in hooks:
        hook(active)
    return len(hooks)
