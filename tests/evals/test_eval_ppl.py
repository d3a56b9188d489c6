"""``rfkit eval ppl``: the sliding-window NLL by hand, both modes through the command, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import SMOLLM, random_ids, run_cli, tiny_model
from rfkit.evals.perplexity import evaluate_perplexity
from transformers import AutoModelForCausalLM, AutoTokenizer

from rfkit.data import TextDataModule, load_documents, split_documents
from rfkit.evals.ppl import sliding_window_nll
from rfkit.training.losses import summed_nll


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").double()


def token_nll(model, context: torch.Tensor, target: int) -> float:
    """-log p(target | context) from one forward over the context alone."""
    logits = model(input_ids=context.unsqueeze(0), use_cache=False).logits[0, -1]
    return float(-F.log_softmax(logits.double(), -1)[target])


@pytest.mark.slow
@torch.no_grad()
def test_stride_equal_to_block_is_plain_blockwise_nll(model):
    ids = random_ids(1, 50)[0]
    nll, n = sliding_window_nll(model, ids, block_size=16, stride=16)
    expected, count = 0.0, 0
    for start in range(0, 50, 16):  # chunks of 16, 16, 16, 2; each loses its first token
        chunk = ids[start : start + 16].unsqueeze(0)
        part, k = summed_nll(model(input_ids=chunk).logits, chunk)
        expected += float(part)
        count += k
    assert n == count == 50 - 4
    assert nll == pytest.approx(expected, rel=1e-7)  # summed_nll works in float32


@pytest.mark.slow
@torch.no_grad()
def test_a_document_shorter_than_the_window_is_one_full_forward(model):
    ids = random_ids(1, 12, seed=3)[0]
    full, k = summed_nll(model(input_ids=ids.unsqueeze(0)).logits, ids.unsqueeze(0))
    for stride in (4, 16, 32):
        nll, n = sliding_window_nll(model, ids, block_size=32, stride=stride)
        assert n == k == 11
        assert nll == pytest.approx(float(full), rel=1e-7)  # summed_nll works in float32


@pytest.mark.slow
@torch.no_grad()
def test_strided_windows_score_each_token_once_with_the_right_context(model):
    """block 8, stride 4, 20 tokens: windows [0,8) [4,12) [8,16) [12,20); tokens 1-7 are
    scored in the first, 8-11 in the second (context from 4), 12-15 from 8, 16-19 from 12."""
    ids = random_ids(1, 20, seed=5)[0]
    window_start = {t: 0 if t < 8 else 4 * (t // 4 - 1) for t in range(1, 20)}
    assert [window_start[t] for t in (1, 7, 8, 11, 12, 15, 16, 19)] == [0, 0, 4, 4, 8, 8, 12, 12]
    expected = sum(token_nll(model, ids[window_start[t] : t], int(ids[t])) for t in range(1, 20))
    nll, n = sliding_window_nll(model, ids, block_size=8, stride=4)
    assert n == 19
    assert nll == pytest.approx(expected, rel=1e-7)  # summed_nll works in float32
    # and it differs from the full-context NLL, which a too-long window would give
    full, _ = summed_nll(model(input_ids=ids.unsqueeze(0)).logits, ids.unsqueeze(0))
    assert abs(nll - float(full)) > 1e-6
    # an uneven tail: 22 tokens, block 8, stride 3 -> every token but the first, once
    ids = random_ids(1, 22, seed=6)[0]
    assert sliding_window_nll(model, ids, 8, 3)[1] == 21
    with pytest.raises(ValueError):
        sliding_window_nll(model, ids, 8, 9)


@pytest.fixture(scope="module")
def heldout(tiny_model_dir, tiny_corpus):
    """Token ids of the corpus' validation documents, in split order."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    docs = split_documents(load_documents(str(tiny_corpus)), (0.05, 0.05))["validation"]
    return [tokenizer(d.text, add_special_tokens=False)["input_ids"] for d in docs]


@pytest.mark.slow
def test_sliding_cli_matches_the_per_document_sum(tiny_model_dir, tiny_corpus, heldout, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    code, stdout, err = run_cli(
        ["eval", "ppl", "--model", str(tiny_model_dir), "--source", str(tiny_corpus), "--mode", "sliding",
         "--block-size", "48", "--stride", "16", "--max-documents", "6", "--json", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    nll, tokens = 0.0, 0
    for ids in heldout[:6]:
        part, k = sliding_window_nll(model, ids, 48, 16)
        nll, tokens = nll + part, tokens + k
    assert tokens == sum(len(ids) - 1 for ids in heldout[:6]) == result["tokens"]
    assert result["ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert result["documents"] == 6 and result["documents_longer_than_window"] == sum(len(i) > 48 for i in heldout[:6])
    assert result["documents_longer_than_window"] > 0
    assert result["mode"] == "sliding" and result["settings"]["stride"] == 16 and result["settings"]["block_size"] == 48
    assert "perplexity (sliding)" in stdout


@pytest.mark.slow
def test_blocks_cli_agrees_with_training_validation(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    code, _, err = run_cli(
        ["eval", "ppl", "--model", str(tiny_model_dir), "--source", str(tiny_corpus), "--mode", "blocks",
         "--block-size", "32", "--val-blocks", "3", "--json", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    datamodule = TextDataModule(source=str(tiny_corpus), tokenizer=str(tiny_model_dir), seq_len=32, val_blocks=3)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    expected = evaluate_perplexity(model, datamodule.val_dataloader())
    assert result["ppl"] == pytest.approx(expected, rel=1e-6)
    assert result["blocks"] == 3 and result["tokens"] == 3 * 31
    assert result["documents"] == datamodule.describe()["documents"]["validation"]


@pytest.mark.slow
def test_data_settings_come_from_the_recipe_unless_flags_say_otherwise(tiny_model_dir, tiny_corpus, tmp_path):
    from rfkit.evals import ppl
    from rfkit.evals.common import EvalParser

    with open(SMOLLM) as f:
        config = yaml.safe_load(f)
    config["model"]["base_model"] = str(tiny_model_dir)
    config["data"].update(source=str(tiny_corpus), seq_len=40, val_blocks=5, split=[0.1, 0.2])
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(config))
    parser = EvalParser()
    ppl.add_arguments(parser)
    args = parser.parse_args(["--model", str(recipe)])
    ppl.validate(args)
    assert args.settings["seq_len"] == 40 and args.settings["val_blocks"] == 5
    assert args.settings["split"] == [0.1, 0.2] and args.settings["source"] == str(tiny_corpus)
    args = parser.parse_args(["--model", str(recipe), "--block-size", "64", "--val-blocks", "2"])
    ppl.validate(args)
    assert args.settings["seq_len"] == 64 and args.settings["val_blocks"] == 2 and args.settings["split"] == [0.1, 0.2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "sliding", "--block-size", "32", "--stride", "64"], "--stride: must be <= --block-size (32)"),
        (["--mode", "sliding", "--block-size", "32", "--stride", "0"], "--stride: must be an integer >= 1"),
        (["--block-size", "1024"], "--block-size: 1024 tokens is beyond what the model can take"),
        (["--block-size", "64", "--mode", "windows"], "argument --mode: invalid choice: 'windows'"),
        (["--block-size", "64", "--max-documents", "0"], "--max-documents: must be an integer >= 1"),
        (["--block-size", "64", "--source", "/no/such/file.jsonl"], "data.source: path '/no/such/file.jsonl' does not exist"),
        (["--block-size", "64", "--json", "/no/such/dir/x.json"], "--json: directory '/no/such/dir' does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_model_dir, args, message, capsys, monkeypatch):
    import rfkit.config.loading

    monkeypatch.setattr(rfkit.config.loading, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    code, _, err = run_cli(["eval", "ppl", "--model", str(tiny_model_dir), *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
