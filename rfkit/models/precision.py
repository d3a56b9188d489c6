"""The precision policy of converted models: what may be half precision and what stays float32.

A converted model holds two kinds of weights. The **pretrained base** keeps the dtype it was loaded
in (``model.dtype``: bf16 in the GPU recipes). The **new weights** rfkit adds, the mixers that stand
in for replaced heads (parameter names with ``.mixer.``) and LoRA adapters (``.lora_``), are float32
whenever the base is half precision (bf16 or fp16):

- they train, and a bf16 weight cannot take a small update: bf16 keeps 8 significant bits, so an
  optimizer step below about 1/256 of the weight rounds away (the hybrid's decay horizon,
  ``log 128 = 4.85``, never moved under bf16 weights);
- they are few (a few thousand to a few hundred million numbers), so float32 costs little memory.

Mixers take activations in the model's dtype and return their output in it. Inside, they compute
in float32 (float64 for a float64 model, as the tests run) and keep their recurrent states and
running sums in float32 (the hybrid's ``S`` and ``z``, the Mamba block's SSM state, the hybrid
Mamba's ``h``): a bf16 sum of entries near 0.1 stops growing at about 64. The window mixers' K/V
(sink and recent tokens) stay in the activation dtype, as the kept heads' K/V cache does.

:func:`keep_new_weights_float32` restores the policy after anything casts a whole model (Lightning's
``bf16-true`` casts the LightningModule with ``.to(torch.bfloat16)``;
:class:`rfkit.training.module.RecurFormerModule` calls it after every such cast).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

# the dtype mixers compute in and keep their recurrent sums in, for activations of a dtype:
# float64 for float64, float32 for everything else (the scans' rule)
from rfkit.ops.scan import compute_dtype  # noqa: F401  (re-exported)

#: dtypes a new weight is never held in
HALF_DTYPES = (torch.bfloat16, torch.float16)
MIXER_MARK = ".mixer."
LORA_MARK = ".lora_"


def is_mixer_weight(name: str) -> bool:
    """Whether parameter ``name`` belongs to a mixer (a replaced heads' new block)."""
    return MIXER_MARK in name


def is_lora_weight(name: str) -> bool:
    """Whether parameter ``name`` belongs to a LoRA adapter."""
    return LORA_MARK in name


def is_new_weight(name: str) -> bool:
    """Whether parameter ``name`` is one rfkit added (a mixer's or a LoRA adapter's)."""
    return is_mixer_weight(name) or is_lora_weight(name)


def new_weight_dtype(base: torch.dtype) -> torch.dtype:
    """The dtype new weights take beside a base of dtype ``base``: float32 for a half-precision
    base, the base's own otherwise (float32, or float64 in the numerical tests)."""
    return torch.float32 if base in HALF_DTYPES else base


def float32_if_half(module: nn.Module) -> int:
    """Cast every half-precision floating parameter and buffer of ``module`` to float32, in place
    (the same ``Parameter`` objects: hooks and optimizers that hold them keep working). Returns how
    many tensors were cast."""
    cast = 0
    for param in module.parameters():
        if param.dtype in HALF_DTYPES:
            param.data = param.data.float()
            if param.grad is not None:
                param.grad = param.grad.float()
            cast += 1
    for sub in module.modules():
        for key, buf in sub._buffers.items():
            if buf is not None and buf.dtype in HALF_DTYPES:
                sub._buffers[key] = buf.float()
                cast += 1
    return cast


def keep_new_weights_float32(model: nn.Module) -> int:
    """Put the new weights of ``model`` (mixers, LoRA adapters) back to float32 where a cast made them
    half precision; the pretrained weights are left as they are. Returns how many were cast."""
    cast = 0
    for name, param in model.named_parameters():
        if param.dtype in HALF_DTYPES and is_new_weight(f".{name}"):
            param.data = param.data.float()
            if param.grad is not None:
                param.grad = param.grad.float()
            cast += 1
    return cast


def new_weight_modules(model: nn.Module) -> list[nn.Module]:
    """The smallest modules that together hold every new weight and nothing else, in module order:
    each mixer and each LoRA adapter's own layers (``lora_A``/``lora_B`` entries). Under FSDP each
    becomes its own unit, so every unit holds weights of one dtype."""
    found, inside = [], []
    for name, module in model.named_modules():
        full = f".{name}."
        if any(full.startswith(f".{p}.") for p in inside):
            continue
        own = list(module.parameters(recurse=False))
        if full.endswith(MIXER_MARK) or (LORA_MARK in full and own):
            found.append(module)
            inside.append(name)
    return found


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, factory functions without a dtype make ``dtype`` tensors (so new weights
    are initialised in float32 even where a caller set bf16 as the default, as Lightning's
    ``bf16-true`` does around ``configure_model``)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
