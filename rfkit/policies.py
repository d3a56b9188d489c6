"""Head-selection policies: which query heads of which layers a conversion replaces.

A policy is any subclass of :class:`HeadSelectionPolicy`. Recipes name it by ``class_path``
(``rfkit.policies.RecencyRatioPolicy`` or ``my_policies.EvenLayers``); jsonargparse checks
its ``init_args`` against ``__init__``. That is the whole plugin mechanism.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Literal

from rfkit.errors import RFKitError
from rfkit.layout import AttentionLayout
from rfkit.profile import HeadProfile


class PolicyError(RFKitError):
    """A bad policy setting. One line for the user, naming the field."""


Selection = list[list[int]]  # per layer, sorted replaced query-head indices


class HeadSelectionPolicy(ABC):
    """Base class. Subclasses implement :meth:`select`.

    Args:
        beta: Fraction of heads to replace, in [0, 1] (the paper's ratio beta).
    """

    #: whether :meth:`select` needs a calibration profile (RR / RA-I statistics)
    needs_profile: bool = False

    def __init__(self, beta: float = 0.5):
        if not isinstance(beta, (int, float)) or not 0.0 <= float(beta) <= 1.0:
            raise PolicyError(f"model.policy.beta: {beta!r} is not allowed; beta must lie in [0, 1]")
        self.beta = float(beta)

    def profile_settings(self) -> dict | None:
        """Settings for profiling, or None when no profile is needed."""
        return None

    @abstractmethod
    def select(self, layout: AttentionLayout, profile: HeadProfile | None) -> Selection:
        """Implemented by every subclass."""

    def describe(self) -> dict:
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "beta": self.beta}


def _count(beta: float, units: int) -> int:
    """How many of ``units`` a ratio ``beta`` replaces (round half up, so beta 0.5 of 3 is 2)."""
    return min(units, int(math.floor(beta * units + 0.5)))


def _top(scores: dict, n: int) -> list:
    """The ``n`` keys with the highest scores; ties go to the earlier key (deterministic)."""
    order = sorted(scores, key=lambda key: (-scores[key][0], -scores[key][1], key))
    return order[:n]


class RecencyRatioPolicy(HeadSelectionPolicy):
    """Replace the most recency-aware heads (RecurFormer section 3.1).

    Heads are ranked by RA-I (the number of calibration samples whose recency ratio exceeds
    ``alpha``), ties broken by the mean recency ratio.

    Args:
        window: Local window k: attention to tokens at distance <= k counts as recent.
            The paper uses about L / 10 (102 tokens for 1024-token samples).
        alpha: RR threshold in [0, 1] for counting a sample towards a head's RA-I. The paper
            gives no usable value (its "alpha = 102" is the window); rfkit defaults to 0.5:
            a sample counts when most of the head's non-sink attention stays in the window.
        beta: Fraction of units (KV groups or query heads) to replace, in [0, 1].
        exclude_first_token: Leave token 0 (the attention sink) out of the RR sums.
        granularity: ``kv_group`` replaces whole KV groups, scored by the sum of their query
            heads' RA-I; only this frees KV cache in GQA models. ``query_head`` replaces
            single query heads.
        scope: ``global`` ranks units across all layers; ``per_layer`` replaces the same
            fraction in every layer.
    """

    needs_profile = True

    def __init__(
        self,
        window: int = 51,
        alpha: float = 0.5,
        beta: float = 0.5,
        exclude_first_token: bool = True,
        granularity: Literal["kv_group", "query_head"] = "kv_group",
        scope: Literal["global", "per_layer"] = "global",
    ):
        super().__init__(beta)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise PolicyError(f"model.policy.window: {window!r} is not allowed; window must be an integer >= 1")
        if not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
            raise PolicyError(f"model.policy.alpha: {alpha!r} is not allowed; alpha must lie in [0, 1]")
        if granularity not in ("kv_group", "query_head"):
            raise PolicyError(f"model.policy.granularity: {granularity!r} is not allowed; allowed: kv_group, query_head")
        if scope not in ("global", "per_layer"):
            raise PolicyError(f"model.policy.scope: {scope!r} is not allowed; allowed: global, per_layer")
        self.window, self.alpha = window, float(alpha)
        self.exclude_first_token = bool(exclude_first_token)
        self.granularity, self.scope = granularity, scope

    def profile_settings(self) -> dict:
        return {"window": self.window, "alpha": self.alpha, "exclude_first_token": self.exclude_first_token}

    def describe(self) -> dict:
        return {**super().describe(), **self.profile_settings(), "granularity": self.granularity, "scope": self.scope}

    def unit_scores(self, layout: AttentionLayout, profile: HeadProfile) -> dict[tuple[int, int], tuple[float, float]]:
        """(layer, unit) -> (RA-I, mean RR) where a unit is a KV group or a query head."""
        scores = {}
        for layer in range(layout.num_layers):
            if self.granularity == "kv_group":
                for g in range(layout.num_kv_heads):
                    heads = layout.query_heads_of(g)
                    scores[(layer, g)] = (
                        float(sum(profile.rai[layer][h] for h in heads)),
                        sum(profile.rr_mean[layer][h] for h in heads) / len(heads),
                    )
            else:
                for h in range(layout.num_heads):
                    scores[(layer, h)] = (float(profile.rai[layer][h]), profile.rr_mean[layer][h])
        return scores

    def select(self, layout: AttentionLayout, profile: HeadProfile | None) -> Selection:
        if profile is None:
            raise PolicyError("RecencyRatioPolicy needs a calibration profile")
        scores = self.unit_scores(layout, profile)
        if self.scope == "global":
            chosen = _top(scores, _count(self.beta, len(scores)))
        else:
            chosen = []
            for layer in range(layout.num_layers):
                in_layer = {key: s for key, s in scores.items() if key[0] == layer}
                chosen += _top(in_layer, _count(self.beta, len(in_layer)))
        return units_to_heads(layout, chosen, self.granularity)


def units_to_heads(layout: AttentionLayout, units, granularity: str) -> Selection:
    """Expand (layer, unit) pairs into per-layer sorted query-head lists."""
    selected: Selection = [[] for _ in range(layout.num_layers)]
    for layer, unit in units:
        heads = layout.query_heads_of(unit) if granularity == "kv_group" else [unit]
        selected[layer].extend(heads)
    return [sorted(set(s)) for s in selected]


class ExplicitHeads(HeadSelectionPolicy):
    """Replace exactly the listed query heads.

    Args:
        heads: One list per layer of query-head indices to replace; missing layers replace none.
    """

    def __init__(self, heads: list[list[int]]):
        super().__init__(beta=0.0)
        self.heads = [list(h) for h in heads]

    def select(self, layout: AttentionLayout, profile: HeadProfile | None) -> Selection:
        if len(self.heads) > layout.num_layers:
            raise PolicyError(f"model.policy.heads: {len(self.heads)} layers listed, the model has {layout.num_layers}")
        selected = [sorted(set(h)) for h in self.heads] + [[] for _ in range(layout.num_layers - len(self.heads))]
        for layer, heads in enumerate(selected):
            bad = [h for h in heads if not 0 <= h < layout.num_heads]
            if bad:
                raise PolicyError(f"model.policy.heads: layer {layer} lists {bad}; allowed: 0..{layout.num_heads - 1}")
        total = sum(len(s) for s in selected)
        self.beta = total / layout.total_heads
        return selected
