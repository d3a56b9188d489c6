"""Where a result came from: the command, date, commit and wall time written into every result file.

Every command that writes measured numbers (``rfkit fit``'s ``summary.json``, ``rfkit eval``,
``rfkit bench``, ``rfkit sweep``, the scripts in ``benchmarks/``) puts a ``provenance`` block in
its JSON::

    "provenance": {"command": "rfkit eval context --model ...", "date": "2026-11-25T17:40:02+00:00",
                   "commit": "bfdbdbf...", "dirty": false, "wall_seconds": 1957.7, "rfkit": "0.x",
                   "machine": "AMD EPYC, 2 threads, avx512_bf16"}

``machine`` (:func:`machine`) says which processor a time was taken on: the project's machines
change, and a bf16 time on a CPU with AMX is not one on a CPU without.

``benchmarks/render.py`` prints it under every table of the README and docs/ that it renders from
the file, so a number on a page always names the command that measured it.
"""

from __future__ import annotations

import datetime as _dt
import shlex
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it: ``rfkit ...`` for the console script or
    ``python -m rfkit``, ``python SCRIPT ...`` otherwise."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    head = Path(argv[0]).name
    if head in ("rfkit", "__main__.py", "-m"):
        return shlex.join(["rfkit", *argv[1:]])
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(_REPO)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *argv[1:]])


def cpu_pressure() -> str | None:
    """The kernel's CPU pressure line (``/proc/pressure/cpu``; None where it does not exist): how
    busy a shared machine was when a timing was taken."""
    try:
        return Path("/proc/pressure/cpu").read_text().strip()
    except OSError:
        return None


def git_state(repo: Path = _REPO) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout rfkit runs from, ``(None, None)`` outside a git tree."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, bool(status) if status is not None else None


def provenance(started: float | None = None, command: str | None = None, wall_seconds: float | None = None) -> dict:
    """The block itself. ``started`` is a ``time.time()`` stamp (wall time = now - started) unless
    ``wall_seconds`` is given."""
    from rfkit.version import __version__

    commit, dirty = git_state()
    if wall_seconds is None and started is not None:
        wall_seconds = time.time() - started
    return {
        "command": command if command is not None else command_line(),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "commit": commit,
        "dirty": dirty,
        "wall_seconds": None if wall_seconds is None else round(float(wall_seconds), 1),
        "rfkit": __version__,
        "machine": machine(),
    }


def machine() -> str:
    """The processor a result was measured on, in a few words: its model name, the threads torch
    uses and its bf16 features (:data:`rfkit.devices.BF16_CPU_FLAGS`; none listed: none), plus the GPU
    where CUDA is up. Never raises: what cannot be read is left out."""
    import platform

    from rfkit.devices import BF16_CPU_FLAGS, cpu_flags, cpu_model

    parts = [cpu_model() or platform.processor() or platform.machine() or "unknown CPU"]
    try:
        import torch

        parts.append(f"{torch.get_num_threads()} threads")
        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001 - a record, never a failure
        pass
    parts += sorted(set(BF16_CPU_FLAGS) & cpu_flags())
    return ", ".join(parts)


def stamp(
    result: dict, started: float | None = None, command: str | None = None, wall_seconds: float | None = None, replace: bool = False
) -> dict:
    """``result`` with its ``provenance`` block (set in place; returned for chaining). A block it
    already has is kept (a result is stamped by the command that measured it, once) unless
    ``replace`` (a run that rewrites its partial results as it goes)."""
    if replace or "provenance" not in result:
        result["provenance"] = provenance(started, command, wall_seconds)
    return result
