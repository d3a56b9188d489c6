"""Head maps: the profile of a model's heads plus the selection made from it, as JSON.

Schema (``head_map.json``):

- layout and selection: ``model`` (the model the map is applied to: hub id, local path or
  ``embedded:...``), ``num_layers``, ``num_heads``, ``num_kv_heads``, ``beta``, ``selected``
  (one list per layer of replaced query-head indices);
- profile (empty / null when the policy needed none): ``window``, ``alpha``,
  ``exclude_first_token``, ``seq_len``, ``samples``, ``rai`` (layers x query heads, ints),
  ``rr_mean`` (layers x query heads, floats), ``entropy_mean`` (layers x query heads, mean
  normalised attention entropy in [0, 1]; empty in maps written before it was profiled),
  ``measured`` (what a policy measured beyond the recency profile, or empty: for
  :class:`rfkit.conversion.streamed_loss.StreamedLossPolicy` the loss increase of streaming each
  unit alone, ``delta``, layers x units, with its settings and baseline loss);
- provenance: ``policy`` (the policy's settings), ``data`` (the calibration data), ``rfkit_version``,
  ``created`` (UTC ISO time), ``model_fingerprint`` (of the model the map was made on:
  ``config_sha256``, the sha256 of its config's canonical JSON without volatile keys, and
  ``weights``, a sha256 over each safetensors file's name, size, first and last MiB, or null
  when the files are unknown), and ``source`` (null, or ``{path | url, sha256, model}`` when
  the map was taken from an existing head map by :class:`rfkit.conversion.policies.FromHeadMap`; then
  the profile and the provenance above are the source map's).

Files written before the provenance fields existed still load (the new fields are null).
A policy recorded by its implementation path (``rfkit.conversion.policies.X``, as maps written
before one public path per class have it) loads as its public one (``rfkit.policies.X``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rfkit.atomic import atomic_write_bytes, atomic_write_json
from rfkit.classpath import public_path
from rfkit.conversion.profile import HeadProfile
from rfkit.errors import RFKitError
from rfkit.models.layout import AttentionLayout, LayoutError
from rfkit.validate import is_int, positive_int


class HeadMapError(RFKitError):
    """A file that is not a usable head map. One line for the user, naming the field."""


# -- model fingerprints -------------------------------------------------------------------------

#: config keys that say how a model was loaded or run, not what it is
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
    }
)
_EDGE_BYTES = 1 << 20  # the first and last MiB of each weight file


def _stable(value):
    """``value`` with volatile keys dropped at every depth: the above, any ``_``-prefixed key
    (``_attn_implementation*``, ``_commit_hash``) and any ``rf_*`` key."""
    if isinstance(value, dict):
        return {
            str(k): _stable(v)
            for k, v in value.items()
            if str(k) not in VOLATILE_CONFIG_KEYS and not str(k).startswith(("_", "rf_"))
        }
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    return value


def config_sha256(config) -> str:
    """sha256 of a model config's canonical JSON (sorted keys), volatile keys removed."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    text = json.dumps(_stable(raw), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def weights_sha256(model_dir: str | os.PathLike | None) -> str | None:
    """A cheap fingerprint of the ``*.safetensors`` files in ``model_dir``: sha256 over each
    file's name, size, first and last MiB (sorted by name). None when there are none."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_EDGE_BYTES))
            if size > _EDGE_BYTES:
                f.seek(max(_EDGE_BYTES, size - _EDGE_BYTES))
                digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()


def model_fingerprint(config, model_dir: str | os.PathLike | None = None) -> dict:
    """``{"config_sha256": ..., "weights": ... or None}`` for a model's config and weight directory."""
    return {"config_sha256": config_sha256(config), "weights": weights_sha256(model_dir)}


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the head map -------------------------------------------------------------------------------


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
    model_fingerprint: dict | None = None
    created: str | None = None
    source: dict | None = None
    entropy_mean: list[list[float]] = field(default_factory=list)
    measured: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        model_name: str,
        layout: AttentionLayout,
        profile: HeadProfile | None,
        selected,
        policy,
        data: dict,
        fingerprint: dict | None = None,
    ):
        from rfkit.version import __version__

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
            entropy_mean=list(getattr(profile, "entropy_mean", []) or []) if profile else [],
            measured=dict((getattr(profile, "meta", None) or {}).get("measured", {})) if profile else {},
            selected=[list(s) for s in selected],
            policy=policy.describe(),
            data=data,
            rfkit_version=__version__,
            model_fingerprint=fingerprint,
            created=utc_now(),
        )

    @property
    def replaced_heads(self) -> int:
        return sum(len(s) for s in self.selected)

    @property
    def total_heads(self) -> int:
        return self.num_layers * self.num_heads

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.num_heads, self.num_kv_heads)

    def replaced_kv_groups(self) -> list[int]:
        """Per layer, the KV groups all of whose query heads are replaced (their KV cache is freed)."""
        if not self.num_kv_heads or self.num_heads % self.num_kv_heads:
            return []
        size = self.num_heads // self.num_kv_heads
        return [
            sum(all(h in chosen for h in range(g * size, (g + 1) * size)) for g in range(self.num_kv_heads))
            for chosen in (set(s) for s in self.selected)
        ]

    def check_layout(self, layout: AttentionLayout, field: str = "model.head_map", name: str | None = None) -> None:
        """Raise a one-line :class:`LayoutError` naming ``field`` unless the map fits ``layout``."""
        theirs = (layout.num_layers, layout.num_heads, layout.num_kv_heads)
        if self.shape != theirs:
            made = f"'{name}', made for {self.model}" if name else f"made for {self.model}"
            raise LayoutError(
                f"{field}: the head map is for (layers, heads, kv_heads) = {self.shape} ({made}); this model has {theirs}"
            )

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, asdict(self))

    @classmethod
    def from_dict(cls, raw, where: str = "head map") -> "HeadMap":
        """Check ``raw`` (parsed JSON) and build the map; one-line :class:`HeadMapError` prefixed
        with ``where`` otherwise. Only the layout and ``selected`` are required."""

        def bad(detail: str) -> HeadMapError:
            return HeadMapError(f"{where} is not a head map: {detail}")

        if not isinstance(raw, dict):
            raise bad(f"the JSON holds a {type(raw).__name__}, not an object")
        missing = [k for k in ("num_layers", "num_heads", "num_kv_heads", "selected") if k not in raw]
        if missing:
            raise bad(f"missing {', '.join(missing)}")
        for key in ("num_layers", "num_heads", "num_kv_heads"):
            positive_int(key, raw[key], error=bad, message="{field} is {value!r}; allowed: an integer >= {minimum}")
        selected = raw["selected"]
        if not isinstance(selected, list) or len(selected) != raw["num_layers"]:
            raise bad(f"selected must be a list of num_layers = {raw['num_layers']} lists of query-head indices")
        for layer, heads in enumerate(selected):
            if not isinstance(heads, list) or not all(
                is_int(h) and 0 <= h < raw["num_heads"] for h in heads
            ):
                raise bad(f"selected[{layer}] = {heads!r}; allowed: indices 0..{raw['num_heads'] - 1}")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        policy = known.get("policy")
        if isinstance(policy, dict) and isinstance(policy.get("class_path"), str):
            # maps written before one public path per class name rfkit.conversion.policies.X
            known["policy"] = {**policy, "class_path": public_path(policy["class_path"])}
        total = raw["num_layers"] * raw["num_heads"]
        defaults = dict(
            model="unknown", window=None, alpha=None, exclude_first_token=None, seq_len=None, samples=0, rai=[], rr_mean=[],
            beta=sum(len(s) for s in selected) / total,
        )  # fmt: skip
        return cls(**{**defaults, **known})

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "head map") -> "HeadMap":
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise HeadMapError(f"{where} is not a head map: not JSON ({' '.join(str(err).split())})") from None
        return cls.from_dict(raw, where)

    @classmethod
    def load(cls, path: str | os.PathLike, field: str | None = None) -> "HeadMap":
        """Read ``head_map.json``; a file that is not a head map is a one-line :class:`HeadMapError`."""
        where = f"{field}: '{path}'" if field else f"'{path}'"
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise HeadMapError(f"{where} cannot be read: {err.strerror or err}") from None
        return cls.from_bytes(data, where)


# -- shared head maps (rfkit.conversion.policies.FromHeadMap) ----------------------------------------------

URL_SCHEMES = ("http://", "https://", "file://")


def is_url(path: str) -> bool:
    return str(path).lower().startswith(URL_SCHEMES)


def head_map_cache_path(url: str) -> Path:
    from rfkit.hub import cache_dir

    return cache_dir() / "head_maps" / f"{hashlib.sha1(url.encode()).hexdigest()}.json"


def _download(url: str, field: str) -> bytes:
    """The bytes at ``url``, from the cache when it was downloaded before. A download is
    checked to be a head map before it is cached (atomically)."""
    import urllib.error
    import urllib.request

    from rfkit.hub import SourceError

    target = head_map_cache_path(url)
    if target.is_file():
        return target.read_bytes()
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except urllib.error.HTTPError as err:
        raise SourceError(f"{field}: cannot download {url}: HTTP {err.code} {err.reason}") from None
    except urllib.error.URLError as err:
        raise SourceError(f"{field}: cannot download {url}: {' '.join(str(err.reason).split())}") from None
    except (OSError, ValueError) as err:  # timeouts, resets, malformed URLs
        raise SourceError(f"{field}: cannot download {url}: {' '.join(str(err).split()) or type(err).__name__}") from None
    HeadMap.from_bytes(data, f"{field}: '{url}'")
    atomic_write_bytes(target, data)
    return data


def fetch_head_map(path: str, field: str = "model.policy.path") -> tuple[HeadMap, dict]:
    """Read a shared head map from a local file or an ``http(s)://`` / ``file://`` URL.

    Returns the map and its ``source`` record: ``{"path": absolute path}`` or ``{"url": url}``,
    plus ``sha256`` of the file and ``model`` (the model the map was made for). Errors are one
    line naming ``field``.
    """
    from rfkit.hub import SourceError

    path = str(path)
    if is_url(path):
        data = _download(path, field)
        source = {"url": path}
    else:
        local = Path(path).expanduser()
        if not local.is_file():
            raise SourceError(
                f"{field}: '{path}' does not exist; allowed: a head_map.json file or an http(s):// or file:// URL"
            )
        try:
            data = local.read_bytes()
        except OSError as err:
            raise SourceError(f"{field}: '{path}' cannot be read: {err.strerror or err}") from None
        source = {"path": str(local.resolve())}
    head_map = HeadMap.from_bytes(data, f"{field}: '{path}'")
    source.update(sha256=sha256_bytes(data), model=head_map.model)
    return head_map, source


def save_profile(profile: HeadProfile, path: Path) -> None:
    atomic_write_json(path, asdict(profile))


def load_profile(path: Path) -> HeadProfile:
    with open(path) as f:
        return HeadProfile(**json.load(f))
