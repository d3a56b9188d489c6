"""The installed Lightning and jsonargparse are the ones rfkit is written against.

rfkit/config/lightning_cli.py overrides or names a few of Lightning's private methods and lists
them, with the parameters it relies on, in ``PRIVATE_API``. A Lightning release that changes one
of them fails here with a message that names the method, instead of somewhere deep in a run.
The second check keeps pyproject.toml honest: the installed versions lie inside its bounds.
"""

from __future__ import annotations

import importlib
import inspect
import re
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest

from rfkit.config import lightning_cli
from rfkit.config.lightning_cli import PRIVATE_API

ROOT = Path(__file__).resolve().parents[2]
PINNED = ("lightning", "jsonargparse")  # the two whose API rfkit/config/lightning_cli.py follows


def _resolve(dotted: str):
    """The object a dotted name means: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def _short(dotted: str) -> str:
    """``lightning.pytorch.cli.LightningCLI._parser`` -> ``LightningCLI._parser``."""
    return ".".join(dotted.split(".")[-2:])


def _overridden_in_rfkit(dotted: str) -> bool:
    """Whether a class in rfkit/config/lightning_cli.py defines its own version of the method:
    Lightning then calls rfkit's override with whatever arguments it passes, so any parameter
    Lightning adds (even one with a default) breaks the override."""
    owner, method = dotted.rsplit(".", 1)
    base = _resolve(owner)
    if not isinstance(base, type):
        return False
    return any(
        inspect.isclass(obj) and obj is not base and issubclass(obj, base) and method in vars(obj)
        for obj in vars(lightning_cli).values()
    )


def _is_subsequence(expected, found) -> bool:
    it = iter(found)
    return all(name in it for name in expected)


def test_private_api_table_is_not_empty():
    assert PRIVATE_API, "rfkit/config/lightning_cli.py lists no Lightning private API"
    assert "lightning.pytorch.Trainer._run" in PRIVATE_API


@pytest.mark.parametrize("dotted", sorted(PRIVATE_API), ids=_short)
def test_lightning_private_api_has_the_parameters_rfkit_relies_on(dotted):
    import lightning

    expected = tuple(PRIVATE_API[dotted])
    overridden = _overridden_in_rfkit(dotted)
    where = f"rfkit/config/lightning_cli.py {'overrides' if overridden else 'uses'} it"
    method = _resolve(dotted)
    assert method is not None and callable(method), (
        f"Lightning {lightning.__version__} removed {_short(dotted)}: {where}; "
        f"expected ({', '.join(expected)}), found nothing"
    )
    params = inspect.signature(method).parameters
    found = tuple(params)
    message = (
        f"Lightning {lightning.__version__} changed {_short(dotted)}: {where}; "
        f"expected ({', '.join(expected)}), found ({', '.join(found)})"
    )
    # rfkit's parameters are all there, in the same order
    assert _is_subsequence(expected, found), message
    if overridden:
        # Lightning calls rfkit's override: a parameter it added would reach an override without it
        assert found == expected, message
    else:
        # rfkit calls it without any parameter it does not list: those must be optional
        required = [
            name
            for name, p in params.items()
            if name not in expected
            and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        assert not required, message


def _declared_requirements() -> dict[str, str]:
    """name -> version specifier text, from pyproject.toml's [project] dependencies."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for requirement in project["dependencies"]:
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*(.*)$", requirement)
        assert match, f"pyproject.toml: cannot read the dependency {requirement!r}"
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        declared[name] = match.group(3).split(";")[0].strip()
    return declared


def _release(text: str) -> tuple[int, ...]:
    """'2.6.0.post1' -> (2, 6, 0): the numeric release part, for the plain comparison below."""
    numbers = re.match(r"\d+(?:\.\d+)*", text.strip())
    release = tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()
    while release and release[-1] == 0:
        release = release[:-1]
    return release


_COMPARE = {
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


def _contains_plain(specifier: str, version: str) -> bool:
    """``version`` satisfies ``specifier`` (e.g. '>=2.6,<2.7') by release numbers alone: enough
    for the >=, >, <=, <, ==, != bounds pyproject.toml uses."""
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        op, bound = re.match(r"(>=|<=|==|!=|>|<)\s*(.+)$", clause).groups()
        if not _COMPARE[op](_release(version), _release(bound)):
            return False
    return True


def _contains(specifier: str, version: str) -> bool:
    """packaging's answer where it is installed (it comes with pip and setuptools), else the plain one."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        return _contains_plain(specifier, version)
    return SpecifierSet(specifier).contains(Version(version), prereleases=True)


@pytest.mark.parametrize("name", PINNED)
def test_installed_version_is_inside_the_bounds_pyproject_declares(name):
    declared = _declared_requirements()
    assert name in declared, f"pyproject.toml does not declare {name}"
    specifier = declared[name]
    assert ">" in specifier and "<" in specifier, (
        f"pyproject.toml declares {name}{specifier}: rfkit follows its API, so give a lower and an upper bound"
    )
    found = installed_version(name)
    assert _contains(specifier, found), (
        f"{name} {found} is installed but pyproject.toml declares {name}{specifier}: "
        "rfkit is tested only inside those bounds (see rfkit/config/lightning_cli.py)"
    )


@pytest.mark.parametrize(
    "specifier, version, inside",
    [
        (">=2.6,<2.7", "2.6.0", True),
        (">=2.6,<2.7", "2.6.6", True),
        (">=2.6,<2.7", "2.5.6", False),
        (">=2.6,<2.7", "2.7.0", False),
        (">=4.32,<5", "4.53.0", True),
        (">=4.32,<5", "4.31.0", False),
        (">=4.32,<5", "5.0.0", False),
        ("==2.6.0", "2.6", True),
        ("!=2.6.1", "2.6.1", False),
    ],
)
def test_plain_version_check_agrees_with_packaging(specifier, version, inside):
    # the fallback used where packaging is not importable
    assert _contains_plain(specifier, version) is inside
    assert _contains(specifier, version) is inside
