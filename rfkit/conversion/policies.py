"""Head-selection policies: which query heads of which layers a conversion replaces.

A policy is any subclass of :class:`HeadSelectionPolicy`. Recipes name it by ``class_path``
(``rfkit.policies.RecencyRatioPolicy`` or ``my_policies.EvenLayers``); jsonargparse checks
its ``init_args`` against ``__init__``. That is the whole plugin mechanism.
"""

from __future__ import annotations

import inspect
import logging
import math
from abc import ABC, abstractmethod
from typing import Literal

from rfkit.classpath import class_path
from rfkit.conversion.profile import HeadProfile, profile_heads
from rfkit.errors import RFKitError
from rfkit.models.layout import AttentionLayout
from rfkit.validate import boolean, fraction, is_int, one_of, positive_int

log = logging.getLogger(__name__)

#: what the paper found when every head goes (the opt-in error and warning quote it)
ALL_HEADS_QUALITY = "which the RecurFormer paper reports destroys quality"


class PolicyError(RFKitError):
    """A bad policy setting. One line for the user, naming the field."""


Selection = list[list[int]]  # per layer, sorted replaced query-head indices


class HeadSelectionPolicy(ABC):
    """Base class. Subclasses implement :meth:`select`.

    Args:
        beta: Fraction of heads to replace, in [0, 1] (the paper's ratio beta).
        allow_all_heads: Let a recipe run beta = 1 (every attention head replaced). The paper
            reports that this destroys quality, so ``rfkit`` refuses beta 1 without this flag
            and warns with it (see :func:`check_all_heads`).
    """

    #: whether :meth:`select` needs a calibration profile (RR / RA-I statistics)
    needs_profile: bool = False
    #: the beta = 1 opt-in (instances set it from ``allow_all_heads``)
    allow_all_heads: bool = False

    def __init__(self, beta: float = 0.5, allow_all_heads: bool = False):
        fraction("model.policy.beta", beta, error=PolicyError, message="{field}: {value!r} is not allowed; beta must lie {bounds}")
        boolean("model.policy.allow_all_heads", allow_all_heads, error=PolicyError)
        self.beta = float(beta)
        self.allow_all_heads = allow_all_heads

    def profile_settings(self) -> dict | None:
        """Settings for profiling, or None when no profile is needed. They also key the profile
        cache, so a policy that measures something of its own puts its settings here."""
        return None

    def make_profile(self, model, batches, progress: bool = True, datamodule=None) -> HeadProfile:
        """The profile :meth:`select` reads, measured on the calibration ``batches`` (dicts with
        ``input_ids``) with the base ``model``: by default the recency profile
        (:func:`~rfkit.conversion.profile.profile_heads`) with :meth:`profile_settings`. A policy
        that measures something else overrides it and keeps its results in ``profile.meta``
        (``meta["measured"]`` is copied into the head map). ``datamodule`` (the recipe's
        :class:`~rfkit.data.TextDataModule`, when there is one) gives other data in the model's
        tokenisation: ``datamodule.other_train_blocks(source, seq_len, field)``."""
        return profile_heads(model, batches, progress=progress, **self.profile_settings())

    @abstractmethod
    def select(self, layout: AttentionLayout, profile: HeadProfile | None) -> Selection:
        """Implemented by every subclass."""

    def describe(self) -> dict:
        out = {"class_path": class_path(type(self)), "beta": self.beta}
        if self.allow_all_heads:
            out["allow_all_heads"] = True
        return out


def takes_beta(policy: HeadSelectionPolicy) -> bool:
    """Whether the policy's class takes a ``beta`` (a ratio policy) rather than computing it."""
    return "beta" in inspect.signature(type(policy).__init__).parameters


def check_all_heads(policy: HeadSelectionPolicy, field: str = "model.policy.init_args") -> bool:
    """The beta = 1 opt-in of a recipe's ratio policy: beta 1 without ``allow_all_heads`` is a
    one-line :class:`PolicyError` naming ``<field>.beta`` and the flag; with it, a warning.
    Returns whether every head is replaced. Policies that compute their beta (ExplicitHeads,
    FromHeadMap) are not checked."""
    if not takes_beta(policy) or float(policy.beta) < 1.0:
        return False
    name = type(policy).__name__
    if not getattr(policy, "allow_all_heads", False):
        takes_flag = "allow_all_heads" in inspect.signature(type(policy).__init__).parameters
        how = (
            f"set {field}.allow_all_heads: true to run it anyway (a reference point, not a model)"
            if takes_flag
            else f"{name} does not take allow_all_heads, so give a beta below 1"
        )
        raise PolicyError(f"{field}.beta: 1.0 replaces every attention head, {ALL_HEADS_QUALITY}; {how}, or choose beta < 1")
    log.warning(
        "%s.beta = 1 with allow_all_heads: %s replaces every attention head, %s; the run goes on as asked",
        field, name, ALL_HEADS_QUALITY,
    )  # fmt: skip
    return True


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
        keep_layers: Layers that keep all their heads (for example ``[0, 1]``: an error in an
            early layer reaches every later one). ``beta`` stays a fraction of all units, so
            the other layers give up more.
        allow_all_heads: Allow beta = 1 (every head replaced) in a recipe; the paper reports
            that this destroys quality, so it is refused without this flag and warned about
            with it.
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
        keep_layers: list[int] | None = None,
        allow_all_heads: bool = False,
    ):
        super().__init__(beta, allow_all_heads)
        self.keep_layers = _check_layers("keep_layers", keep_layers)
        positive_int("model.policy.window", window, error=PolicyError, message="{field}: {value!r} is not allowed; window must be an integer >= {minimum}")
        fraction("model.policy.alpha", alpha, error=PolicyError, message="{field}: {value!r} is not allowed; alpha must lie {bounds}")
        _check_granularity(granularity)
        one_of("model.policy.scope", scope, ("global", "per_layer"), error=PolicyError)
        self.window, self.alpha = window, float(alpha)
        self.exclude_first_token = bool(exclude_first_token)
        self.granularity, self.scope = granularity, scope

    def profile_settings(self) -> dict:
        return {"window": self.window, "alpha": self.alpha, "exclude_first_token": self.exclude_first_token}

    def describe(self) -> dict:
        extra = {"granularity": self.granularity, "scope": self.scope}
        if self.keep_layers:
            extra["keep_layers"] = self.keep_layers
        return {**super().describe(), **self.profile_settings(), **extra}

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
        _check_layers("keep_layers", self.keep_layers, layout.num_layers)
        scores = self.unit_scores(layout, profile)
        n_all = len(scores)
        scores = {key: s for key, s in scores.items() if key[0] not in self.keep_layers}
        if self.scope == "global":
            chosen = _top(scores, _count(self.beta, n_all))
        else:
            chosen = []
            for layer in sorted({key[0] for key in scores}):
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


def _check_granularity(granularity: str) -> str:
    return one_of("model.policy.granularity", granularity, ("kv_group", "query_head"), error=PolicyError)


def _check_layers(field: str, layers, num_layers: int | None = None) -> list[int]:
    """A list of distinct layer indices (>= 0, and < ``num_layers`` when known)."""
    if layers is None:
        return []
    if isinstance(layers, (str, bytes)) or not all(is_int(i) for i in layers):
        raise PolicyError(f"model.policy.{field}: {layers!r} is not allowed; give a list of layer indices")
    bad = [i for i in layers if i < 0 or (num_layers is not None and i >= num_layers)]
    if bad:
        allowed = f"0..{num_layers - 1}" if num_layers is not None else "integers >= 0"
        raise PolicyError(f"model.policy.{field}: layers {bad} are not allowed; allowed: {allowed}")
    return sorted(set(layers))


def _all_units(layout: AttentionLayout, granularity: str) -> list[tuple[int, int]]:
    per_layer = layout.num_kv_heads if granularity == "kv_group" else layout.num_heads
    return [(layer, u) for layer in range(layout.num_layers) for u in range(per_layer)]


class RandomHeads(HeadSelectionPolicy):
    """Replace a random fraction ``beta`` of units: the control that shows what the recency
    ranking buys. The same ``seed`` gives the same selection.

    Args:
        beta: Fraction of units (KV groups or query heads) to replace, in [0, 1].
        seed: Seed of the draw.
        granularity: ``kv_group`` (whole KV groups, frees KV cache in GQA models) or ``query_head``.
        keep_layers: Layers that are never touched (their units are not drawn).
        allow_all_heads: Allow beta = 1 (every head replaced) in a recipe; the paper reports
            that this destroys quality, so it is refused without this flag and warned about
            with it.
    """

    def __init__(
        self,
        beta: float = 0.5,
        seed: int = 0,
        granularity: Literal["kv_group", "query_head"] = "kv_group",
        keep_layers: list[int] | None = None,
        allow_all_heads: bool = False,
    ):
        super().__init__(beta, allow_all_heads)
        self.seed = int(seed)
        self.granularity = _check_granularity(granularity)
        self.keep_layers = _check_layers("keep_layers", keep_layers)

    def describe(self) -> dict:
        return {**super().describe(), "seed": self.seed, "granularity": self.granularity, "keep_layers": self.keep_layers}

    def select(self, layout: AttentionLayout, profile: HeadProfile | None) -> Selection:
        import random

        _check_layers("keep_layers", self.keep_layers, layout.num_layers)
        units = _all_units(layout, self.granularity)
        pool = [u for u in units if u[0] not in self.keep_layers]
        n = min(len(pool), _count(self.beta, len(units)))
        chosen = random.Random(self.seed).sample(pool, n)
        return units_to_heads(layout, chosen, self.granularity)


class LayerwisePolicy(HeadSelectionPolicy):
    """Replace whole layers (every head of a layer): the between-layer hybrid baseline of
    MambaInLlama and Jamba, against which head-level replacement is compared.

    Args:
        beta: Fraction of layers to replace, in [0, 1] (ignored when ``layers`` is given).
        layers: Explicit layer indices to replace.
        choose: How ``beta`` picks layers: ``spread`` spaces them evenly over the depth,
            interleaved with attention layers as the distilled hybrids do, and never picks
            layer 0; ``recency`` takes the layers whose heads have the highest summed RA-I
            (needs a calibration profile).
        window: Local window k for the ``recency`` profile (as RecencyRatioPolicy).
        alpha: RR threshold for the ``recency`` profile.
        exclude_first_token: Leave token 0 out of the RR sums.
        keep_layers: Layers never replaced.
        allow_all_heads: Allow beta = 1 (every layer replaced) in a recipe; the paper reports
            that replacing every head destroys quality, so it is refused without this flag and
            warned about with it.
    """

    def __init__(
        self,
        beta: float = 0.5,
        layers: list[int] | None = None,
        choose: Literal["spread", "recency"] = "spread",
        window: int = 51,
        alpha: float = 0.5,
        exclude_first_token: bool = True,
        keep_layers: list[int] | None = None,
        allow_all_heads: bool = False,
    ):
        super().__init__(beta, allow_all_heads)
        one_of("model.policy.choose", choose, ("spread", "recency"), error=PolicyError)
        self.layers = _check_layers("layers", layers) if layers is not None else None
        self.choose = choose
        self._recency = RecencyRatioPolicy(window, alpha, beta, exclude_first_token, allow_all_heads=allow_all_heads)  # validates
        self.keep_layers = _check_layers("keep_layers", keep_layers)

    @property
    def needs_profile(self) -> bool:  # type: ignore[override]
        return self.layers is None and self.choose == "recency"

    def profile_settings(self) -> dict | None:
        return self._recency.profile_settings() if self.needs_profile else None

    def describe(self) -> dict:
        extra = {"layers": self.layers, "choose": self.choose, "keep_layers": self.keep_layers}
        if self.needs_profile:
            extra.update(self._recency.profile_settings())
        return {**super().describe(), **extra}

    def layer_choice(self, layout: AttentionLayout, profile: HeadProfile | None) -> list[int]:
        n_layers = layout.num_layers
        if self.layers is not None:
            return _check_layers("layers", self.layers, n_layers)
        _check_layers("keep_layers", self.keep_layers, n_layers)
        pool = [i for i in range(n_layers) if i not in self.keep_layers]
        n = min(len(pool), _count(self.beta, n_layers))
        if n == 0:
            return []
        if self.choose == "recency":
            if profile is None:
                raise PolicyError("model.policy.choose: recency needs a calibration profile (a data section)")
            score = {i: (float(sum(profile.rai[i])), sum(profile.rr_mean[i])) for i in pool}
            return sorted(_top(score, n))
        # spread: n evenly spaced positions over the pool, starting after its first layer
        step = len(pool) / n
        return sorted({pool[min(len(pool) - 1, int((k + 1) * step - 1e-9))] for k in range(n)})

    def select(self, layout: AttentionLayout, profile: HeadProfile | None) -> Selection:
        chosen = set(self.layer_choice(layout, profile))
        selected = [list(range(layout.num_heads)) if i in chosen else [] for i in range(layout.num_layers)]
        if self.layers is not None:
            self.beta = len(chosen) / layout.num_layers
        return selected


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


class FromHeadMap(HeadSelectionPolicy):
    """Reuse the selection of an existing head map: nothing is profiled.

    The map must be for the same attention layout (layers, query heads, KV heads); a map
    made on another model of that shape is used with a warning. The head map the run writes
    keeps the source map's profile and provenance and records the file in ``source``.

    Args:
        path: A ``head_map.json`` file, or an ``http(s)://`` or ``file://`` URL of one
            (downloaded once into the rfkit cache, ``<cache>/head_maps/``).
    """

    needs_profile = False
    #: the recipe field named in errors (``model.head_map`` when the module routes its argument here)
    field = "model.policy.path"

    def __init__(self, path: str):
        super().__init__(beta=0.0)
        self._open(path)

    @classmethod
    def for_field(cls, path: str, field: str) -> "FromHeadMap":
        """A FromHeadMap whose errors name ``field`` instead of ``model.policy.path``."""
        policy = cls.__new__(cls)
        HeadSelectionPolicy.__init__(policy, beta=0.0)
        policy.field = field
        policy._open(path)
        return policy

    def _open(self, path: str) -> None:
        from rfkit.conversion.headmap import fetch_head_map

        self.path = str(path)
        self.head_map, self.source = fetch_head_map(self.path, self.field)
        self.beta = self.head_map.replaced_heads / self.head_map.total_heads

    def profile_settings(self) -> None:
        return None

    def select(self, layout: AttentionLayout, profile: HeadProfile | None) -> Selection:
        self.head_map.check_layout(layout, self.field, self.path)
        return [sorted(set(s)) for s in self.head_map.selected]

    def describe(self) -> dict:
        return {**super().describe(), "path": self.path}
