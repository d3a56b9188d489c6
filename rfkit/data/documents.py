"""Documents, their split keys and packing: which split (calibration, validation, train) a
document belongs to, decided by its key alone, and how a split's token lists become blocks.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Iterable, NamedTuple, Sequence

import torch

log = logging.getLogger("rfkit.data.datamodule")  # the cache messages read as the data module's

SPLITS = ("calibration", "validation", "train")
DEFAULT_SPLIT = (0.05, 0.05)  # calibration, validation fractions; see default_split()


class Document(NamedTuple):
    """One text document with its split key (its title, else a hash of its text)."""

    key: str
    text: str


def _one_line(text: Any, limit: int = 200) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def text_key(text: str) -> str:
    """The key of a document without a title: a hash of its text."""
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:20]


def key_fraction(key: str) -> float:
    """A number in [0, 1) fixed by the key alone: the first 32 bits of its SHA-1."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) / 2**32


def assign_split(key: str, split: Sequence[float]) -> str:
    """``"calibration"``, ``"validation"`` or ``"train"`` for a document key.

    ``split`` holds the fractions for calibration and validation; the rest is train.
    """
    h = key_fraction(key)
    if h < split[0]:
        return "calibration"
    if h < split[0] + split[1]:
        return "validation"
    return "train"


def _order(doc: Document) -> tuple[str, str, str]:
    return (hashlib.sha1(doc.key.encode("utf-8")).hexdigest(), doc.key, doc.text)


def split_documents(docs: Iterable[Document], split: Sequence[float]) -> dict[str, list[Document]]:
    """Assign documents to ``calibration``/``validation``/``train`` by key.

    Within each split the documents are sorted by key hash (ties by key, then text), so the
    result depends only on the multiset of documents, not on their order.
    """
    out: dict[str, list[Document]] = {name: [] for name in SPLITS}
    for doc in docs:
        out[assign_split(doc.key, split)].append(doc)
    for name in SPLITS:
        out[name].sort(key=_order)
    return out


def join_tokens(token_lists: Iterable[Sequence[int]], eos_id: int | None) -> torch.Tensor:
    """One int32 stream: the token lists in order with ``eos_id`` between them (simply
    concatenated with ``eos_id=None``)."""
    stream: list[int] = []
    first = True
    for ids in token_lists:
        if not first and eos_id is not None:
            stream.append(eos_id)
        stream.extend(ids)
        first = False
    return torch.tensor(stream, dtype=torch.int32)


def cut_blocks(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A 1-D token stream cut into ``(N, seq_len)`` blocks; the incomplete tail is dropped."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].reshape(n, seq_len).clone()


def pack_blocks(token_lists: Iterable[Sequence[int]], eos_id: int | None, seq_len: int) -> torch.Tensor:
    """Join token lists with ``eos_id`` between them and cut into ``(N, seq_len)`` int32 blocks.

    The incomplete tail is dropped. With ``eos_id=None`` the lists are simply concatenated.
    """
    return cut_blocks(join_tokens(token_lists, eos_id), seq_len)


def _make_doc(text: str | None, title: str | None) -> Document | None:
    if text is None:
        return None
    text = text.strip()
    if not text:
        return None
    return Document(title if title else text_key(text), text)


def _load_cache(path, check) -> dict[str, Any] | None:
    """The data cached at ``path`` when ``check(data)`` accepts it, else None (a missing file;
    a corrupt or foreign one is ignored with a warning and rebuilt)."""
    if not path.exists():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not (isinstance(data, dict) and check(data)):
            raise ValueError("unexpected contents")
        return data
    except Exception as e:
        log.warning("ignoring unreadable data cache %s (%s)", path, _one_line(e))
        return None


def load_packed(path, seq_len: int) -> dict[str, Any] | None:
    """The packed blocks cached at ``path`` (every split ``(N, seq_len)``), or None when the file
    is missing, corrupt or foreign (it is rebuilt)."""
    return _load_cache(
        path, lambda d: all(isinstance(d.get(n), torch.Tensor) and d[n].ndim == 2 and d[n].shape[1] == seq_len for n in SPLITS)
    )


def load_streams(path) -> dict[str, Any] | None:
    """The token streams cached at ``path`` (every split one 1-D int32 stream, documents joined
    by EOS, and the document counts), or None when the file is missing, corrupt or foreign."""
    return _load_cache(
        path,
        lambda d: all(isinstance(d.get(n), torch.Tensor) and d[n].ndim == 1 and d[n].dtype == torch.int32 for n in SPLITS)
        and isinstance(d.get("documents"), dict),
    )


def save_packed(path, data: dict[str, Any]) -> None:
    """Cache packed blocks or token streams at ``path`` (write then rename); a failure is a warning,
    not an error."""
    from rfkit.atomic import atomic_write

    try:
        atomic_write(path, lambda tmp: torch.save(data, tmp))
    except OSError as e:
        log.warning("could not write the data cache %s (%s); continuing without it", path, _one_line(e))
