"""rfkit: convert pretrained transformers into RecurFormer hybrids.

Importing rfkit registers the converted model types (``rf_llama``, ``rf_mistral``,
``rf_qwen2``) with transformers' Auto classes, so that
``AutoModelForCausalLM.from_pretrained(dir)`` restores a converted model. It never imports
CUDA-only packages.
"""

from rfkit.conversion.policies import (  # noqa: E402
    ExplicitHeads,
    FromHeadMap,
    HeadSelectionPolicy,
    LayerwisePolicy,
    RandomHeads,
    RecencyRatioPolicy,
)
from rfkit.errors import RFKitError  # noqa: E402
from rfkit.models import modeling as _modeling  # noqa: E402,F401  (registers the Auto classes)
from rfkit.models.operators import (  # noqa: E402
    HybridMambaOperator,
    HybridOperator,
    MambaOperator,
    ReplacementOperator,
    SinkRecentOperator,
    SlidingWindowOperator,
)
from rfkit.version import __version__  # noqa: E402,F401

__all__ = [
    "ExplicitHeads",
    "FromHeadMap",
    "HeadSelectionPolicy",
    "HybridMambaOperator",
    "HybridOperator",
    "LayerwisePolicy",
    "MambaOperator",
    "RFKitError",
    "RandomHeads",
    "RecencyRatioPolicy",
    "ReplacementOperator",
    "SinkRecentOperator",
    "SlidingWindowOperator",
    "__version__",
]
