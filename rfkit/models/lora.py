"""LoRA adapters on the kept projections, through peft, merged back before saving.

Adapters are injected in place (``peft.inject_adapter_in_model``), so the converted model keeps
its class and parameter names; :func:`merge_lora` folds them into the base weights and removes
the peft layers, so a saved model needs no peft to load. The new blocks (``.mixer.``) never get
adapters: they are trained directly.

A converted layer holds its query, key and value rows in one packed ``qkv_proj``
(:mod:`rfkit.models.modeling`): naming any of ``q_proj`` / ``k_proj`` / ``v_proj`` puts one
adapter on it, so the recipes' target lists mean the same layers on converted and kept layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from rfkit.errors import RFKitError
from rfkit.validate import INTEGER_NOT_ALLOWED, fraction, in_range, positive_int

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraError(RFKitError):
    """A bad LoRA setting; one line for the user."""


@dataclass
class LoraSettings:
    """The ``lora:`` section of a recipe.

    Args:
        r: Adapter rank.
        alpha: Scaling numerator (the update is ``alpha / r * B A``).
        dropout: Dropout on the adapter input.
        target_modules: Names of the linear layers that get adapters (suffix match, as in peft).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self):
        positive_int("model.lora.r", self.r, error=LoraError, message=INTEGER_NOT_ALLOWED)
        in_range("model.lora.alpha", self.alpha, 0, low_open=True, finite=True, error=LoraError)
        fraction("model.lora.dropout", self.dropout, high_open=True, error=LoraError, message="{field}: {value!r} is not allowed; must be {bounds}")
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise LoraError(f"model.lora.target_modules: {self.target_modules!r} is not allowed; a non-empty list of module names")


PACKED = {"q_proj", "k_proj", "v_proj"}  # the projections a converted layer packs into qkv_proj


def _targets(model: nn.Module, names: list[str]) -> list[str]:
    """Full names of the linear layers matching ``names`` outside the new blocks (a converted
    layer's ``qkv_proj`` when any of the projections it packs is named)."""
    names = list(names) + (["qkv_proj"] if PACKED & set(names) else [])
    found = []
    for full, module in model.named_modules():
        if ".mixer." in f"{full}." or not isinstance(module, nn.Linear):
            continue
        if any(full == n or full.endswith(f".{n}") for n in names):
            found.append(full)
    return found


def apply_lora(model: nn.Module, settings: LoraSettings) -> int:
    """Inject LoRA adapters into ``model`` in place; returns the number of adapted layers."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = _targets(model, settings.target_modules)
    if not targets:
        raise LoraError(f"model.lora.target_modules: no linear layer of the model matches {settings.target_modules}")
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=targets)
    inject_adapter_in_model(config, model)
    return len(targets)


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA adapter into its base layer and put the plain layer back; returns how many."""
    merged = 0
    for name, module in lora_layers(model):
        module.merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module.get_base_layer())
        merged += 1
    return merged
