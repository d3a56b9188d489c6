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

Subclass :class:`ReplacementMixer` to get the defaults. A plain ``nn.Module`` mixer (a plugin
written before this interface) is treated as having the defaults: :func:`calibrate_mixer`,
:func:`ablatable_mixers` and :func:`ablate_states` are how the pipeline asks.
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
