"""Attention transfer on long blocks as well (``model.transfer.long_source``): the blocks come from
the train split of the long source alone, are captured at the requested shape, and their loss
reaches the new blocks; without a long source the report is what it always was."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import random_ids, run_cli, tiny_args
from transformers import LlamaForCausalLM

import rfkit.training.transfer as transfer_module
from rfkit.data import assign_split, default_split
from rfkit.hub import EMBEDDED_MODEL
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import MambaOperator
from rfkit.training.transfer import TransferConfig, TransferError, load_long_blocks, transfer

SELECTED = [[0, 1], [2, 3]]  # GQA 4/2: one whole KV group per layer
SHORT_KEYS = {
    "config", "layers", "mse_before", "mse_after_readout", "mse_after", "mean_mse_before", "mean_mse_after",
    "kept_start", "losses", "steps_run", "samples", "tokens_captured", "captured_bytes", "seconds",
}  # fmt: skip
LONG_KEYS = {
    "mse_before_long", "mse_after_readout_long", "mse_after_long", "mean_mse_before_long", "mean_mse_after_long",
    "long_samples", "tokens_captured_long",
}  # fmt: skip
MARKER = re.compile(r"marker(\d{3})")


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
    """A JSONL source of 120 titled documents, each its own number repeated (``marker007``), so
    a block's text tells which documents it came from."""
    path = tmp_path_factory.mktemp("long") / "plays.jsonl"
    with open(path, "w") as f:
        for i in range(120):
            f.write(json.dumps({"title": f"play {i}", "text": " ".join([f"marker{i:03d}"] * 30)}) + "\n")
    return path


def converted(seed: int = 0, model=None):
    from helpers import tiny_model

    model = model if model is not None else tiny_model("llama", seed=seed)
    return to_recurformer(model, SELECTED, MambaOperator()).eval()


def mixer_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".mixer." in n}


def test_without_a_long_source_the_report_is_unchanged():
    report = transfer(converted(), random_ids(4, 16), TransferConfig(steps=3, samples=4, batch_size=2), progress=False)
    assert set(report) == SHORT_KEYS
    assert report["config"]["long_source"] is None


def test_long_blocks_are_captured_trained_on_and_reported(monkeypatch):
    shapes = []
    real = transfer_module.capture

    def spy(model, blocks, *args, **kwargs):
        data = real(model, blocks, *args, **kwargs)
        shapes.append((tuple(blocks.shape), {i: tuple(v.shape[:2]) for i, (v, _) in data.items()}))
        return data

    monkeypatch.setattr(transfer_module, "capture", spy)
    model = converted()
    start = mixer_params(model)
    backward = []  # sequence lengths whose loss flowed back into a block

    def on_forward(mixer, args, out):
        if mixer.training and out.requires_grad:
            out.register_hook(lambda grad, length=args[0].shape[1]: backward.append(length))

    for layer in model.get_decoder().layers:
        layer.self_attn.mixer.register_forward_hook(on_forward)
    config = TransferConfig(steps=20, samples=4, batch_size=2, readout="none", long_source="embedded:shakespeare",
                            long_seq_len=48, long_samples=3, long_batch_size=2)  # fmt: skip
    report = transfer(model, random_ids(4, 16, seed=3), config, progress=False, long_blocks=random_ids(5, 48, seed=5))

    assert shapes[-1] == ((3, 48), {0: (3, 48), 1: (3, 48)})  # long_samples x long_seq_len, every layer
    assert set(report) == SHORT_KEYS | LONG_KEYS
    assert report["long_samples"] == 3 and report["tokens_captured_long"] == 3 * 48
    assert backward.count(48) == backward.count(16) == 2 * 20  # every step: one short and one long batch per layer
    assert report["mean_mse_after_long"] < report["mean_mse_before_long"]
    assert report["mean_mse_after"] < report["mean_mse_before"]
    trained = mixer_params(model)
    assert all(not torch.equal(trained[n], start[n]) for n in trained if n.endswith("out_proj.weight"))


def test_kept_start_counts_the_long_error(monkeypatch):
    """A block whose short error falls while its long error rises by more is put back."""
    same = {0: 1.0, 1: 1.0}
    calls = iter([same, same, same, same, {0: 0.5, 1: 0.5}, {0: 2.0, 1: 0.5}])  # short, long: before, readout, after
    monkeypatch.setattr(transfer_module, "evaluate", lambda *a, **k: dict(next(calls)))
    config = TransferConfig(steps=2, samples=2, batch_size=2, readout="none", long_source="embedded:shakespeare",
                            long_seq_len=24, long_samples=2)  # fmt: skip
    report = transfer(converted(), random_ids(2, 16), config, progress=False, long_blocks=random_ids(2, 24))
    assert report["kept_start"] == [0]
    assert report["mse_after"] == {"0": 1.0, "1": 0.5} and report["mse_after_long"] == {"0": 1.0, "1": 0.5}


def test_a_long_source_needs_its_blocks():
    config = TransferConfig(steps=1, samples=2, long_source="embedded:shakespeare")
    with pytest.raises(ValueError, match="long_blocks"):
        transfer(converted(), random_ids(2, 16), config, progress=False)


def test_long_blocks_come_from_the_train_split_alone(long_corpus, data_cache):
    config = TransferConfig(long_source=str(long_corpus), long_seq_len=128, long_samples=1000)
    every = load_long_blocks(config, EMBEDDED_MODEL, seed=0)  # fewer train blocks than asked: all of them
    assert every.dtype == torch.int64 and every.shape[1] == 128
    from transformers import AutoTokenizer

    from rfkit.hub import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL))
    seen = {int(m) for block in every for m in MARKER.findall(tokenizer.decode(block))}
    split = default_split(str(long_corpus))
    held_out = {i for i in range(120) if assign_split(f"play {i}", split) != "train"}
    assert held_out and len(seen) > 60  # the test means something: documents held out, most train ones seen
    assert not seen & held_out

    few = TransferConfig(long_source=str(long_corpus), long_seq_len=128, long_samples=4)
    blocks = load_long_blocks(few, EMBEDDED_MODEL, seed=0)
    assert blocks.shape == (4, 128)
    assert torch.equal(blocks, load_long_blocks(few, EMBEDDED_MODEL, seed=0))  # deterministic given the seed
    assert not torch.equal(blocks, load_long_blocks(few, EMBEDDED_MODEL, seed=1))
    assert all(any(torch.equal(b, e) for e in every) for b in blocks)  # drawn from the same train blocks
    assert load_long_blocks(TransferConfig(), EMBEDDED_MODEL) is None


def test_a_long_seq_len_beyond_the_train_split_is_one_line(long_corpus, data_cache):
    config = TransferConfig(long_source=str(long_corpus), long_seq_len=1_000_000)
    with pytest.raises(TransferError, match=r"^model.transfer.long_seq_len: the train split of .* no complete block"):
        load_long_blocks(config, EMBEDDED_MODEL)


def test_an_unreadable_long_source_names_the_transfer_field(tmp_path, data_cache):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(TransferError, match=r"^model.transfer.long_source: ") as err:
        load_long_blocks(TransferConfig(long_source=str(bad), long_seq_len=4), EMBEDDED_MODEL)
    assert "data.source" not in str(err.value)


def test_the_long_source_reaches_transfer_through_the_model(tiny_model_dir, long_corpus, data_cache):
    """End to end on a model that reads the tokenizer's ids: the real blocks are captured and trained on."""
    model = converted(model=LlamaForCausalLM.from_pretrained(str(tiny_model_dir)))
    config = TransferConfig(steps=5, samples=2, batch_size=2, long_source=str(long_corpus), long_seq_len=64,
                            long_samples=2, long_batch_size=2)  # fmt: skip
    long = load_long_blocks(config, str(tiny_model_dir), seed=0)
    report = transfer(model, random_ids(2, 32), config, progress=False, long_blocks=long)
    assert report["tokens_captured_long"] == 2 * 64 and set(report["mse_after_long"]) == {"0", "1"}


@pytest.mark.slow
def test_rfkit_convert_trains_on_the_long_source(
    tiny_model_dir, tiny_corpus, long_corpus, tmp_path, capsys, data_cache, monkeypatch
):
    seen = {}
    real = transfer_module.transfer

    def spy(model, blocks, config, progress=True, long_blocks=None):
        seen["long"] = long_blocks
        seen["report"] = real(model, blocks, config, progress=False, long_blocks=long_blocks)
        return seen["report"]

    monkeypatch.setattr(transfer_module, "transfer", spy)
    args = ["convert", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), "--output", str(tmp_path / "out"),
            "--model.transfer.long_source", str(long_corpus), "--model.transfer.long_seq_len", "64",
            "--model.transfer.long_samples", "3"]  # fmt: skip
    code, _, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    assert seen["long"].shape == (3, 64)
    assert set(LONG_KEYS) <= set(seen["report"])


@pytest.mark.slow
def test_an_empty_long_source_file_is_one_line_before_loading(
    tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch
):
    import rfkit.conversion.convert

    monkeypatch.setattr(rfkit.conversion.convert, "load_base_model", lambda *a, **k: pytest.fail("a model was loaded"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = ["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path), "--model.transfer.long_source", str(empty)]
    code, _, err = run_cli(args, capsys)
    lines = [line for line in err.splitlines() if line.startswith("rfkit: error:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert f"model.transfer.long_source: file '{empty}' is empty" in lines[0]
