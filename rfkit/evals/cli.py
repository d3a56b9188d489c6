"""``rfkit eval TASK ...`` and ``rfkit data NAME ...``: dispatch to the task modules.

Unknown tasks, bad values and missing optional packages are one line on stderr and exit code
2, before any model loads.
"""

from __future__ import annotations

import difflib
import importlib
import sys

from rfkit.errors import RFKitError
from rfkit.evals.common import EvalError, EvalParser

# task name -> module; each module has add_arguments(parser), validate(args), run(args) -> int,
# or main(argv) -> int when it parses its own arguments (mqar reads a jsonargparse recipe)
EVAL_TASKS = {
    "hashhop": "rfkit.evals.hashhop",
    "passkey": "rfkit.evals.passkey",
    "ppl": "rfkit.evals.ppl",
    "mqar": "rfkit.evals.mqar",
    "lm-eval": "rfkit.evals.lm_eval",
}
# data generator name -> module; each has add_data_arguments(parser), validate_data(args), run_data(args) -> int
DATA_GENERATORS = {"hashhop": "rfkit.evals.hashhop"}


def _pick(kind: str, name: str | None, table: dict[str, str]) -> str:
    allowed = ", ".join(table)
    if name is None or name.startswith("-"):
        raise EvalError(f"rfkit {kind}: name a task first; allowed: {allowed}")
    if name not in table:
        near = difflib.get_close_matches(name, list(table), n=2, cutoff=0.5)
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        raise EvalError(f"unknown {kind} task '{name}'{hint}; allowed: {allowed}")
    return table[name]


def dispatch(kind: str, argv: list[str]) -> int:
    """Run ``rfkit eval|data NAME ...``; returns the exit code (2 with one line on bad input)."""
    table = EVAL_TASKS if kind == "eval" else DATA_GENERATORS
    prefix = f"rfkit {kind}"
    try:
        if argv[:1] in (["-h"], ["--help"]):
            print(f"usage: {prefix} {{{','.join(table)}}} [options]   ({prefix} NAME --help for each)")
            return 0
        name = argv[0] if argv else None
        module = importlib.import_module(_pick(kind, name, table))
        parser = EvalParser(prog=f"{prefix} {name}", description=(module.__doc__ or "").strip().splitlines()[0])
        if kind == "eval" and hasattr(module, "main"):
            return module.main(argv[1:])
        if kind == "eval":
            module.add_arguments(parser)
            args = parser.parse_args(argv[1:])
            module.validate(args)
            return module.run(args)
        module.add_data_arguments(parser)
        args = parser.parse_args(argv[1:])
        module.validate_data(args)
        return module.run_data(args)
    except (RFKitError, ValueError) as err:
        from rfkit.cli import one_line, user_error

        found = err if isinstance(err, RFKitError) else user_error(err)
        if found is None:
            raise
        sys.stderr.write(f"{prefix}: error: {one_line(found)}\n")
        return 2
