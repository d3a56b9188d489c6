"""Which parameters of a converted model train: the ``model.freeze`` presets and name patterns,
freeze schedules (stages that change the setting step by step), and the ``init: from_attention``
start of the new blocks. Used by :class:`rfkit.training.module.RecurFormerModule`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rfkit.conversion.policies import PolicyError
from rfkit.models.precision import is_lora_weight, is_mixer_weight

if TYPE_CHECKING:
    from rfkit.models.operators import ReplacementOperator

FREEZE_PRESETS = ("pretrained", "mixers", "lora", "none", "all")


@dataclass
class FreezeStage:
    """One stage of a freeze schedule: ``freeze`` (as ``model.freeze``) for ``steps`` optimiser
    steps; ``steps: null`` (only on the last stage) lasts to the end of training."""

    freeze: str | list[str] = "pretrained"
    steps: int | None = None


def no_weights_message(operator, freeze) -> str:
    return (
        f"model.freeze: {type(operator).__name__} has no weights to train, so freeze {freeze!r} leaves nothing; "
        "use rfkit convert (training-free), or freeze: none (or lora with a lora section) to fine-tune"
    )


_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def trains(name: str, freeze: str | list[str]) -> bool:
    """Whether parameter ``name`` trains under the ``freeze`` setting (see :class:`RecurFormerModule`).
    FSDP and activation-checkpointing wrapper names are ignored, so patterns match either way."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    if freeze == "none":
        return True
    if freeze == "all":
        return False
    if freeze == "pretrained":
        return is_mixer_weight(name) or is_lora_weight(name)
    if freeze == "mixers":
        return is_mixer_weight(name)
    if freeze == "lora":
        return is_lora_weight(name)
    return not any(fnmatch.fnmatch(name, pattern) for pattern in freeze)


def trainable_names(model, freeze: str | list[str]) -> set[str]:
    return {name for name, _ in model.named_parameters() if trains(name, freeze)}


def trains_shared(model, freeze: str | list[str]) -> bool:
    """Whether ``freeze`` trains a pretrained weight that the shared teacher also uses."""
    return any(not (is_mixer_weight(n) or is_lora_weight(n)) for n in trainable_names(model, freeze))


def apply_freeze(model, freeze: str | list[str]) -> None:
    """Set ``requires_grad`` per the ``freeze`` setting (see :class:`RecurFormerModule`)."""
    for name, param in model.named_parameters():
        param.requires_grad_(trains(name, freeze))


def check_schedule(schedule: list[FreezeStage] | None) -> list[FreezeStage] | None:
    """Validate a freeze schedule: presets or pattern lists, positive steps, open end last only."""
    if not schedule:
        return None
    for i, stage in enumerate(schedule):
        if isinstance(stage, dict):
            stage = schedule[i] = FreezeStage(**stage)
        if isinstance(stage.freeze, str) and stage.freeze not in FREEZE_PRESETS:
            raise PolicyError(
                f"model.freeze_schedule[{i}].freeze: {stage.freeze!r} is not allowed; "
                f"allowed: {', '.join(FREEZE_PRESETS)} or a list of name patterns"
            )
        last = i == len(schedule) - 1
        if stage.steps is None and not last:
            raise PolicyError(f"model.freeze_schedule[{i}].steps: only the last stage may leave steps empty")
        if stage.steps is not None and (isinstance(stage.steps, bool) or not isinstance(stage.steps, int) or stage.steps < 1):
            raise PolicyError(f"model.freeze_schedule[{i}].steps: {stage.steps!r} is not allowed; must be an integer >= 1")
    return list(schedule)


def stage_at(schedule: list[FreezeStage], step: int) -> int:
    """Index of the stage that covers optimiser step ``step`` (the last stage past the end)."""
    end = 0
    for i, stage in enumerate(schedule):
        if stage.steps is None:
            return i
        end += stage.steps
        if step < end:
            return i
    return len(schedule) - 1


def init_from_attention(model, operator: ReplacementOperator) -> None:
    """``init: from_attention``: every new block starts from the attention module it replaced."""
    layers = model.get_decoder().layers
    for i, original in model.rf_originals.items():
        layer = layers[i].self_attn
        operator.init_from_attention(layer.mixer, original, layer)
