"""``rfkit``: one table from command name to the function that runs it, and one error path.

Every command is a function ``run(argv) -> exit code``, found in :data:`COMMANDS`. A user error
(an :class:`~rfkit.errors.RFKitError` raised anywhere below, or a few errors of Lightning's and
the OS's that mean the same) is printed here, and only here, as one line
``rfkit[ COMMAND]: error: <what is wrong>`` with exit code 2 (1 for a run that failed, such as a
diverged loss). ``rfkit --help`` lists the table.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points

from rfkit.errors import ParseError, RFKitError, one_line
from rfkit.output import configure_output

PLUGIN_GROUP = "rfkit.plugins"


@dataclass(frozen=True)
class Command:
    """One ``rfkit`` command: ``target`` is ``"module:function"``; the function takes the
    arguments after the command name (all of argv, command included, when ``lightning``)."""

    target: str
    usage: str
    summary: str
    lightning: bool = False
    plugins: bool = True  # import the rfkit.plugins entry points first (recipes may name them)

    def load(self):
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


_LIGHTNING = "rfkit.config.lightning_cli:run"
COMMANDS: dict[str, Command] = {
    "fit": Command(_LIGHTNING, "--config RECIPE", "profile, select, replace, train, measure and save", lightning=True),
    "validate": Command(_LIGHTNING, "--config RECIPE", "convert and validate (--ckpt_path for a trained run)", lightning=True),
    "test": Command(_LIGHTNING, "--config RECIPE", "convert and test (--ckpt_path for a trained run)", lightning=True),
    "profile": Command(_LIGHTNING, "--config RECIPE --output FILE", "score every head and write the head map", lightning=True),
    "convert": Command(_LIGHTNING, "--config RECIPE --output DIR", "replace heads, run attention transfer, save (no training)", lightning=True),
    "bench": Command("rfkit.experiments.bench:main", "cache|speed --model DIR|RECIPE", "cache bytes and tokens/s, original vs converted"),
    "eval": Command("rfkit.evals.tasks:run_eval", "TASK --model DIR|RECIPE", "hashhop, passkey, context, needles, ppl, mqar, lm-eval"),
    "data": Command("rfkit.evals.tasks:run_data", "hashhop --n N --out FILE", "write evaluation or fine-tuning samples"),
    "sweep": Command("rfkit.experiments.sweep:main", "--config RECIPE --betas 0,0.5,1", "quality against cache, one row per beta and operator"),
    "export": Command("rfkit.config.sharing:main", "--model DIR --output DIR", "a saved model, made loadable without rfkit", plugins=False),
    "recipes": Command("rfkit.config.catalog:main", "list | show NAME | cp NAME DEST", "the recipes packaged with rfkit", plugins=False),
}


def help_text() -> str:
    """What ``rfkit --help`` prints: one line per command."""
    from rfkit.version import __version__

    width = max(len(name) for name in COMMANDS)
    usage_width = max(len(c.usage) for c in COMMANDS.values())
    lines = [
        f"rfkit {__version__}: convert a pretrained transformer into a RecurFormer hybrid",
        "",
        "usage: rfkit [--verbose] COMMAND [options]   (rfkit COMMAND --help for its options)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {c.usage:<{usage_width}}  {c.summary}" for name, c in COMMANDS.items()]
    lines += [
        "",
        "A RECIPE is a YAML file or a packaged recipe's name (rfkit recipes list); every Lightning",
        "override works (--trainer.max_steps 10). Bad input: one line on stderr, exit code 2.",
        "--verbose (or RFKIT_VERBOSE=1) also shows other libraries' info lines and deprecation warnings.",
    ]
    return "\n".join(lines)


def load_plugins() -> None:
    """Import every module registered under the ``rfkit.plugins`` entry-point group, so that
    their policies and operators can be named by short class name in recipes."""
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()
        except Exception as err:  # a broken plugin is the user's to fix: name it
            dist = getattr(ep.dist, "name", "?")
            raise RFKitError(f"plugin '{ep.name}' from package '{dist}' failed to import: {one_line(err)}") from None


def user_error(err: BaseException) -> RFKitError | None:
    """The RFKitError behind ``err`` (jsonargparse and Lightning wrap errors raised in
    ``__init__`` and hooks), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, RFKitError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def describe_error(err: BaseException, argv: list[str]) -> tuple[str, int] | None:
    """``(one line, exit code)`` when ``err`` is the user's to fix; None for a bug (re-raised)."""
    from rfkit.atomic import disk_full_error, is_disk_full

    found = user_error(err)
    if found is not None:
        return one_line(found), getattr(found, "exit_code", 2)  # 2: bad input; 1: a run that failed
    if isinstance(err, OSError) and is_disk_full(err):  # a full disk outside rfkit.atomic's writers
        return one_line(disk_full_error(err.filename or "the output")), 2
    if type(err).__name__ == "MisconfigurationException":  # Lightning's word on a trainer setting
        return f"trainer: {one_line(err)}", 2
    if _raised_in(err, "_parse_ckpt_path"):  # LightningCLI reads --ckpt_path before any rfkit check
        return _unreadable_checkpoint(argv, err), 2
    return None


def main(args: list[str] | None = None) -> None:
    """The ``rfkit`` console script: look the command up in :data:`COMMANDS` and run it; a
    nonzero exit code is raised as SystemExit, a user error is one line on stderr first."""
    argv = sys.argv[1:] if args is None else list(args)
    verbose = os.environ.get("RFKIT_VERBOSE", "") not in ("", "0")
    while argv[:1] and argv[0] in ("-v", "--verbose"):
        verbose, argv = True, argv[1:]
    configure_output(verbose)
    if os.getcwd() not in sys.path:  # class_path: my_policies.EvenLayers from the working directory
        sys.path.insert(0, os.getcwd())
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text(), file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "--version":
        from rfkit.version import __version__

        print(f"rfkit {__version__}")
        raise SystemExit(0)
    name = argv[0]
    command = COMMANDS.get(name)
    if command is None:
        near = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        sys.stderr.write(f"rfkit: error: unknown command '{name}'{hint}; commands: {', '.join(COMMANDS)}\n")
        raise SystemExit(2)
    prog = "rfkit" if command.lightning else f"rfkit {name}"
    try:
        from rfkit.ops import flex_window, triton_state

        # RFKIT_WINDOW_BACKEND and RFKIT_STATE_BACKEND, read by the window mixers: checked before any command runs
        flex_window.resolve(None)
        triton_state.resolve(None)
        if command.plugins:
            load_plugins()
        code = command.load()(argv if command.lightning else argv[1:])
    except ParseError as err:  # a SystemExit: jsonargparse must not catch it (see rfkit.errors)
        sys.stderr.write(f"{prog}: error: {err.message}\n")
        raise
    except Exception as err:
        described = describe_error(err, argv)
        if described is None:
            raise
        line, code = described
        sys.stderr.write(f"{prog}: error: {line}\n")
        raise SystemExit(code) from None
    if code:  # 0 returns normally (the console script then exits 0), as a Python caller expects
        raise SystemExit(code)


def _raised_in(err: BaseException, function: str) -> bool:
    """Whether ``function`` is on the traceback of ``err``."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def _unreadable_checkpoint(argv: list[str], err: BaseException) -> str:
    """The one line for a ``--ckpt_path`` that ``torch.load`` cannot read."""
    from rfkit.config.preflight import check_ckpt_path

    path = None
    for i, arg in enumerate(argv):
        if arg == "--ckpt_path" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--ckpt_path="):
            path = arg.split("=", 1)[1]
    try:
        check_ckpt_path(path)
    except RFKitError as found:
        return one_line(found)
    reason = one_line(err).split(". ")[0][:160]
    return f"--ckpt_path: cannot read '{path}' as a checkpoint ({reason}); it may be truncated or corrupt"
