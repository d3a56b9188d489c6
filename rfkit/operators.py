"""Replacement operators, under the import path recipes, plugins and saved models name
(``class_path: rfkit.operators.MambaOperator``; a saved ``config.json`` records its operator so).

The code lives in :mod:`rfkit.models.operators` (and the mixers' optional hooks,
:class:`ReplacementMixer`, in :mod:`rfkit.models.mixer`); this module keeps the public path stable.
"""

from rfkit.models.layout import AttentionLayout
from rfkit.models.mixer import ReplacementMixer
from rfkit.models.operators import (
    HybridMambaOperator,
    HybridOperator,
    MambaOperator,
    OperatorError,
    ReplacementOperator,
    SinkRecentOperator,
    SlidingWindowOperator,
)

__all__ = [
    "AttentionLayout",
    "HybridMambaOperator",
    "HybridOperator",
    "MambaOperator",
    "OperatorError",
    "ReplacementMixer",
    "ReplacementOperator",
    "SinkRecentOperator",
    "SlidingWindowOperator",
]
