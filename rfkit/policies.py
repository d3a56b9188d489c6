"""Head-selection policies, under the import path recipes and plugins name
(``class_path: rfkit.policies.RecencyRatioPolicy``, ``from rfkit.policies import HeadSelectionPolicy``).

The code lives in :mod:`rfkit.conversion.policies` (:class:`StreamedLossPolicy` in
:mod:`rfkit.conversion.streamed_loss`); this module keeps the public path stable.
"""

from rfkit.conversion.policies import (
    ExplicitHeads,
    FromHeadMap,
    HeadSelectionPolicy,
    LayerwisePolicy,
    PolicyError,
    RandomHeads,
    RecencyRatioPolicy,
    units_to_heads,
)
from rfkit.conversion.profile import HeadProfile
from rfkit.conversion.streamed_loss import StreamedLossPolicy
from rfkit.models.layout import AttentionLayout

__all__ = [
    "AttentionLayout",
    "ExplicitHeads",
    "FromHeadMap",
    "HeadProfile",
    "HeadSelectionPolicy",
    "LayerwisePolicy",
    "PolicyError",
    "RandomHeads",
    "RecencyRatioPolicy",
    "StreamedLossPolicy",
    "units_to_heads",
]
