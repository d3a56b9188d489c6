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


# -- which precision a device computes natively -----------------------------------------------
#: CPU feature flags (Linux /proc/cpuinfo) that mean bf16 arithmetic in hardware: Intel AMX
#: (Sapphire Rapids and later), AVX512-BF16 (Cooper Lake, AMD Zen 4 and later), Arm's BF16
#: extension (``bf16`` in the ``Features`` line)
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def _cpuinfo(keys: tuple[str, ...]) -> str:
    """The value of the first line of Linux's /proc/cpuinfo whose key is one of ``keys``; empty
    where there is none or the file is not there (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (``flags`` on x86, ``Features`` on Arm); an empty
    set where /proc/cpuinfo is not there (macOS, Windows)."""
    return set(_cpuinfo(("flags", "Features")).split())


def cpu_model() -> str:
    """The CPU's model name as Linux gives it (``model name``); empty where it does not."""
    return _cpuinfo(("model name",))


def native_bf16(device_type: str) -> tuple[bool, str]:
    """Whether a ``cpu`` or ``cuda`` device computes bf16 natively, and why, as a phrase for the
    user: the CPU flags that say so, or the GPU's name."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device is available"
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} computes bf16 natively"
        return False, f"{name} has no native bf16"
    found = [flag for flag in BF16_CPU_FLAGS if flag in cpu_flags()]
    if found:
        return True, f"this CPU computes bf16 natively ({', '.join(found)})"
    return False, f"this CPU has no native bf16 (none of the flags {', '.join(BF16_CPU_FLAGS[:2])})"


def accelerator_device_type(accelerator) -> str:
    """The device type a Lightning ``trainer.accelerator`` runs on: ``cuda`` for gpu / cuda, and for
    auto (or none given) where CUDA is available; ``cpu`` for cpu and auto elsewhere; any other name
    (mps, tpu) as it is; an accelerator object by its class name."""
    name = accelerator if isinstance(accelerator, str) or accelerator is None else type(accelerator).__name__
    name = str(name or "auto").lower()
    if name in ("gpu", "cuda") or name.startswith("cuda"):
        return "cuda"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if name.startswith("cpu") else name
