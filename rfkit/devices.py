"""Where models run: the ``--device`` value of the commands that load a model (``rfkit profile``,
``convert``, ``eval``, ``bench``, ``sweep``). ``rfkit fit`` runs where its trainer does
(``trainer.accelerator``)."""

from __future__ import annotations

import torch

from rfkit.errors import RFKitError


class DeviceError(RFKitError):
    """A ``--device`` that is not allowed here; one line for the user."""


def torch_device(name: str | None, flag: str = "--device") -> torch.device:
    """The device ``name`` names: ``cpu``, ``cuda`` or ``cuda:N``; ``None`` is CUDA when a CUDA
    device is available, else the CPU. CUDA asked for where there is none is a :class:`DeviceError`."""
    if name not in (None, "cpu", "cuda") and not str(name).startswith("cuda:"):
        raise DeviceError(f"{flag}: '{name}' is not allowed; allowed: cpu, cuda, cuda:N")
    if name and name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"{flag}: cuda was asked for but no CUDA device is available")
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
