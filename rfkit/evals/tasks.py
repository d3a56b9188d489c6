"""``rfkit eval TASK ...`` and ``rfkit data NAME ...``: the task tables and their dispatch.

Unknown tasks, bad values and missing optional packages raise one-line errors that
:mod:`rfkit.cli` prints (exit code 2), before any model loads.
"""

from __future__ import annotations

import difflib
import importlib
import shlex

from rfkit.evals.common import EvalError, EvalParser

# task name -> module; each module has add_arguments(parser), validate(args), run(args) -> int,
# or main(argv) -> int when it parses its own arguments (mqar reads a jsonargparse recipe)
EVAL_TASKS = {
    "hashhop": "rfkit.evals.hashhop",
    "passkey": "rfkit.evals.passkey",
    "context": "rfkit.evals.context",
    "needles": "rfkit.evals.needles",
    "ppl": "rfkit.evals.ppl",
    "mqar": "rfkit.experiments.mqar",
    "lm-eval": "rfkit.evals.lm_eval",
}
# data generator name -> module; each has add_data_arguments(parser), validate_data(args), run_data(args) -> int
DATA_GENERATORS = {"hashhop": "rfkit.evals.hashhop_samples"}


def _pick(kind: str, name: str | None, table: dict[str, str]) -> str:
    allowed = ", ".join(table)
    if name is None or name.startswith("-"):
        raise EvalError(f"name a task first; allowed: {allowed}")
    if name not in table:
        near = difflib.get_close_matches(name, list(table), n=2, cutoff=0.5)
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        raise EvalError(f"unknown {kind} task '{name}'{hint}; allowed: {allowed}")
    return table[name]


def _usage(kind: str, table: dict[str, str]) -> str:
    lines = [f"usage: rfkit {kind} {{{','.join(table)}}} [options]   (rfkit {kind} NAME --help for each)", ""]
    for name, path in table.items():
        doc = (importlib.import_module(path).__doc__ or "").strip().splitlines()
        lines.append(f"  {name:<8}  {doc[0] if doc else ''}")
    return "\n".join(lines)


def run_eval(argv: list[str]) -> int:
    """``rfkit eval NAME ...``; returns the exit code."""
    if argv[:1] in (["-h"], ["--help"]):
        print(_usage("eval", EVAL_TASKS))
        return 0
    name = argv[0] if argv else None
    module = importlib.import_module(_pick("eval", name, EVAL_TASKS))
    if hasattr(module, "main"):
        return module.main(argv[1:])
    parser = EvalParser(prog=f"rfkit eval {name}", description=(module.__doc__ or "").strip().splitlines()[0])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.command_line = "rfkit eval " + shlex.join(argv)  # what the model card credits
    module.validate(args)
    return module.run(args)


def run_data(argv: list[str]) -> int:
    """``rfkit data NAME ...``; returns the exit code."""
    if argv[:1] in (["-h"], ["--help"]):
        print(_usage("data", DATA_GENERATORS))
        return 0
    name = argv[0] if argv else None
    module = importlib.import_module(_pick("data", name, DATA_GENERATORS))
    parser = EvalParser(prog=f"rfkit data {name}", description=(module.__doc__ or "").strip().splitlines()[0])
    module.add_data_arguments(parser)
    args = parser.parse_args(argv[1:])
    module.validate_data(args)
    return module.run_data(args)
