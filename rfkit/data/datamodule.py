"""The LightningDataModule: settings checks, tokenisation, the cache of token streams and packed
blocks and the calibration, training and validation loaders.

One module because the cache keys, the tokenisation and the loaders all read the one data
module's settings; :mod:`rfkit.data.documents` holds the pieces that need none of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from rfkit.data.documents import SPLITS, _one_line, cut_blocks, join_tokens, load_packed, load_streams, save_packed
from rfkit.data.documents import split_documents
from rfkit.data.embedded import _EMBEDDED, default_split
from rfkit.data.long import interleaved_loader, long_source_message
from rfkit.data.recall import DIGITS, check_digits
from rfkit.data.sampling import ResumableShuffle, _Blocks
from rfkit.data.sources import CHECK_TEXT_JSON_BYTES, _source_signature, check_source, check_text, load_documents
from rfkit.hub import EMBEDDED_DATA, EMBEDDED_MODEL, ModelSource, SourceError, cache_dir, is_embedded
from rfkit.hub import looks_like_path, resolve_model
from rfkit.validate import is_int as _is_int

log = logging.getLogger(__name__)

_CACHE_FORMAT = 1
_TOKENS_FORMAT = 1  # the token streams every seq_len is cut from
_TOKENIZE_CHUNK = 256  # documents per batched tokenizer call
_NO_TOKENIZER = "data.tokenizer: not set; pass --data.tokenizer (or --model.base_model, which the CLI links to it)"


def data_cache_dir() -> Path:
    """Where packed token blocks are cached: ``cache_dir()/data``."""
    return cache_dir() / "data"


def _tokenizer_identity(name: str) -> str:
    if not is_embedded(name) and looks_like_path(name):
        return str(Path(name).expanduser().resolve())
    return name


def _load_tokenizer(source: ModelSource):
    """``AutoTokenizer`` for a resolved model id, local directory or embedded name."""
    from transformers import AutoTokenizer

    name = source.name
    try:
        tok = AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as e:
        raise SourceError(f"data.tokenizer: cannot load a tokenizer from '{name}': {_one_line(e)}") from None
    if not getattr(tok, "is_fast", True):
        log.warning("data.tokenizer: '%s' has no fast tokenizer; tokenising will be slow", name)
    return tok



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
        long_source: str | None = None,
        long_seq_len: int = 2048,
        long_every: int = 1,
        long_batch_size: int = 1,
        long_recall: int = 0,
        long_recall_gap: int = 256,
        long_recall_max_gap: int | None = None,
        long_recall_digits: tuple[int, int] = DIGITS,
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
            long_source: Long documents mixed into training (a source as ``source`` names them,
                for example ``embedded:shakespeare``): after every ``long_every`` training
                batches, one batch of ``long_batch_size`` blocks of ``long_seq_len`` tokens
                from the **train** split of this source, so end-to-end training also sees long
                context. Its calibration and validation documents (what ``rfkit eval context``
                scores) never appear. None: short blocks only.
            long_seq_len: Tokens per long block.
            long_every: Short batches between two long ones.
            long_batch_size: Long blocks per long batch.
            long_recall: Records planted in each long training block, each recalled at least
                ``long_recall_gap`` tokens later (:mod:`rfkit.data.recall`; the answers' loss is
                ``model.distill.recall``). 0: the long blocks are plain text.
            long_recall_gap: Fewest tokens between a record and its recall line.
            long_recall_max_gap: Most tokens between a record and its recall line (null: up to
                the block's end). Below the hybrid's window, the recall asks the model to quote
                what its exact window still holds.
            long_recall_digits: Fewest and most digits of a planted record's number, as
                ``[fewest, most]``; each record draws its length between them.
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
        self.long_source = None if long_source is None else str(long_source)
        self.long_seq_len = long_seq_len
        self.long_every = long_every
        self.long_batch_size = long_batch_size
        self.long_recall, self.long_recall_gap = long_recall, long_recall_gap
        self.long_recall_max_gap = long_recall_max_gap
        self.long_recall_digits = tuple(long_recall_digits) if isinstance(long_recall_digits, (list, tuple)) else long_recall_digits
        self.long_train: torch.Tensor | None = None  # (N, long_seq_len): long_blocks() reads it on first use

        self.calibration: torch.Tensor | None = None
        self.validation: torch.Tensor | None = None
        self.train: torch.Tensor | None = None
        self._tokenizer = None
        self.model_source: ModelSource | None = None  # tokenizer resolved; shared with rfkit.pipeline.resolve
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
        minimums.update(long_seq_len=2, long_every=1, long_batch_size=1, long_recall=0, long_recall_gap=0)
        for field, minimum in minimums.items():
            value = getattr(self, field)
            if not _is_int(value) or value < minimum:
                raise SourceError(f"data.{field}: must be an integer >= {minimum}, got {value!r}")
        for field in ("train_blocks", "hf_max_documents"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or value < 1):
                raise SourceError(f"data.{field}: must be an integer >= 1 or null, got {value!r}")
        gap, most = self.long_recall_gap, self.long_recall_max_gap
        if most is not None and (not _is_int(most) or (_is_int(gap) and most < gap)):
            raise SourceError(f"data.long_recall_max_gap: must be an integer >= data.long_recall_gap ({gap}) or null, got {most!r}")
        check_digits(self.long_recall_digits, "data.long_recall_digits")
        if self.long_recall and self.long_source is None:
            raise SourceError(f"data.long_recall: plants records in the long blocks; set data.long_source or use 0, got {self.long_recall}")
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
        check_source(self.source)
        if self.long_source is not None:
            check_source(self.long_source, "data.long_source")

    #: ``.json`` files up to this size are parsed by :meth:`check_text` (they cannot be read lazily)
    CHECK_TEXT_JSON_BYTES = CHECK_TEXT_JSON_BYTES
    check_text = staticmethod(check_text)

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

    def tokens_cache_path(self) -> Path:
        """The cache file of this module's token streams: the same settings but ``seq_len``, so
        another block length is cut from it without the text or the tokenizer."""
        settings = {k: v for k, v in self._settings().items() if k != "seq_len"}
        blob = json.dumps({"format": f"tokens-{_TOKENS_FORMAT}", **settings}, sort_keys=True)
        return data_cache_dir() / f"tokens-{hashlib.sha1(blob.encode('utf-8')).hexdigest()}.pt"

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
            self._tokenizer = _load_tokenizer(self.tokenizer_source())
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value

    def tokenizer_source(self) -> ModelSource:
        """``tokenizer`` resolved once (its SourceError names model.base_model, linked here), or as
        :attr:`model_source` holds it already."""
        if self.model_source is None or self.model_source.name != self.tokenizer_name:
            self.model_source = ModelSource(self.tokenizer_name, resolve_model(self.tokenizer_name))
        return self.model_source

    def tokenizer_spec(self) -> ModelSource | str | None:
        """``tokenizer`` as :attr:`model_source` resolved it, else its name; resolves nothing."""
        known = self.model_source
        return known if known is not None and known.name == self.tokenizer_name else self.tokenizer_name

    def recall_planter(self, count: int, gap: int, field: str, max_gap: int | None = None, digits: tuple[int, int] = DIGITS):
        """A :class:`~rfkit.data.recall.RecallPlanter` with this data's tokeniser and seed (errors name ``field``)."""
        from rfkit.data.recall import RecallPlanter

        return RecallPlanter(self.tokenizer, count, gap, self.seed, field=field, max_gap=max_gap, digits=digits)

    def other_train_blocks(self, source: str, seq_len: int, field: str) -> torch.Tensor:
        """The train split of another ``source`` in ``seq_len``-token blocks, this data's tokeniser (errors name ``field``)."""
        return train_split_blocks(source, self.tokenizer_spec(), seq_len, field)

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

    def _tokenize_splits(self) -> dict[str, Any]:
        """Every split as one token stream (its documents joined by EOS) and the document counts."""
        docs = load_documents(self.source, self.text_field, self.hf_split, self.hf_max_documents)
        by_split = split_documents(docs, self.split)
        order = [d for name in SPLITS for d in by_split[name]]
        ids = self._tokenize([d.text for d in order])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            log.warning(
                "data.tokenizer: '%s' has no EOS token; documents are joined without a separator", self.tokenizer_name
            )
        streams: dict[str, Any] = {}
        start = 0
        for name in SPLITS:
            n = len(by_split[name])
            streams[name] = join_tokens(ids[start : start + n], eos)
            start += n
        streams["documents"] = {name: len(by_split[name]) for name in SPLITS}
        return streams

    def _build(self) -> dict[str, Any]:
        """The packed blocks of every split, cut from the cached token streams (tokenising and
        caching them first when no other block length has)."""
        if self.tokenizer_name is None:
            raise SourceError(_NO_TOKENIZER)
        path = self.tokens_cache_path()
        streams = load_streams(path)
        if streams is None:
            streams = self._tokenize_splits()
            save_packed(path, streams)
        else:
            log.info("cutting %d-token blocks from the cached token streams %s", self.seq_len, path)
        blocks: dict[str, Any] = {name: cut_blocks(streams[name], self.seq_len) for name in SPLITS}
        blocks["documents"] = dict(streams["documents"])
        return blocks

    def _blocks(self) -> dict[str, Any]:
        """All packed blocks per split, from memory, the cache, or by tokenising."""
        if self._all_blocks is None:
            path = self.cache_path()
            data = load_packed(path, self.seq_len)
            if data is None:
                data = self._build()
                save_packed(path, data)
            else:
                log.info("loaded packed blocks from %s", path)
            self._all_blocks = data
        return self._all_blocks

    def split_blocks(self, name: str) -> torch.Tensor:
        """Every packed block of one split (``calibration``, ``validation`` or ``train``), as
        int64, before the block caps and without :meth:`setup`'s demand that every split has
        one (attention transfer's long blocks read the ``train`` split of a long source)."""
        if name not in SPLITS:
            raise ValueError(f"split_blocks: unknown split {name!r}; allowed: {', '.join(SPLITS)}")
        return self._blocks()[name].long()

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

    def long_blocks(self) -> torch.Tensor | None:
        """The long source's train blocks ``(N, long_seq_len)`` (None without ``long_source``),
        read on first use: only training needs them."""
        if self.long_source is not None and self.long_train is None:
            if self.tokenizer_name is None:
                raise SourceError(_NO_TOKENIZER)
            self.long_train = train_split_blocks(self.long_source, self.tokenizer_spec(), self.long_seq_len, "data.")
        return self.long_train

    def train_sampler(self, dataset, batch_size: int | None = None) -> ResumableShuffle:
        """The training order (see :class:`ResumableShuffle`), sharded over the trainer's ranks
        and starting where a resumed checkpoint left off (:meth:`resume_at`). ``batch_size``:
        items per batch (default ``self.batch_size``; 1 when every item is a whole batch)."""
        replicas, rank = self._ranks()
        order = ResumableShuffle(dataset, self.seed, batch_size or self.batch_size, num_replicas=replicas, rank=rank)
        return self._resumed(order)

    def _ranks(self) -> tuple[int, int]:
        """(world size, global rank) of the trainer this module is attached to; (1, 0) alone."""
        trainer = getattr(self, "trainer", None)
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _resumed(self, sampler: ResumableShuffle) -> ResumableShuffle:
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
        """Training blocks, shuffled with a generator seeded by ``seed``; incomplete last batch
        dropped. With ``long_source``, a batch of long blocks after every ``long_every`` of them
        (:class:`rfkit.data.sampling.InterleavedBatches`)."""
        self.setup()
        if self.long_blocks() is None:
            return self._loader(self.train, shuffle=True)
        return interleaved_loader(self)

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
            **self._describe_long(),
        }

    def _describe_long(self) -> dict[str, Any]:
        """The training mix's settings (the blocks are not read for this: profiling never needs them)."""
        if self.long_source is None:
            return {}
        settings = {"source": self.long_source, "seq_len": self.long_seq_len, "every": self.long_every}
        recall = {"recall": self.long_recall, "recall_gap": self.long_recall_gap} if self.long_recall else {}
        if self.long_recall and self.long_recall_max_gap is not None:
            recall["recall_max_gap"] = self.long_recall_max_gap
        if self.long_recall and self.long_recall_digits != DIGITS:
            recall["recall_digits"] = list(self.long_recall_digits)
        return {"long": {**settings, "batch_size": self.long_batch_size, **recall}}


def train_split_blocks(source: str, tokenizer: str | ModelSource, seq_len: int, prefix: str) -> torch.Tensor:
    """Every packed block of ``seq_len`` tokens in the **train** split of ``source`` (int64),
    packed as ``data.source``'s are (same default split, same cache), for the long-document
    settings ``{prefix}long_source`` / ``{prefix}long_seq_len`` (``data.`` or
    ``model.transfer.``), which the one-line :class:`SourceError` names. A resolved
    ``tokenizer`` (:class:`~rfkit.hub.ModelSource`) is used as it is."""
    try:
        resolved = tokenizer if isinstance(tokenizer, ModelSource) else None
        data = TextDataModule(source=source, tokenizer=resolved.name if resolved else tokenizer, seq_len=seq_len)
        data.model_source = resolved
        blocks = data.split_blocks("train")
    except SourceError as err:
        raise SourceError(long_source_message(str(err), f"{prefix}long_source")) from None
    if len(blocks) == 0:
        raise SourceError(
            f"{prefix}long_seq_len: the train split of '{source}' has no complete block of "
            f"{seq_len} tokens; use a smaller long_seq_len or a source with more text"
        )
    return blocks
