"""Policies and operators by short name, for command lines such as ``rfkit sweep``.

A spec is ``NAME`` or ``NAME(key=value, ...)``; values are read as YAML (``window=16``,
``keep_layers=[0, 1]``). ``NAME`` is an alias below, the class name of any imported subclass
(plugins registered under the ``rfkit.plugins`` entry point are imported first), or a dotted
class path. Recipes name classes through jsonargparse instead (``class_path:``).
"""

from __future__ import annotations

import difflib
import importlib
import re

from rfkit.errors import RFKitError

POLICY_ALIASES = {
    "recency": "rfkit.policies.RecencyRatioPolicy",
    "random": "rfkit.policies.RandomHeads",
    "layerwise": "rfkit.policies.LayerwisePolicy",
    "streamed_loss": "rfkit.policies.StreamedLossPolicy",
    "explicit": "rfkit.policies.ExplicitHeads",
    "from_head_map": "rfkit.policies.FromHeadMap",
}
OPERATOR_ALIASES = {
    "mamba": "rfkit.operators.MambaOperator",
    "sliding_window": "rfkit.operators.SlidingWindowOperator",
    "sink_recent": "rfkit.operators.SinkRecentOperator",
    "hybrid": "rfkit.operators.HybridOperator",
    "hybrid_mamba": "rfkit.operators.HybridMambaOperator",
}

_SPEC = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(?:\((.*)\))?\s*$", re.S)


class SpecError(RFKitError):
    """A policy or operator spec that cannot be built; one line for the user."""


def split_specs(text: str) -> list[str]:
    """``"a,b(x=1, y=2),c"`` -> ``["a", "b(x=1, y=2)", "c"]``: commas inside brackets stay."""
    parts, depth, current = [], 0, ""
    for ch in str(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return [p for p in parts if p]


def parse_spec(text: str, flag: str) -> tuple[str, dict]:
    """``"sink_recent(sink=4, window=16)"`` -> ``("sink_recent", {"sink": 4, "window": 16})``."""
    import yaml

    found = _SPEC.match(text)
    if not found:
        raise SpecError(f"{flag}: '{text}' is not NAME or NAME(key=value, ...)")
    name, body = found.group(1), found.group(2)
    kwargs = {}
    for item in split_specs(body or ""):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise SpecError(f"{flag}: '{item}' in '{text}' is not key=value")
        try:
            kwargs[key.strip()] = yaml.safe_load(value.strip()) if value.strip() else None
        except yaml.YAMLError:
            raise SpecError(f"{flag}: cannot read the value of '{key.strip()}' in '{text}'") from None
    return name, kwargs


def _subclasses(base: type) -> dict[str, type]:
    found, todo = {}, [base]
    while todo:
        for cls in todo.pop().__subclasses__():
            found.setdefault(cls.__name__, cls)
            todo.append(cls)
    return found


def resolve_class(name: str, base: type, aliases: dict[str, str], flag: str) -> type:
    """The class ``name`` means: an alias, an imported subclass's name, or a dotted path."""
    path = aliases.get(name)
    if path is None and "." in name:
        path = name
    if path is not None:
        module_name, _, cls_name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            raise SpecError(f"{flag}: cannot import '{path}'") from None
    else:
        known = _subclasses(base)
        cls = known.get(name)
        if cls is None:
            names = sorted(aliases) + sorted(n for n in known if not n.startswith("_"))
            near = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
            hint = f"nearest: {', '.join(near)}" if near else f"known: {', '.join(names)}"
            raise SpecError(f"{flag}: unknown name '{name}'; {hint}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise SpecError(f"{flag}: '{name}' is not a {base.__name__} subclass")
    return cls


def build(text: str, base: type, aliases: dict[str, str], flag: str, defaults: dict | None = None):
    """An instance from a spec; ``defaults`` fill keyword arguments the class takes and the spec
    leaves out."""
    import inspect

    name, kwargs = parse_spec(text, flag)
    cls = resolve_class(name, base, aliases, flag)
    accepted = inspect.signature(cls.__init__).parameters
    for key, value in (defaults or {}).items():
        if key in accepted and key not in kwargs:
            kwargs[key] = value
    unknown = [k for k in kwargs if k not in accepted and not any(p.kind == p.VAR_KEYWORD for p in accepted.values())]
    if unknown:
        allowed = ", ".join(p for p in accepted if p != "self")
        raise SpecError(f"{flag}: {cls.__name__} takes no '{unknown[0]}'; allowed: {allowed}")
    try:
        return cls(**kwargs)
    except RFKitError as err:
        raise SpecError(f"{flag}: {text}: {' '.join(str(err).split())}") from None
    except TypeError as err:
        raise SpecError(f"{flag}: {text}: {' '.join(str(err).split())}") from None


def policy(text: str, defaults: dict | None = None):
    from rfkit.conversion.policies import HeadSelectionPolicy

    return build(text, HeadSelectionPolicy, POLICY_ALIASES, "--policies", defaults)


def operator(text: str, flag: str = "--operators"):
    from rfkit.models.operators import ReplacementOperator

    return build(text, ReplacementOperator, OPERATOR_ALIASES, flag)
