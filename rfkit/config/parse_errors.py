"""jsonargparse's parse errors as one line that names the recipe field and what is allowed.

``rfkit.config.lightning_cli.RFArgumentParser.error`` calls :func:`tidy_parse_error`. Keys of a subclass's
``init_args`` come from jsonargparse without their section (``seq_len``), so the command line
being parsed (:data:`PARSE_ARGS`, set by ``rfkit.cli.main``) and the recipe files it names are
searched for the full field (``data.seq_len``).
"""

from __future__ import annotations

import re
from pathlib import Path

from rfkit.errors import one_line

_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PROBLEM = re.compile(r"Problem with given class_path '([^']+)': (.*?)(?: - Expected| Given value|$)")
_NOT_SUBCLASS = re.compile(r"Import path (\S+) does not correspond to a subclass of (\w+)")
_EXPECTED_CLASS = re.compile(r"Expected a <class '([\w.]+)'>")
_EXPECTED_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*?)\](?=\s*(?:\.|-|$|Got|Given))")
_GOT = re.compile(r"(?:Got|Given) value: (.*?)(?: - |$)")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "list": "a list",
    "tuple": "a list",
    "dict": "a mapping",
    "NoneType": "null",
}
#: the class behind a section when neither the command line nor the recipe names one
_DEFAULT_CLASSES = {
    "model": "rfkit.training.module.RecurFormerModule",
    "data": "rfkit.data.TextDataModule",
    "trainer": "lightning.pytorch.Trainer",
    "model.policy": "rfkit.conversion.policies.RecencyRatioPolicy",
    "model.operator": "rfkit.models.operators.MambaOperator",
    "model.transfer": "rfkit.training.transfer.TransferConfig",
    "model.distill": "rfkit.training.distill.DistillConfig",
    "model.lora": "rfkit.models.lora.LoraSettings",
    "state_audit": "rfkit.callbacks.StateAudit",
    "perplexity": "rfkit.callbacks.PerplexityMonitor",
    "cache": "rfkit.callbacks.CacheMonitor",
    "summary": "rfkit.callbacks.RunSummary",
    "checkpoint": "rfkit.training.checkpointing.RunCheckpoint",
}
#: the command line being parsed (set by :func:`main`), so that a parse error about a short key
#: (``seq_len`` of a subclass's init_args) can name the full field (``data.seq_len``)
PARSE_ARGS: list[str] = []


def _clean_field(name: str) -> str:
    """``model.policy.init_args.alpha`` -> ``model.policy.alpha`` (the recipe's field names)."""
    return ".".join(part for part in name.strip("-").split(".") if part != "init_args")


def _config_files(argv: list[str]) -> list[str]:
    files = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _recipes(argv: list[str]) -> list:
    """The recipes named by ``--config`` in ``argv``, parsed (unreadable ones skipped)."""
    import yaml

    out = []
    for path in _config_files(argv):
        try:
            out.append(yaml.safe_load(Path(path).read_text()))
        except (OSError, ValueError, yaml.YAMLError):
            continue
    return out


def _key_paths(tree, key: str, prefix: tuple = ()) -> list[tuple]:
    """Every path in a parsed recipe that ends in ``key``."""
    found = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            path = (*prefix, str(k))
            if k == key and prefix:
                found.append(path)
            found += _key_paths(v, key, path)
    return found


def _full_field(key: str, value: str | None = None, argv: list[str] | None = None) -> str:
    """The recipe field a jsonargparse key means: keys of a subclass's init_args come without
    their section (``seq_len``), so the section is looked up on the command line, then in the
    recipe files."""
    argv = PARSE_ARGS if argv is None else argv
    if "." in key:
        return _clean_field(key)
    options = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, inline = arg[2:].partition("=")
        if "." in name and name.rsplit(".", 1)[1] == key:
            options.append((name, inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)))
    if options:
        matching = [name for name, given in options if value is not None and given is not None and str(given).strip() == value]
        return _clean_field((matching or [options[-1][0]])[-1])
    for recipe in _recipes(argv):
        paths = _key_paths(recipe, key)
        # only a subclass's init_args (and data:, a subclass section without class_path) give short keys
        preferred = [p for p in paths if "init_args" in p or p[0] == "data"] or paths
        if preferred:
            return _clean_field(".".join(preferred[0]))
    return key


def _class_of(section: str, argv: list[str]):
    """The class a recipe section builds: its class_path on the command line or in the recipe,
    else rfkit's default for it; None when it cannot be imported."""
    import importlib

    import yaml

    path = None
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name in (f"--{section}.class_path", f"--{section}"):
            given = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                parsed = yaml.safe_load(given)
            except yaml.YAMLError:
                parsed = given
            path = parsed.get("class_path") if isinstance(parsed, dict) else parsed
    if path is None:
        for recipe in _recipes(argv):
            node = recipe
            for part in section.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict) and isinstance(node.get("class_path"), str):
                path = node["class_path"]
    path = path if isinstance(path, str) else _DEFAULT_CLASSES.get(section)
    if not path:
        return None
    candidates = [path] if "." in path else [f"rfkit.conversion.policies.{path}", f"rfkit.models.operators.{path}", f"rfkit.data.{path}"]
    for candidate in candidates:
        module, _, name = candidate.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            continue
    return None


def _unknown_option(option: str, argv: list[str]) -> str:
    """``<field>: unknown option; <Class> takes: ...`` for an option nothing accepts."""
    import difflib
    import inspect

    field = _clean_field(option)
    section, _, name = field.rpartition(".")
    if not section:
        return f"{field}: unknown option; see `rfkit <command> --help` for the sections a recipe has"
    cls = _class_of(section, argv)
    if cls is None:
        return f"{field}: unknown option"
    try:
        params = [p for p, spec in inspect.signature(cls.__init__).parameters.items()
                  if p != "self" and spec.kind not in (spec.VAR_POSITIONAL, spec.VAR_KEYWORD)]  # fmt: skip
    except (TypeError, ValueError):
        return f"{field}: unknown option"
    near = difflib.get_close_matches(name, params, n=1, cutoff=0.6)
    hint = f" (nearest: {near[0]})" if near else ""
    return f"{field}: unknown option{hint}; {section} ({cls.__name__}) takes: {', '.join(params)}"


def _expected(text: str) -> tuple[list[str], list[str]]:
    """(allowed literal values, type words) from jsonargparse's 'Expected a ...' lines."""
    import ast

    literals: list[str] = []
    for body in _EXPECTED_LITERAL.findall(text):
        try:
            values = ast.literal_eval(f"[{body}]")
        except (ValueError, SyntaxError):
            values = [v.strip() for v in body.split(",")]
        literals += [str(v) for v in values if str(v) not in literals]
    words = []
    for name in _EXPECTED_CLASS.findall(text):
        word = _TYPE_WORDS.get(name.rsplit(".", 1)[-1], name)
        if word not in words:
            words.append(word)
    return literals, words


def _quoted(value: str) -> str:
    return value if value[:1] in "[{" else repr(value)


def _yaml_problem(argv: list[str]) -> str | None:
    """``--config: cannot read 'R.yaml' as YAML: <problem> (line L, column C)`` for the first
    recipe file in ``argv`` that is not valid YAML."""
    import yaml

    for path in _config_files(argv):
        try:
            yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or one_line(err)
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            return f"--config: cannot read '{path}' as YAML: {one_line(problem)}{where}"
        except (OSError, ValueError):
            continue
    return None


def tidy_parse_error(message) -> str:
    """jsonargparse's messages, shortened to one line that names the field and what is allowed."""
    text = one_line(message)
    argv = list(PARSE_ARGS)
    key = _KEY.search(text)
    got = _GOT.search(text)
    value = got.group(1).strip() if got else None
    field = _full_field(key.group(1), value, argv) if key else None
    for pattern, fmt in (
        (_CLASS_PROBLEM, "class '{0}' cannot be used: {1}"),
        (_NOT_SUBCLASS, "'{0}' is not a subclass of {1}"),
    ):
        found = pattern.search(text)
        if found:
            detail = fmt.format(*found.groups())
            return f"{field}: {detail}" if field else detail
    if key:
        literals, words = _expected(text)
        if literals and value is not None:
            allowed = literals + [w for w in words if w not in ("null",)] + (["null"] if "null" in words else [])
            return f"{field}: {_quoted(value)} is not allowed; allowed: {', '.join(allowed)}"
        if words and value is not None:
            return f"{field}: expected {' or '.join(words)}, got {_quoted(value)}"
        rest = text[key.end() :].lstrip(": ")
        return f"{field}: {rest}"
    unknown = _UNRECOGNIZED.search(text)
    if unknown:
        option = next((part for part in unknown.group(1).split() if part.startswith("--")), None)
        if option:
            return _unknown_option(option.split("=", 1)[0], argv)
    rejected = _NOT_ACCEPTED.search(text)
    if rejected:
        name = rejected.group(1)
        for arg in argv:
            option = arg.split("=", 1)[0]
            if option.startswith("--") and option.rsplit(".", 1)[-1] == name and "." in option:
                return _unknown_option(option, argv)
        for recipe in _recipes(argv):
            paths = _key_paths(recipe, name)
            if paths:
                return _unknown_option(".".join(paths[0]), argv)
        return f"{name}: unknown option"
    if text.startswith("Problems parsing config"):
        return _yaml_problem(argv) or text
    if text.startswith("Unexpected config"):
        for path in _config_files(argv):
            recipe = next(iter(_recipes(["--config", path])), {})
            if not isinstance(recipe, dict):
                return (
                    f"--config: '{path}' holds a YAML {type(recipe).__name__}, not a recipe; "
                    "a recipe is a mapping with model:, data: and trainer: sections (rfkit recipes show smollm2_b05)"
                )
    return text
