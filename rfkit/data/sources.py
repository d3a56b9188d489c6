"""Reading documents from a data source (``data.source``): local ``.txt``/``.jsonl``/``.json``
files and directories, Hugging Face hub datasets and the embedded corpora; and the identity of
a source for cache keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

from rfkit.data.documents import Document, _make_doc, _one_line
from rfkit.data.embedded import EMBEDDED_SOURCES, _embedded, _read_embedded
from rfkit.hub import EMBEDDED_DATA, SourceError, is_embedded, looks_like_path

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json")
# Suffixes that mark a name as a (possibly missing or unsupported) local file, not a hub id.
_FILE_LIKE_SUFFIXES = LOCAL_SUFFIXES + (
    ".csv", ".tsv", ".parquet", ".arrow", ".md", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".ndjson",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


def source_kind(source: str) -> str:
    """``"embedded"``, ``"local"`` or ``"hub"``; no file system access beyond ``os.path.exists``."""
    if is_embedded(source):
        return "embedded"
    lowered = source.lower()
    if looks_like_path(source) or lowered.endswith(_FILE_LIKE_SUFFIXES) or "\\" in source:
        return "local"
    return "hub"


def check_source(source, field: str = "data.source", error=SourceError) -> None:
    """A source's name, without reading any text: a known embedded name, an existing
    ``.txt``/``.jsonl``/``.json`` file or a directory holding some, or a hub dataset id.

    Raises:
        error: one line naming ``field`` and what is allowed.
    """
    allowed = (
        f"{', '.join(EMBEDDED_SOURCES)}, a .txt/.jsonl/.json file, a directory of them, "
        "or a hub dataset id org/name[:config]"
    )
    if not isinstance(source, str):
        raise error(f"{field}: {source!r} is not allowed; allowed: {allowed}")
    if not source.strip():
        raise error(f"{field}: empty; allowed: {allowed}")
    kind = source_kind(source)
    if kind == "embedded":
        if source not in EMBEDDED_SOURCES:
            raise error(f"{field}: unknown embedded data '{source}'; allowed: {', '.join(EMBEDDED_SOURCES)}")
        return
    if kind == "hub":
        if not _HUB_ID.match(source):
            raise error(f"{field}: '{source}' is not an existing path or a hub dataset id; allowed: {allowed}")
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise error(f"{field}: path '{source}' does not exist")
    if path.is_dir():
        if not _local_files(path):
            raise error(f"{field}: directory '{source}' has no .txt, .jsonl or .json files")
    elif path.suffix.lower() not in LOCAL_SUFFIXES:
        raise error(
            f"{field}: unsupported file type '{path.suffix or path.name}'; "
            "allowed: .txt, .jsonl, .json or a directory of them"
        )


def _local_files(root: Path) -> list[Path]:
    if root.is_dir():
        return sorted(
            p
            for p in root.rglob("*")
            if p.is_file()
            and p.suffix.lower() in LOCAL_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
    return [root]


def _text_of(obj: Any, field: str, where: str) -> str | None:
    """The text of a JSON row: a string itself, or ``obj[field]``; None/"" means empty."""
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, dict):
        raise SourceError(f"data.source: {where} is a {type(obj).__name__}, expected an object or a string")
    if field not in obj:
        fields = ", ".join(sorted(map(str, obj))[:8]) or "none"
        raise SourceError(
            f"data.text_field: field '{field}' missing in {where} (fields: {fields}); "
            "set data.text_field to the field that holds the text"
        )
    text = obj[field]
    if text is None:
        return None
    if not isinstance(text, str):
        raise SourceError(f"data.text_field: field '{field}' in {where} is a {type(text).__name__}, expected a string")
    return text


def _title_of(obj: Any) -> str | None:
    if isinstance(obj, dict):
        title = obj.get("title")
        if isinstance(title, str) and title.strip():
            return title.strip()
    return None


def _read_txt(path: Path) -> Iterator[Document]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            doc = _make_doc(line, None)
            if doc:
                yield doc


def _not_utf8(path: Path, err: UnicodeDecodeError) -> SourceError:
    return SourceError(
        f"data.source: {path.name} is not UTF-8 text (byte {err.start}: {_one_line(err.reason)}); "
        "allowed: UTF-8 .txt, .jsonl or .json files"
    )


def _read_jsonl(path: Path, field: str) -> Iterator[Document]:
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path.name} line {lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(f"data.source: {where} is not valid JSON ({_one_line(e)})") from None
                doc = _make_doc(_text_of(obj, field, where), _title_of(obj))
                if doc:
                    yield doc
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None


def _read_json(path: Path, field: str) -> Iterator[Document]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise SourceError(f"data.source: {path.name} is not valid JSON ({_one_line(e)})") from None
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    if isinstance(data, dict):
        for title, obj in data.items():
            where = f"{path.name} entry '{_one_line(title, 60)}'"
            doc = _make_doc(_text_of(obj, field, where), str(title).strip() or _title_of(obj))
            if doc:
                yield doc
    elif isinstance(data, list):
        for i, obj in enumerate(data):
            doc = _make_doc(_text_of(obj, field, f"{path.name} item {i}"), _title_of(obj))
            if doc:
                yield doc
    else:
        raise SourceError(f"data.source: {path.name} holds a {type(data).__name__}; expected a list or an object")


def _read_local(root: Path, field: str) -> Iterator[Document]:
    for path in _local_files(root):
        suffix = path.suffix.lower()
        if suffix == ".txt":
            yield from _read_txt(path)
        elif suffix == ".jsonl":
            yield from _read_jsonl(path, field)
        elif suffix == ".json":
            yield from _read_json(path, field)
        else:  # check() rejects these; kept for direct callers
            raise SourceError(
                f"data.source: unsupported file type '{suffix}' ({path.name}); "
                "allowed: .txt, .jsonl, .json or a directory of them"
            )


def _read_hub(source: str, field: str, hf_split: str, max_documents: int | None) -> Iterator[Document]:
    try:
        from datasets import load_dataset  # optional dependency
    except ImportError:
        raise SourceError("data.source: loading a hub dataset needs `pip install datasets`") from None
    name, _, config = source.partition(":")
    try:
        ds = load_dataset(name, config or None, split=hf_split, streaming=max_documents is not None)
    except Exception as e:  # network, unknown id, bad config or split: one line for the user
        raise SourceError(
            f"data.source: cannot load hub dataset '{source}' (split '{hf_split}'): {_one_line(e)}"
        ) from None
    for i, row in enumerate(ds):
        if max_documents is not None and i >= max_documents:
            break
        doc = _make_doc(_text_of(row, field, f"{source} row {i}"), _title_of(row))
        if doc:
            yield doc


def load_documents(
    source: str = EMBEDDED_DATA,
    text_field: str = "text",
    hf_split: str = "train",
    hf_max_documents: int | None = 50000,
) -> list[Document]:
    """Read all documents of a source (see the module docstring). Empty documents are dropped.

    Raises:
        SourceError: the source cannot be read or holds no documents.
    """
    kind = source_kind(source)
    if kind == "embedded":
        docs = list(_read_embedded(source))
    elif kind == "local":
        root = Path(source).expanduser()
        if not root.exists():
            raise SourceError(f"data.source: path '{source}' does not exist")
        docs = list(_read_local(root, text_field))
    else:
        docs = list(_read_hub(source, text_field, hf_split, hf_max_documents))
    if not docs:
        raise SourceError(f"data.source: '{source}' contains no documents (all empty or no readable rows)")
    return docs


def _source_signature(source: str) -> dict[str, Any]:
    """Identity of a source for cache keys: local files by path, size and mtime."""
    kind = source_kind(source)
    if kind == "local":
        root = Path(source).expanduser().resolve()
        files = []
        for p in _local_files(root) if root.exists() else []:
            st = p.stat()
            files.append([str(p.relative_to(root)) if root.is_dir() else p.name, st.st_size, st.st_mtime_ns])
        return {"kind": kind, "source": str(root), "files": files}
    if kind == "embedded":
        try:
            path = _embedded(source).path()
            if not path.is_dir():
                st = path.stat()
                return {"kind": kind, "source": source, "files": [[source, st.st_size, st.st_mtime_ns]]}
            files = []
            for p in sorted(q for q in path.iterdir() if q.is_file()):
                st = p.stat()
                files.append([f"{source}/{p.name}", st.st_size, st.st_mtime_ns])
            return {"kind": kind, "source": source, "files": files}
        except (OSError, SourceError):
            return {"kind": kind, "source": source, "files": []}
    return {"kind": kind, "source": source}


#: ``.json`` files up to this size are parsed by :func:`check_text` (they cannot be read lazily)
CHECK_TEXT_JSON_BYTES = 64 * 2**20


def check_text(source: str, text_field: str = "text", field: str = "data.source") -> None:
    """The preflight on a local source's contents, before any model loads (the CLI runs it on
    the recipe's ``data`` section and on the long-document sources, ``data.long_source`` and
    ``model.transfer.long_source``, whose messages name ``field``): not every file empty (0
    bytes), and at least one usable document. It reads only up to the first document (``.json``
    files of at most :data:`CHECK_TEXT_JSON_BYTES`), so a bad row after it is still found when
    the data module reads the source. The embedded data and hub datasets are not read here;
    neither is anything that :meth:`rfkit.data.TextDataModule.check` already refuses.

    Raises:
        SourceError: one line naming ``field`` (or ``data.text_field``).
    """
    if not isinstance(source, str) or source_kind(source) != "local" or not isinstance(text_field, str):
        return
    root = Path(source).expanduser()
    if not root.exists() or (root.is_file() and root.suffix.lower() not in LOCAL_SUFFIXES):
        return
    files = _local_files(root)
    sized = [(p, p.stat().st_size) for p in files]
    if sized and all(size == 0 for _, size in sized):
        what = f"file '{source}' is" if root.is_file() else f"every file in directory '{source}' is"
        raise SourceError(f"{field}: {what} empty (0 bytes); give .txt/.jsonl/.json text to tokenise")
    for path, size in sized:
        if size == 0 or (path.suffix.lower() == ".json" and size > CHECK_TEXT_JSON_BYTES):
            if size:
                return  # too big to parse twice; the data module reads it
            continue
        if next(iter(_read_local(path, text_field)), None) is not None:
            return
    setting = ", data.text_field," if field == "data.source" else ""
    why = f" (the '{text_field}' field{setting} is empty or null in every row)" if any(
        p.suffix.lower() in (".jsonl", ".json") for p in files
    ) else " (every line is blank)"
    raise SourceError(f"{field}: '{source}' contains no documents{why}; give text to tokenise")
