"""Write-then-rename helpers: a crash never leaves a half-written file or directory.

Temporary names carry the writer's host and pid; a write removes what earlier writers of the
same target on this host left when they were killed. A write that fails (a full disk
included) leaves nothing behind: not the temporary file or
directory, and not the parent directories the write created. A full disk becomes a one-line
:class:`rfkit.errors.DiskFullError` naming the target. :func:`atomic_write_text`,
:func:`atomic_write_json` and :func:`atomic_write_bytes` are what writers of results, head maps
and model cards call. :func:`check_writable` is the preflight that the CLI runs on output
locations before anything loads.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rfkit.errors import DiskFullError, OutputError

_DISK_FULL_ERRNOS = {e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None}
# how a full disk reads when it comes through a library that does not raise OSError
# (safetensors' Rust writer: "IoError(Os { code: 28, kind: StorageFull, ... })")
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "storagefull", "disk quota exceeded")


def is_disk_full(err: BaseException | None, where: str | os.PathLike | None = None) -> bool:
    """Whether ``err`` (or an error it was raised from) means the disk is full. ``where``: a
    directory whose file system is also checked for zero free bytes, for writers whose errors
    do not say why (``torch.save``: "file write failed")."""
    seen = set()
    first = err
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(err).lower() for text in _DISK_FULL_TEXT):
            return True
        err = err.__cause__ or err.__context__
    if where is not None and isinstance(first, (OSError, RuntimeError)):
        try:
            return shutil.disk_usage(_existing_ancestor(Path(where))).free == 0
        except OSError:
            return False
    return False


def disk_full_error(path: str | os.PathLike) -> DiskFullError:
    """The one-line error for a write of ``path`` that ran out of space."""
    err = DiskFullError(
        f"no space left on device while writing '{path}'; nothing partial was kept there: "
        "free some space or choose another location"
    )
    err.errno, err.filename = errno.ENOSPC, str(path)
    return err


def _owner_tag() -> str:
    """``<host>-<pid>``: temporary names carry their writer, so a later write can tell the
    leftovers of a killed writer (same host, dead process) from another writer's files."""
    return f"{socket.gethostname().replace('.', '_').replace('-', '_')}-{os.getpid()}"


def _remove_stale(parent: Path, name: str) -> None:
    """Remove the temporary files and directories that writers of ``parent/name`` on this host
    left when they were killed (``kill -9`` runs no cleanup): ``.name.tmp-<host>-<pid>-*`` whose
    process is gone."""
    host = _owner_tag().rsplit("-", 1)[0]
    prefix = f".{name}.tmp-{host}-"
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            try:
                entry.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest existing ancestor (``.`` for a relative
    path none of whose parents exist)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _make_parents(directory: Path) -> list[Path]:
    """``mkdir -p directory``; returns the directories it created, deepest first."""
    created, probe = [], Path(os.path.abspath(directory))
    while not probe.exists() and probe != probe.parent:
        created.append(probe)
        probe = probe.parent
    directory.mkdir(parents=True, exist_ok=True)
    return created


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories a failed write created (deepest first), if they are still empty."""
    for directory in created:
        try:
            directory.rmdir()
        except OSError:  # not empty (another writer) or already gone
            break


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``.

    On failure the temporary file and any parent directory created here are removed; a full
    disk is raised as :class:`~rfkit.errors.DiskFullError` naming ``path``.
    """
    path = Path(path)
    created: list[Path] = []
    tmp = None
    done = False
    try:
        created = _make_parents(path.parent)
        _remove_stale(path.parent, path.name)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{_owner_tag()}-", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; these files are not secret
        os.replace(tmp, path)
        done = True
    except BaseException as err:
        if is_disk_full(err, path.parent):
            raise disk_full_error(path) from err
        raise
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if not done:
            _remove_empty(created)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: never half-written."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, write)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON (one space, trailing newline), like :func:`atomic_write_text`."""
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


@contextmanager
def atomic_directory(target: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success it becomes ``target``.

    With ``replace`` an existing ``target`` is swapped out; without it, an existing
    ``target`` (another process finished first) is kept and the new copy dropped. On failure
    the temporary directory and any parent created here are removed; a full disk is raised as
    :class:`~rfkit.errors.DiskFullError` naming ``target``.
    """
    target = Path(target)
    created: list[Path] = []
    tmp = None
    done = False
    try:
        created = _make_parents(target.parent)
        _remove_stale(target.parent, target.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{_owner_tag()}-", dir=target.parent))
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
        done = True
    except BaseException as err:
        if is_disk_full(err, target.parent):
            raise disk_full_error(target) from err
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            _remove_empty(created)


def check_writable(path: str | os.PathLike, field: str, kind: str = "directory") -> None:
    """Preflight of an output location, before anything loads: raise a one-line
    :class:`~rfkit.errors.OutputError` (or :class:`~rfkit.errors.DiskFullError`) naming
    ``field`` when ``path`` cannot be created and written. ``kind``: ``"directory"`` (a run
    directory, ``rfkit convert --output``) or ``"file"`` (``rfkit profile --output``).

    It leaves nothing behind: the write test is an empty directory made in the nearest existing
    ancestor and removed at once (root ignores permission bits, so only a real write tells).
    """
    target = Path(path).expanduser()
    if target.exists():
        if kind == "directory" and not target.is_dir():
            raise OutputError(f"{field}: '{path}' exists and is a file; give a directory")
        if kind == "file" and target.is_dir():
            raise OutputError(f"{field}: '{path}' is a directory; give a file path (for example {Path(path) / 'head_map.json'})")
    start = target if kind == "directory" else target.parent
    ancestor = _existing_ancestor(start)
    if not ancestor.is_dir():
        raise OutputError(f"{field}: cannot create '{path}': '{ancestor}' is a file, not a directory; choose another location")
    try:
        probe = tempfile.mkdtemp(prefix=".rfkit-write-check-", dir=ancestor)
    except OSError as err:
        if err.errno in _DISK_FULL_ERRNOS:
            raise disk_full_error(path) from None
        reason = err.strerror or " ".join(str(err).split())
        raise OutputError(
            f"{field}: cannot write '{path}': nothing can be created in '{ancestor}' ({reason}); choose a writable location"
        ) from None
    os.rmdir(probe)
    try:
        free = shutil.disk_usage(ancestor).free
    except OSError:
        return
    if free == 0:
        raise OutputError(f"{field}: no space left on device for '{path}' (0 bytes free in '{ancestor}'); free some space or choose another location")
