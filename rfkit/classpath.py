"""One public path per class: what a recipe writes is what a saved model records.

Recipes name the built-in policies and operators by their public alias modules
(``class_path: rfkit.policies.RecencyRatioPolicy``, ``rfkit.operators.HybridOperator``). A saved
model's ``config.json``, a head map and a model card record the same strings: :func:`class_path`
gives a class's public path, :func:`public_path` turns the implementation spelling that older
files record (``rfkit.conversion.policies.X``, ``rfkit.models.operators.X``) into it. Those old
spellings still import (the implementation modules stay where they are). A plugin's class, defined
outside these modules, keeps its own module path.

Strings only: this module imports nothing, so the layers below the aliases can use it.
"""

from __future__ import annotations

#: implementation module -> the public alias module that re-exports its classes
PUBLIC_MODULES = {
    "rfkit.conversion.policies": "rfkit.policies",
    "rfkit.conversion.streamed_loss": "rfkit.policies",
    "rfkit.models.operators": "rfkit.operators",
}


def public_path(path: str) -> str:
    """``path`` (``module.Class``) with an implementation module replaced by its public alias."""
    module, _, name = str(path).rpartition(".")
    public = PUBLIC_MODULES.get(module)
    return f"{public}.{name}" if public else path


def class_path(cls: type) -> str:
    """The dotted path that names ``cls`` in recipes and saved files."""
    return public_path(f"{cls.__module__}.{cls.__qualname__}")
