"""Self-contained model folders: the code a converted model needs, written beside its weights.

A saved converted model names its classes by ``model_type`` (``rf_llama``, ...), which transformers
knows only after ``import rfkit``. To load without rfkit, the folder carries its own code, as Hub
custom code does: :func:`write_remote_code` generates, at save time, from rfkit's own modules (one
source, never a hand-kept copy):

- ``configuration_rfkit.py`` (:mod:`rfkit.models.configuration`) and ``modeling_rfkit.py``
  (:mod:`rfkit.models.modeling`);
- every rfkit module they import, directly or inside functions (the operators, the mixers, the
  cache, the scans, the precision policy, the small utilities they use), as ``rfkit_<name>.py``,
  with ``from rfkit.x.y import z`` rewritten to ``from .rfkit_y import z``;
- in place of the compiled CPU kernels (``rfkit.ops.cpu_kernels``, C sources built on first use), a
  module whose ``available()`` is False, so the pure-PyTorch paths run;

and ``auto_map`` entries in ``config.json``. ``AutoConfig``, ``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`` then work with torch, transformers
and safetensors alone. Every generated file names the rfkit version it came from and the
transformers versions it supports; ``modeling_rfkit.py`` warns when the installed transformers is
outside them. With rfkit installed, ``from_pretrained(folder)`` without ``trust_remote_code`` keeps
using rfkit's registered classes.

A model whose operator is a plugin's (not one of ``rfkit.operators``) needs the plugin to load;
:func:`exportable` says so, and saving leaves its folder without generated code.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from rfkit.errors import RFKitError

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the rfkit package directory
#: the modules the folder's auto_map names, and the files they become
ENTRY_FILES = {"rfkit.models.configuration": "configuration_rfkit", "rfkit.models.modeling": "modeling_rfkit"}
#: modules replaced by a generated stand-in instead of being copied
STANDINS = {"rfkit.ops.cpu_kernels"}
#: the model types of converted models (:mod:`rfkit.models.configuration`)
MODEL_TYPES = ("rf_llama", "rf_mistral", "rf_qwen2")
DEFAULT_TRANSFORMERS = ">=5.0,<6"


class ExportError(RFKitError):
    """A model folder that cannot be made self-contained; one line for the user."""


def module_path(module: str) -> Path:
    """The source file of rfkit module ``module`` (a package's ``__init__.py``)."""
    parts = module.split(".")[1:]
    path = PACKAGE_ROOT.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def is_module(module: str) -> bool:
    return module_path(module).is_file()


def file_name(module: str) -> str:
    """The generated file (without ``.py``) of rfkit module ``module``."""
    return ENTRY_FILES.get(module) or "rfkit_" + module.rsplit(".", 1)[-1]


def _rfkit_imports(tree: ast.AST) -> list[ast.ImportFrom | ast.Import]:
    return [
        node for node in ast.walk(tree)
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rfkit")
        or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "rfkit" for a in node.names))
    ]  # fmt: skip


def _targets(node: ast.ImportFrom) -> list[str]:
    """The rfkit modules a ``from rfkit... import ...`` reads: the module itself, or the modules
    its names are (``from rfkit.ops import cpu_kernels``)."""
    named = [f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}")]
    if named and len(named) != len(node.names):
        raise ExportError(f"export: '{node.module}' imports modules and names in one statement; split it")
    return named or [node.module]


def module_closure() -> list[str]:
    """Every rfkit module the entry modules need, in a stable order (stand-ins included, not read)."""
    seen, order, todo = set(), [], list(ENTRY_FILES)
    while todo:
        module = todo.pop(0)
        if module in seen:
            continue
        seen.add(module)
        order.append(module)
        if module in STANDINS:
            continue
        tree = ast.parse(module_path(module).read_text())
        for node in _rfkit_imports(tree):
            if isinstance(node, ast.Import):
                raise ExportError(f"export: {module} uses 'import rfkit...'; import names with 'from rfkit... import'")
            todo += [t for t in _targets(node) if t != "rfkit"]
    if len({file_name(m) for m in order}) != len(order):
        raise ExportError("export: two rfkit modules would share a generated file name")
    return order


def rewrite(source: str, module: str) -> str:
    """``source`` with every rfkit import made relative to the generated files."""
    lines = source.split("\n")
    edits = []
    for node in _rfkit_imports(ast.parse(source)):
        indent = lines[node.lineno - 1][: len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
        names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
        targets = _targets(node)
        if targets == [node.module]:
            new = [f"{indent}from .{file_name(node.module)} import {names}"]
        else:  # `from rfkit.ops import cpu_kernels`: the module itself, under its own name
            new = []
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                # the first line is what transformers reads to copy the file along; the second binds it
                new += [f"{indent}from .{file_name(target)} import __name__ as _{file_name(target)}_name  # noqa: F401",
                        f"{indent}from . import {file_name(target)} as {alias.asname or alias.name}"]  # fmt: skip
        edits.append((node.lineno, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1 : end] = new
    return "\n".join(lines)


def transformers_range() -> str:
    """The transformers versions this rfkit supports, as its package metadata states them."""
    try:
        from importlib.metadata import requires

        from packaging.requirements import Requirement

        for text in requires("rfkit") or []:
            requirement = Requirement(text)
            if requirement.name == "transformers" and not requirement.marker and requirement.specifier:
                parts = sorted(str(s) for s in requirement.specifier)
                return ",".join(sorted(parts, key=lambda p: not p.startswith(">")))  # lower bound first
    except Exception:  # noqa: BLE001 - metadata missing (a source tree without install): the pinned default
        pass
    return DEFAULT_TRANSFORMERS


def _header(module: str, version: str, supported: str) -> str:
    source = module_path(module).relative_to(PACKAGE_ROOT.parent) if module not in STANDINS else f"{module} (a stand-in)"
    return (
        f"# Generated by rfkit {version} from {source} when this model was saved; do not edit.\n"
        f"# Loads the model without rfkit: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).\n"
        f"# Supports transformers {supported}.\n"
    )


def _standin(module: str) -> str:
    """A module standing in for the compiled CPU kernels: never available, so never called."""
    real = ast.parse(module_path(module).read_text())
    names = sorted(n.name for n in real.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))
    out = [
        '"""The compiled CPU kernels are not part of an exported model: the pure-PyTorch paths run."""',
        "",
        "",
        "def available() -> bool:",
        "    return False",
        "",
        "",
        "def unavailable_reason() -> str:",
        '    return "the compiled CPU kernels are not shipped with an exported model"',
    ]
    for name in names:
        if name not in ("available", "unavailable_reason"):
            out += ["", "", f"def {name}(*args, **kwargs):",
                    f'    raise RuntimeError("{name}: the compiled CPU kernels are not shipped with an exported model")']  # fmt: skip
    return "\n".join(out) + "\n"


def _version_check(supported: str, version: str) -> str:
    return f'''

# -- the transformers versions this code was written for (added by rfkit's export) ------------
RFKIT_VERSION = "{version}"
SUPPORTED_TRANSFORMERS = "{supported}"


def _check_transformers() -> None:
    import warnings

    import transformers
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(transformers.__version__) not in SpecifierSet(SUPPORTED_TRANSFORMERS):
        warnings.warn(
            f"this model's code (rfkit {{RFKIT_VERSION}}) supports transformers {{SUPPORTED_TRANSFORMERS}}, "
            f"not the installed {{transformers.__version__}}; it may fail to load or compute wrongly",
            stacklevel=2,
        )


_check_transformers()
'''


#: the last :func:`generated_files` of this process and the source stamp it was made from
_GENERATED: dict = {}


def _source_stamp() -> tuple:
    """Every rfkit source file's path, modification time and size (a few ms to take)."""
    stats = ((str(p), p.stat()) for p in sorted(PACKAGE_ROOT.rglob("*.py")))
    return tuple((path, st.st_mtime_ns, st.st_size) for path, st in stats)


def generated_files() -> dict[str, str]:
    """``{file name: text}`` of the code a self-contained folder carries. Made once per process
    while rfkit's sources stay as they are (parsing and rewriting them takes ~0.4 s on a 2-core
    CPU, and a sweep or a test run saves many folders)."""
    stamp = _source_stamp()
    if _GENERATED.get("stamp") != stamp:
        _GENERATED.update(stamp=stamp, files=_generate())
    return dict(_GENERATED["files"])


def _generate() -> dict[str, str]:
    from rfkit.version import __version__

    supported = transformers_range()
    files = {}
    for module in module_closure():
        if module in STANDINS:
            text = _standin(module)
        else:
            text = rewrite(module_path(module).read_text(), module)
        if module == "rfkit.models.modeling":
            text = text.rstrip("\n") + "\n" + _version_check(supported, __version__)
        files[file_name(module) + ".py"] = _header(module, __version__, supported) + text
    return files


def auto_map(model_type: str) -> dict[str, str]:
    """The ``auto_map`` entries of a converted model's ``config.json``: the classes rfkit registers
    for ``model_type``, named in the generated files."""
    from rfkit.models.modeling import _FAMILIES

    classes = {config.model_type: (config.__name__, model.__name__) for config, model in _FAMILIES.values()}
    if model_type not in classes:
        raise ExportError(f"export: model_type '{model_type}' is not a converted model; allowed: {', '.join(classes)}")
    config_cls, model_cls = classes[model_type]
    return {
        "AutoConfig": f"{ENTRY_FILES['rfkit.models.configuration']}.{config_cls}",
        "AutoModelForCausalLM": f"{ENTRY_FILES['rfkit.models.modeling']}.{model_cls}",
    }


def exportable(config: dict) -> str | None:
    """None when a model of ``config.json`` (a dict) can carry its own code, else why not."""
    if config.get("model_type") not in MODEL_TYPES:
        return f"model_type '{config.get('model_type')}' is not a converted model"
    operator = (config.get("rf_operator") or {}).get("class_path", "")
    from rfkit.classpath import public_path

    if operator and not public_path(operator).startswith("rfkit.operators."):
        return f"its operator {operator} is a plugin's: loading it needs the plugin installed"
    return None


def write_remote_code(directory: str | Path, files: dict[str, str] | None = None) -> list[str]:
    """Write the generated code (``files``, default :func:`generated_files`) into model folder
    ``directory`` and its ``auto_map`` into the folder's ``config.json`` (written whole, then
    renamed). Returns the files written."""
    from rfkit.atomic import atomic_write_text

    directory = Path(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    reason = exportable(config)
    if reason:
        raise ExportError(f"export: '{directory}' cannot carry its own code: {reason}")
    written = []
    for name, text in (files or generated_files()).items():
        atomic_write_text(directory / name, text)
        written.append(name)
    config["auto_map"] = auto_map(config["model_type"])
    atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written
