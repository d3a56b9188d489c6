"""rfkit.evals.references: the original's and the training-free model's results in ``rfkit eval
needles`` and ``rfkit eval context`` reused by the next run on the same prompts and weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_cli
from safetensors.torch import load_file, save_file

from rfkit.evals import needles, references

NEEDLES = ["--shapes", "passkey,multi", "--lengths", "256", "--depths", "0,1", "--trials", "1", "--no-record"]
CONTEXT = ["--lengths", "128", "--tokens", "256", "--depths", "0", "--no-record"]


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The cache in a fresh folder, and the models ``needles.answer`` ran, by description."""
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    calls, real = [], needles.answer

    def answer(model, tokenizer, records, batch_size=1, desc="needles"):
        calls.append(desc.removeprefix("needles (").removesuffix(")"))
        return real(model, tokenizer, records, batch_size, desc)

    monkeypatch.setattr(needles, "answer", answer)
    return calls


def run_needles(model, out, capsys, *extra) -> dict:
    code, _, err = run_cli(["eval", "needles", "--model", str(model), *NEEDLES, "--output", str(out), *extra], capsys)
    assert code == 0, err
    return json.loads((out / "needles.json").read_text())


@pytest.mark.slow
def test_another_trained_model_of_the_same_base_reuses_the_reference_answers(converted_dir, tmp_path, capsys, counted):
    first = run_needles(converted_dir, tmp_path / "a", capsys)
    names = list(first["rows"])
    baseline = first["baseline"]
    assert names == ["original", "converted", "converted, state off", baseline]
    assert counted == names and not any(row["reused"] for row in first["rows"].values())
    assert len(list((tmp_path / "cache" / "eval_references").glob("*.json"))) == 2  # the two references

    # the same base trained otherwise: its own weights (the replacement's) differ, the references' do not
    trained = tmp_path / "trained"
    shutil.copytree(converted_dir, trained)
    weights = load_file(trained / "model.safetensors")
    mixers = [k for k in weights if ".mixer." in k]
    assert mixers
    for k in mixers:
        weights[k] = weights[k] + 0.5
    save_file(weights, trained / "model.safetensors", metadata={"format": "pt"})
    counted.clear()
    second = run_needles(trained, tmp_path / "b", capsys)
    assert counted == ["converted", "converted, state off"]  # the references were not answered again
    assert {n: r["reused"] for n, r in second["rows"].items()} == {n: n in ("original", baseline) for n in names}
    for name in ("original", baseline):  # their rows and answers as the first run measured them
        assert {k: v for k, v in second["rows"][name].items() if k != "reused"} == {
            k: v for k, v in first["rows"][name].items() if k != "reused"
        }
        assert [r["answers"][name] for r in second["records"]] == [r["answers"][name] for r in first["records"]]

    counted.clear()
    third = run_needles(trained, tmp_path / "c", capsys, "--no-reuse", "--no-state-off")
    assert counted == ["original", "converted", baseline]  # measured again on request
    assert not any(row["reused"] for row in third["rows"].values())
    assert [r["answers"]["original"] for r in third["records"]] == [r["answers"]["original"] for r in first["records"]]


def test_the_weights_digest_follows_the_weights():
    other = torch.nn.Linear(4, 4)
    digest = references.weights_digest(other)
    assert references.weights_digest(other) == digest
    with torch.no_grad():
        other.weight.add_(1e-3)
    assert references.weights_digest(other) != digest


@pytest.mark.slow
def test_a_second_context_run_reuses_the_reference_rows_exactly(
    converted_dir, tiny_corpus, tmp_path, capsys, monkeypatch
):
    from rfkit.evals import context

    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    calls, real = [], context.measure
    monkeypatch.setattr(
        context,
        "measure",
        lambda model, tok, blocks, args, name: calls.append(name) or real(model, tok, blocks, args, name),
    )
    results = []
    for out in ("a", "b"):
        code, _, err = run_cli(
            [
                "eval",
                "context",
                "--model",
                str(converted_dir),
                "--source",
                str(tiny_corpus),
                *CONTEXT,
                "--output",
                str(tmp_path / out),
            ],
            capsys,
        )
        assert code == 0, err
        results.append(json.loads((tmp_path / out / "context.json").read_text()))
    first, second = results
    baseline = [n for n in first["rows"] if n.endswith("training-free")][0]
    assert calls == ["original", "converted", "converted, state off", baseline, "converted", "converted, state off"]
    for name, row in second["rows"].items():
        assert row["reused"] == (name in ("original", baseline))
        assert {k: v for k, v in row.items() if k not in ("reused", "seconds")} == {
            k: v for k, v in first["rows"][name].items() if k not in ("reused", "seconds")
        }
    assert second["rows"]["original"]["passkey"] == first["rows"]["original"]["passkey"] != {}


def test_keys_that_are_not_strings_survive_json():
    row = {"ppl": {128: 1.5, 256: 2.25}, "passkey_by_depth": {128: {0.0: 1.0, 0.5: 0.0}}, "name": "x", "list": [{1: 2}]}
    assert references.unpairs(json.loads(json.dumps(references.pairs(row)))) == row
