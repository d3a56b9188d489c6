"""Head maps: the profile of a model's heads plus the selection made from it, as JSON.

Schema (``head_map.json``): ``model``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
``window``, ``alpha``, ``beta``, ``exclude_first_token``, ``seq_len``, ``samples``, ``rai``
(layers x query heads, ints), ``rr_mean`` (layers x query heads, floats), ``selected`` (one
list per layer of replaced query-head indices), plus provenance: ``policy``, ``data``,
``rfkit_version``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rfkit.atomic import atomic_write
from rfkit.layout import AttentionLayout, LayoutError
from rfkit.profile import HeadProfile


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


@dataclass
class HeadMap:
    model: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    window: int | None
    alpha: float | None
    beta: float
    exclude_first_token: bool | None
    seq_len: int | None
    samples: int
    rai: list[list[int]]
    rr_mean: list[list[float]]
    selected: list[list[int]]
    policy: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    rfkit_version: str = ""

    @classmethod
    def build(cls, model_name: str, layout: AttentionLayout, profile: HeadProfile | None, selected, policy, data: dict):
        from rfkit import __version__

        return cls(
            model=model_name,
            num_layers=layout.num_layers,
            num_heads=layout.num_heads,
            num_kv_heads=layout.num_kv_heads,
            window=profile.window if profile else None,
            alpha=profile.alpha if profile else None,
            beta=policy.beta,
            exclude_first_token=profile.exclude_first_token if profile else None,
            seq_len=profile.seq_len if profile else None,
            samples=profile.samples if profile else 0,
            rai=profile.rai if profile else [],
            rr_mean=profile.rr_mean if profile else [],
            selected=[list(s) for s in selected],
            policy=policy.describe(),
            data=data,
            rfkit_version=__version__,
        )

    @property
    def replaced_heads(self) -> int:
        return sum(len(s) for s in self.selected)

    @property
    def total_heads(self) -> int:
        return self.num_layers * self.num_heads

    def check_layout(self, layout: AttentionLayout) -> None:
        mine = (self.num_layers, self.num_heads, self.num_kv_heads)
        theirs = (layout.num_layers, layout.num_heads, layout.num_kv_heads)
        if mine != theirs:
            raise LayoutError(
                f"model.head_map: the head map is for (layers, heads, kv_heads) = {mine} "
                f"({self.model}); the model has {theirs}"
            )

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, asdict(self))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HeadMap":
        with open(path) as f:
            raw = json.load(f)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)


def save_profile(profile: HeadProfile, path: Path) -> None:
    atomic_write_json(path, asdict(profile))


def load_profile(path: Path) -> HeadProfile:
    with open(path) as f:
        return HeadProfile(**json.load(f))
