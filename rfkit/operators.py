"""Replacement operators, under the import path recipes, plugins and saved models name
(``class_path: rfkit.operators.MambaOperator``; a saved ``config.json`` records its operator so).

The code lives in :mod:`rfkit.conversion.operators`; this module keeps the public path stable.
"""

from rfkit.conversion.operators import (
    HybridOperator,
    MambaOperator,
    OperatorError,
    ReplacementOperator,
    SinkRecentOperator,
    SlidingWindowOperator,
)
from rfkit.models.layout import AttentionLayout

__all__ = [
    "AttentionLayout",
    "HybridOperator",
    "MambaOperator",
    "OperatorError",
    "ReplacementOperator",
    "SinkRecentOperator",
    "SlidingWindowOperator",
]
