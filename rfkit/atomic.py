"""Write-then-rename helpers: a crash never leaves a half-written file or directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; these files are not secret
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextmanager
def atomic_directory(target: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success it becomes ``target``.

    With ``replace`` an existing ``target`` is swapped out; without it, an existing
    ``target`` (another process finished first) is kept and the new copy dropped.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists() and replace:
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        elif not target.exists():
            try:
                tmp.rename(target)
            except OSError:
                if not target.exists():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
