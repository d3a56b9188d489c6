"""The recipe catalogue: the YAML recipes that ship inside rfkit as ``rfkit.recipes``.

    rfkit recipes list                       name, kind, base model, beta, operator, what it reproduces
    rfkit recipes show NAME                  print the recipe's YAML
    rfkit recipes cp NAME DEST [--force]     copy it to edit (DEST a file, or a directory: DEST/NAME.yaml)

``--config`` of ``rfkit fit|validate|test|profile|convert`` and of ``rfkit sweep`` takes a
catalogue name as well as a path (``rfkit fit --config smollm2_b05``): an existing file wins,
then a catalogue name (with or without ``.yaml``); anything else is one line that names the
nearest recipes. ``mqar_*`` recipes are ``rfkit eval mqar`` configs, not LightningCLI recipes.

This module itself needs only pyyaml, the standard library and :mod:`rfkit.atomic` (``cp``'s
atomic write); it imports neither torch nor transformers, though ``import rfkit`` does.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from importlib import resources
from pathlib import Path

import yaml

from rfkit.atomic import atomic_write_text
from rfkit.config.args import OneLineParser
from rfkit.errors import RFKitError

PACKAGE = "rfkit.recipes"
EVAL_MQAR_PREFIX = "mqar_"  # `rfkit eval mqar` configs; every other recipe is a LightningCLI fit recipe
DEFAULT_POLICY = "RecencyRatioPolicy"  # RecurFormerModule's default, and what `rfkit eval mqar` selects with
DEFAULT_OPERATOR = "MambaOperator"  # RecurFormerModule's default, and what `rfkit eval mqar` converts to
_REPRODUCES = re.compile(r"#\s*Reproduces:\s*(.*\S)")
_SUFFIXES = (".yaml", ".yml")


class CatalogError(RFKitError):
    """An unknown recipe name or a bad ``rfkit recipes`` argument; one line for the user."""


def recipes_dir() -> Path:
    """The directory that holds the packaged recipes (``recipes/`` in an editable install)."""
    return Path(str(resources.files(PACKAGE)))


def recipe_names() -> list[str]:
    """Every catalogue recipe's name (the file name without ``.yaml``), sorted."""
    return sorted(p.stem for p in recipes_dir().iterdir() if p.suffix == ".yaml" and p.is_file())


def _bare(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _unknown(value: str, flag: str, problem: str) -> CatalogError:
    """``FLAG: 'VALUE' PROBLEM; nearest: a, b (rfkit recipes list)``, or a few names when none is close."""
    names = recipe_names()
    query = _bare(Path(value).name)
    score = {n: difflib.SequenceMatcher(None, query, n).ratio() for n in names}
    close = [n for n in names if score[n] >= 0.65 or (len(query) >= 3 and query in n)]
    nearest = [query] if query in names else sorted(close, key=lambda n: -score[n])[:3]
    if nearest:
        hint = "nearest: " + ", ".join(nearest)
    else:
        fit = [n for n in names if not n.startswith(EVAL_MQAR_PREFIX)]
        hint = "recipes: " + ", ".join(fit[:5]) + (", ..." if len(fit) > 5 else "")
    return CatalogError(f"{flag}: '{value}' {problem}; {hint} (rfkit recipes list)")


def recipe_path(name: str, flag: str = "NAME") -> Path:
    """The packaged file of recipe ``name`` (``smollm2_b05`` or ``smollm2_b05.yaml``); an
    unknown name is a :class:`CatalogError` that names the nearest recipes."""
    bare = _bare(str(name))
    if bare in recipe_names():
        return recipes_dir() / f"{bare}.yaml"
    raise _unknown(str(name), flag, "is not a catalogue recipe")


def recipe_kind(path: str | Path) -> str | None:
    """``"eval mqar"`` or ``"fit"`` for a recipe file, read from its name and its top-level keys
    (None when it is unreadable or neither: the command's own parser then says what is wrong).
    A LightningCLI recipe has a ``trainer`` section or a ``model.base_model``; an ``rfkit eval
    mqar`` config is named ``mqar_*`` or has ``train`` and ``betas`` sections; failing both, a
    ``data`` section means a fit recipe."""
    path = Path(path).expanduser()
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(config, dict):
        return None
    model = config.get("model")
    if "trainer" in config or (isinstance(model, dict) and "base_model" in model):
        return "fit"
    if path.stem.startswith(EVAL_MQAR_PREFIX) or ("train" in config and "betas" in config):
        return "eval mqar"
    return "fit" if "data" in config else None


def check_recipe_kind(path: str, value: str, command: str) -> None:
    """A recipe of the other kind given to ``rfkit COMMAND`` is one line naming the command that
    reads it. ``command``: ``fit`` (and validate, test, profile, convert, sweep: they read fit
    recipes) or ``eval mqar``."""
    kind = recipe_kind(path)
    wanted = "eval mqar" if command == "eval mqar" else "fit"
    if kind is not None and kind != wanted:
        raise CatalogError(f"{value} is an 'rfkit {kind}' recipe, not one for rfkit {command}: run rfkit {kind} --config {value}")


def resolve_config(value: str, flag: str = "--config", command: str | None = None) -> str:
    """What ``--config VALUE`` means: ``value`` itself when it is an existing file, else the path
    (str) of the catalogue recipe it names (a bare name, ``.yaml`` optional). An existing
    directory that names no recipe is returned as given, for the caller's own message. Anything
    else is a :class:`CatalogError` that names the nearest recipes: ``'VALUE' is neither a file
    nor a catalogue recipe`` for a bare name, ``'VALUE' does not exist`` for a path with a
    directory (``recipes/smollm2_b05.yaml`` outside the source tree suggests ``smollm2_b05``).
    With ``command``, a recipe of another kind is refused (:func:`check_recipe_kind`)."""
    value = str(value)
    if not value.strip() or value.startswith("-"):
        raise CatalogError(f"{flag}: needs a recipe: a YAML file or a catalogue name such as smollm2_b05 (rfkit recipes list)")
    path = Path(value).expanduser()
    if path.is_file():
        if command:
            check_recipe_kind(value, value, command)
        return value
    bare_name = "/" not in value and "\\" not in value  # a path with a directory is never a name
    if bare_name and _bare(value) in recipe_names():
        found = str(recipe_path(value, flag))
        if command:
            check_recipe_kind(found, value, command)
        return found
    if path.is_dir():
        return value
    raise _unknown(value, flag, "is neither a file nor a catalogue recipe" if bare_name else "does not exist")


def resolve_model_spec(value: str) -> str:
    """A ``--model`` value of ``rfkit bench`` / ``rfkit eval``: a catalogue name (a bare name that
    is no existing file or directory) becomes the packaged recipe's path; anything else is
    returned as given, for the command's own checks."""
    value = str(value)
    if Path(value).expanduser().exists() or "/" in value or "\\" in value:
        return value
    return str(recipe_path(value)) if _bare(value) in recipe_names() else value


def _short(class_path: str | None, default: str) -> str:
    return str(class_path).rsplit(".", 1)[-1] if class_path else default


def _reproduces(text: str) -> str | None:
    """The ``# Reproduces: ...`` line of the recipe's leading comment block."""
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        found = _REPRODUCES.match(line)
        if found:
            return found.group(1)
    return None


def describe(name: str) -> dict:
    """One recipe at a glance, read from its YAML without building anything.

    Keys: ``name``, ``kind`` (``fit`` or ``eval mqar``), ``base_model``, ``beta`` (the policy's
    ``init_args.beta``, None when the recipe leaves it to the default), ``betas`` (the list an
    ``eval mqar`` config sweeps; None for fit recipes), ``policy`` and ``operator`` (short class
    names; the defaults RecencyRatioPolicy and MambaOperator when the recipe names none),
    ``reproduces`` (its ``# Reproduces:`` line) and ``path``.
    """
    path = recipe_path(name)
    text = path.read_text()
    try:
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise CatalogError(f"recipe {path.stem}: not valid YAML: {' '.join(str(err).split())}") from None
    model = config.get("model") or {}
    if path.stem.startswith(EVAL_MQAR_PREFIX):
        # a random-init Llama trained from scratch, converted with RecencyRatioPolicy + MambaOperator
        size = ", ".join(part for part in (
            f"{model['layers']} layers" if "layers" in model else "",
            f"d_model {model['d_model']}" if "d_model" in model else "",
        ) if part)  # fmt: skip
        betas = [float(b) for b in config.get("betas") or []]
        kind, base_model, beta = "eval mqar", f"random-init Llama ({size})" if size else "random-init Llama", None
        policy, operator = DEFAULT_POLICY, DEFAULT_OPERATOR
    else:
        policy_spec, operator_spec = model.get("policy") or {}, model.get("operator") or {}
        init_args = (policy_spec.get("init_args") or {}) if isinstance(policy_spec, dict) else {}
        kind, base_model, betas = "fit", model.get("base_model"), None
        beta = None if init_args.get("beta") is None else float(init_args["beta"])
        policy = _short(policy_spec.get("class_path") if isinstance(policy_spec, dict) else policy_spec, DEFAULT_POLICY)
        operator = _short(
            operator_spec.get("class_path") if isinstance(operator_spec, dict) else operator_spec, DEFAULT_OPERATOR
        )
    return {
        "name": path.stem,
        "kind": kind,
        "base_model": base_model,
        "beta": beta,
        "betas": betas or None,
        "policy": policy,
        "operator": operator,
        "reproduces": _reproduces(text),
        "path": str(path),
    }


def _number(value: float) -> str:
    return f"{value:g}"


def table(infos: list[dict]) -> str:
    """The ``rfkit recipes list`` table: aligned columns, the free-text ``reproduces`` last."""
    header = ("name", "kind", "base model", "beta", "operator", "reproduces")
    rows = [header]
    for info in infos:
        if info["beta"] is not None:
            beta = _number(info["beta"])
        elif info["betas"]:
            beta = ",".join(_number(b) for b in info["betas"])
        else:
            beta = "-"
        rows.append(
            (info["name"], info["kind"], info["base_model"] or "-", beta, info["operator"], info["reproduces"] or "-")
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in rows)


USAGE = "list | show NAME | cp NAME DEST [--force]"
_SYNOPSIS = {"show": ["NAME"], "cp": ["NAME", "DEST"]}


class _Parser(OneLineParser):
    """:class:`~rfkit.config.args.OneLineParser` raising :class:`CatalogError`, with the
    messages of ``rfkit recipes`` (its command names and usage)."""

    error_class = CatalogError

    def explain(self, message):
        command = self.prog.split()[-1]  # "recipes", or the subcommand: "list", "show", "cp"
        if command == "recipes" and "required" in message:
            return f"give a command: {USAGE}"
        if "invalid choice" in message:
            found = re.search(r"invalid choice: '([^']*)'", message)
            return f"command: '{found.group(1) if found else '?'}' is not one of list, show, cp"
        if "required" in message:
            example = "smollm2_b05 my_recipe.yaml" if command == "cp" else "smollm2_b05"
            return f"{command}: needs {' and '.join(_SYNOPSIS[command])}, like: rfkit recipes {command} {example}"
        if message.startswith("unrecognized arguments:"):
            extra = message.split(":", 1)[1].strip()
            return f"unrecognized argument(s) '{extra}'; usage: rfkit recipes {USAGE}"
        return super().explain(message)


def build_parser() -> _Parser:
    parser = _Parser(prog="rfkit recipes", description="The recipes packaged with rfkit.")
    commands = parser.add_subparsers(dest="command", metavar="list|show|cp", required=True)
    commands.add_parser("list", help="name, kind, base model, beta, operator and what each recipe reproduces")
    show = commands.add_parser("show", help="print a recipe's YAML")
    show.add_argument("name", metavar="NAME", help="a recipe name such as smollm2_b05")
    cp = commands.add_parser("cp", help="copy a recipe to edit")
    cp.add_argument("name", metavar="NAME", help="a recipe name such as smollm2_b05")
    cp.add_argument("dest", metavar="DEST", help="a file, or a directory (DEST/NAME.yaml is written)")
    cp.add_argument("--force", action="store_true", help="overwrite an existing DEST")
    return parser


def copy_recipe(name: str, dest: str, force: bool = False) -> Path:
    """Write recipe ``name`` to ``dest`` atomically (``dest/NAME.yaml`` when ``dest`` is a
    directory or ends with ``/``); an existing file is kept unless ``force``."""
    source = recipe_path(name)
    target = Path(dest).expanduser()
    if target.is_dir() or str(dest).endswith(("/", "\\")):
        target = target / source.name
    if target.is_dir():
        raise CatalogError(f"DEST: '{target}' is a directory; give a file name or another directory")
    if target.exists() and not force:
        raise CatalogError(f"DEST: '{target}' already exists; add --force to overwrite it")
    try:
        atomic_write_text(target, source.read_text())
    except OSError as err:
        raise CatalogError(f"DEST: cannot write '{target}': {err.strerror or err}") from None
    return target


def main(argv: list[str]) -> int:
    """``rfkit recipes list | show NAME | cp NAME DEST [--force]``; returns the exit code:
    0, or 1 when stdout was closed early (a pipe into head). Bad input raises
    :class:`CatalogError` for :mod:`rfkit.cli` to print (exit code 2)."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "list":
            print(table([describe(name) for name in recipe_names()]))
            print("\nfit:        rfkit fit --config NAME   (also validate, test, profile, convert, sweep; --model of bench and eval)")
            print("eval mqar:  rfkit eval mqar --config NAME")
        elif args.command == "show":
            text = recipe_path(args.name).read_text()
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        else:
            target = copy_recipe(args.name, args.dest, args.force)
            command = "rfkit eval mqar" if _bare(args.name).startswith(EVAL_MQAR_PREFIX) else "rfkit fit"
            print(f"{_bare(args.name)} -> {target}  (edit it, then: {command} --config {target})")
    except BrokenPipeError:  # `rfkit recipes show NAME | head`: the reader left, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit goes nowhere
        return 1
    return 0
