"""The package layout: no import circles, lower layers never import upper ones, modules stay small.

Imports inside functions count too: a lazy import is still a dependency, and a circle hidden in
a function body is a circle all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the public aliases (recipes, plugins and saved models name them) re-export from the layers below
ALIASES = {"rfkit", "rfkit.policies", "rfkit.operators", "rfkit.__main__"}
# each package may import only from the packages at its own or a lower rank
RANK = {
    "rfkit.errors": 0, "rfkit.atomic": 0, "rfkit.provenance": 0, "rfkit.hub": 0, "rfkit.validate": 0, "rfkit.version": 0, "rfkit.plots": 0,
    "rfkit.output": 0, "rfkit.classpath": 0, "rfkit.devices": 0,
    "rfkit.ops": 1,
    "rfkit.models": 2,
    "rfkit.conversion": 3,
    "rfkit.data": 4, "rfkit.training": 4, "rfkit.callbacks": 4,
    "rfkit.pipeline": 4,  # the named steps that fit (the LightningModule), convert and profile all run
    # the perplexity evaluation that rfkit fit's callbacks run and the eval commands share: it needs
    # only rfkit.training and below, so it ranks with the callbacks, not with the rest of rfkit.evals
    "rfkit.evals.perplexity": 4,
    "rfkit.config": 5,
    "rfkit.evals": 6, "rfkit.experiments": 6,
    "rfkit.cli": 7,
}  # fmt: skip
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for base, package in ((ROOT / "rfkit", "rfkit"), (ROOT / "callbacks", "rfkit.callbacks")):
        for path in base.rglob("*.py"):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The rfkit modules ``name`` imports (``from pkg import mod`` resolved to the module)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("rfkit")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("rfkit"):
                continue
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, set(modules)) for name, path in modules.items()}


def _package(module: str) -> str | None:
    for prefix in sorted(RANK, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return None


def test_every_module_belongs_to_a_ranked_package():
    unplaced = [m for m in _graph() if m not in ALIASES and _package(m) is None]
    assert not unplaced, f"add these modules' package to RANK in tests/test_layout.py: {unplaced}"


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            circle = visit(node)
            assert circle is None, "import circle: " + " -> ".join(circle)


def test_lower_layers_do_not_import_upper_ones():
    wrong = []
    for module, deps in _graph().items():
        if module in ALIASES:
            continue
        for dep in deps:
            if dep in ALIASES and dep != "rfkit":
                wrong.append(f"{module} imports the public alias {dep}; import the implementation")
            elif dep not in ALIASES and RANK[_package(dep)] > RANK[_package(module)]:
                wrong.append(f"{module} ({_package(module)}) imports {dep} ({_package(dep)})")
    assert not wrong, "\n".join(wrong)


def test_a_module_ranked_below_its_package_loads_nothing_above_it():
    """Importing ``rfkit.evals.perplexity`` runs ``rfkit/evals/__init__.py`` first: a module that
    RANK places below its package needs package ``__init__`` files that import nothing ranked above
    it, or importing it would load the upper layer after all."""
    graph = _graph()
    wrong = []
    for module in RANK:
        parent = module.rpartition(".")[0]
        while parent and parent not in ALIASES:
            if parent in graph:
                wrong += [
                    f"{parent} (run when {module} is imported) imports {dep}"
                    for dep in sorted(graph[parent])
                    if dep not in ALIASES and RANK[_package(dep)] > RANK[module]
                ]
            parent = parent.rpartition(".")[0]
    assert not wrong, "\n".join(wrong)


def test_long_modules_say_why_at_the_top():
    long = []
    for name, path in _modules().items():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and "One module because" not in doc:
            long.append(f"{name}: {lines} lines")
    assert not long, f"split these or say at the top 'One module because ...': {long}"
