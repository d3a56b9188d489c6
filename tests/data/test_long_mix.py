"""``data.long_source``: long blocks interleaved with the training batches (the default recipe's
end-to-end training at long context). Small local sources, the embedded tokenizer; CPU only."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rfkit.data import TextDataModule
from rfkit.data.datamodule import train_split_blocks
from rfkit.data.sampling import InterleavedBatches, _MixedBlocks
from rfkit.hub import EMBEDDED_MODEL, SourceError, resolve_model

pytestmark = pytest.mark.usefixtures("data_cache")  # conftest: packed blocks go to a temp dir

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def tokenizer_dir():
    return resolve_model(EMBEDDED_MODEL)


def _corpus(path, n: int, words: int):
    pick = random.Random(len(path.name))  # every document its own word sequence: no two blocks alike
    texts = [" ".join(pick.choice(WORDS) for _ in range(words)) + f" {i}." for i in range(n)]
    rows = [{"title": f"Doc {i}", "text": text} for i, text in enumerate(texts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def sources(tmp_path):
    return _corpus(tmp_path / "short.jsonl", 120, 6), _corpus(tmp_path / "long.jsonl", 20, 30)


def _module(sources, tokenizer_dir, **extra):
    short, long = sources
    kwargs = dict(source=short, tokenizer=tokenizer_dir, seq_len=8, split=(0.2, 0.2), batch_size=3)
    kwargs.update(long_source=long, long_seq_len=64)
    return TextDataModule(**{**kwargs, **extra})


def test_long_batches_follow_every_long_every_short_batches(sources, tokenizer_dir):
    dm = _module(sources, tokenizer_dir, long_every=2, long_batch_size=2)
    dm.setup()
    assert dm.long_train is None  # read on first use: only training needs them
    assert dm.long_blocks().shape[1] == 64 and len(dm.long_train) >= 3
    batches = [b["input_ids"] for b in dm.train_dataloader()]
    n_short = dm.train.shape[0] // 3
    assert len(batches) == n_short + n_short // 2 == len(dm.train_dataloader())
    shapes = [tuple(b.shape) for b in batches]
    assert [b["long"] for b in dm.train_dataloader()] == [s[1] == 64 for s in shapes]
    expected = []
    for i in range(n_short):
        expected.append((3, 8))
        if (i + 1) % 2 == 0:
            expected.append((2, 64))
    assert shapes == expected
    # every long row comes from the long source's train split, every short row from data.source's
    long_rows = {tuple(r.tolist()) for r in dm.long_train}
    assert all(tuple(r.tolist()) in long_rows for b in batches if b.shape[1] == 64 for r in b)
    # the short batches are exactly the batches, in the order, that the loader gives without long_source
    plain = TextDataModule(source=sources[0], tokenizer=tokenizer_dir, seq_len=8, split=(0.2, 0.2), batch_size=3)
    plain_batches = [b["input_ids"] for b in plain.train_dataloader()]
    short = [b for b in batches if b.shape[1] == 8]
    assert len(short) == len(plain_batches) == n_short
    assert all(torch.equal(x, y) for x, y in zip(short, plain_batches))


def test_long_blocks_are_the_train_split_and_cycle_in_a_seeded_order(sources, tokenizer_dir):
    dm = _module(sources, tokenizer_dir, long_every=1)
    assert torch.equal(dm.long_blocks(), train_split_blocks(sources[1], tokenizer_dir, 64, "data."))
    held_out = TextDataModule(source=sources[1], tokenizer=tokenizer_dir, seq_len=64, split=None)
    seen = {tuple(r.tolist()) for r in dm.long_train}
    assert not seen & {tuple(r.tolist()) for r in held_out.split_blocks("validation")}
    longs = [b["input_ids"][0] for b in dm.train_dataloader() if b["input_ids"].shape[1] == 64]
    n = len(dm.long_train)
    assert len(longs) > n  # more long batches than blocks: they cycle
    first = [tuple(r.tolist()) for r in longs[:n]]
    assert len(set(first)) == n  # one pass over every long block before any repeats
    assert [tuple(r.tolist()) for r in longs[n : 2 * n]] == first[: len(longs[n : 2 * n])]
    again = [b["input_ids"] for b in _module(sources, tokenizer_dir, long_every=1).train_dataloader()]
    ours = [b["input_ids"] for b in dm.train_dataloader()]
    assert all(torch.equal(x, y) for x, y in zip(ours, again))  # deterministic
    other = [b["input_ids"] for b in _module(sources, tokenizer_dir, long_every=1, seed=5).train_dataloader()]
    assert not all(torch.equal(x, y) for x, y in zip(ours, other))


def test_resume_skips_the_batches_already_trained_and_epochs_differ(sources, tokenizer_dir):
    dm = _module(sources, tokenizer_dir, long_every=1)
    full = [b["input_ids"] for b in dm.train_dataloader()]
    again = _module(sources, tokenizer_dir, long_every=1)
    again.resume_at(0, 5)
    resumed = [b["input_ids"] for b in again.train_dataloader()]
    assert len(resumed) == len(full) - 5
    assert all(torch.equal(x, y) for x, y in zip(resumed, full[5:]))
    loader = _module(sources, tokenizer_dir, long_every=1).train_dataloader()
    loader.sampler.set_epoch(1)
    second = [b["input_ids"] for b in loader]
    assert not all(torch.equal(x, y) for x, y in zip(second, full))


def test_ranks_take_disjoint_short_batches():
    short, long = torch.arange(48).view(12, 4), torch.arange(100, 164).view(4, 16)
    dataset = _MixedBlocks(short, long)
    orders = [InterleavedBatches(dataset, 0, 2, long_every=1, num_replicas=2, rank=r).batches(0) for r in (0, 1)]
    rows = [[i for kind, b in order if kind == "short" for i in b] for order in orders]
    assert not set(rows[0]) & set(rows[1]) and len(rows[0]) == len(rows[1]) == 6
    longs = [[i for kind, b in order if kind == "long" for i in b] for order in orders]
    assert set(longs[0][:2]).isdisjoint(longs[1][:2])
    item = dataset[("long", (1, 3))]
    assert item["input_ids"].shape == (2, 16) and item["long"] is True  # the loss reads the mark (distill.long_ce)
    assert dataset[("short", (0,))]["long"] is False


def test_describe_records_the_long_source(sources, tokenizer_dir):
    dm = _module(sources, tokenizer_dir, long_every=3)
    described = dm.describe()["long"]  # what a head map's data section records
    assert described == {"source": sources[1], "seq_len": 64, "every": 3, "batch_size": 1}
    assert dm.long_train is None  # profiling and conversion never read the long blocks
    plain = TextDataModule(source=sources[0], tokenizer=tokenizer_dir, seq_len=8, split=(0.2, 0.2))
    assert "long" not in plain.describe()


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"long_every": 0}, "data.long_every"),
        ({"long_batch_size": 0}, "data.long_batch_size"),
        ({"long_seq_len": 1}, "data.long_seq_len"),
        ({"long_source": "embedded:nothing"}, "data.long_source"),
        ({"long_source": "no/such/file.jsonl"}, "data.long_source"),
    ],
)
def test_bad_long_settings_name_the_field(extra, field):
    with pytest.raises(SourceError) as err:
        TextDataModule(source="embedded:wikipedia-en", **extra)
    assert str(err.value).startswith(field + ":") and "\n" not in str(err.value)


def test_a_long_source_without_blocks_that_long_names_long_seq_len(sources, tokenizer_dir):
    dm = _module(sources, tokenizer_dir, long_seq_len=100_000)
    message = r"^data\.long_seq_len: the train split of .* has no complete block of 100000 tokens"
    with pytest.raises(SourceError, match=message):
        dm.train_dataloader()
