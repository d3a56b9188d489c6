"""``rfkit eval needles``: the shapes' prompts, the scoring, the counts of needles missed, the command."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from helpers import run_cli
from transformers import AutoTokenizer

from rfkit.conversion import evaluations
from rfkit.evals import needles, passkey
from rfkit.evals.needles import PROSE_QUESTION, SHAPES, held_out_sentences, trial


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def body(text: str, instruction: str) -> str:
    """The prompt between its instruction and its question."""
    assert text.startswith(instruction + " ")
    return text[len(instruction) + 1 : text.rindex("\n")]


def test_the_passkey_shape_is_the_passkey_test(tokenizer):
    for depth in (0.0, 0.5, 1.0):
        made = trial(SHAPES["passkey"], tokenizer, 300, depth, 3, 1)
        key = passkey.trial_key(3, 300, depth, 1)
        assert made["key"] == key and made["keys"] == [key]
        assert (made["text"], made["prompt_tokens"]) == passkey.build_prompt(tokenizer, 300, depth, key)


@pytest.mark.parametrize("name, source", [("prose", "embedded:wikipedia-en"), ("plays", "embedded:shakespeare")])
def test_running_text_fillers_are_held_out_sentences_without_digits(tokenizer, name, source):
    sentences = set(held_out_sentences(source))
    from rfkit.data.documents import split_documents
    from rfkit.data.embedded import default_split
    from rfkit.data.sources import load_documents

    train = " ".join(d.text for d in split_documents(load_documents(source), default_split(source))["train"][:200])
    for depth in (0.0, 0.5, 1.0):
        made = trial(SHAPES[name], tokenizer, 400, depth, 0, 0)
        assert made["prompt_tokens"] == len(tokenizer(made["text"])["input_ids"]) <= 400
        assert made["prompt_tokens"] > 400 - 80  # within one sentence of the length
        needle = passkey.NEEDLE.format(key=made["key"])
        # prose asks for "the number": after Wikipedia text SmolLM2 defines "the pass key" instead
        assert made["text"].endswith("\n" + (PROSE_QUESTION if name == "prose" else passkey.QUESTION))
        before, after = body(made["text"], passkey.INSTRUCTION).split(needle)
        filler = before + after
        assert re.findall(r"\d", filler) == []  # the only integers are the key's
        if depth == 0.0:
            assert before == ""
        if depth == 1.0:
            assert after == ""
        first = re.split(r"(?<=[.!?])\s+", (before or after).strip())[0]
        assert first in sentences and first not in train
    # each trial starts its filler elsewhere; the same trial is the same prompt
    assert trial(SHAPES[name], tokenizer, 400, 0.5, 0, 0) == trial(SHAPES[name], tokenizer, 400, 0.5, 0, 0)
    assert trial(SHAPES[name], tokenizer, 400, 0.5, 0, 0)["text"] != trial(SHAPES[name], tokenizer, 400, 0.5, 0, 1)["text"]


def test_the_long_shape_hides_a_20_digit_key(tokenizer):
    made = trial(SHAPES["long"], tokenizer, 300, 0.5, 0, 0)
    assert 10**19 <= made["key"] < 10**20
    assert made["text"].count(str(made["key"])) == 2
    assert SHAPES["long"].new_tokens >= len(tokenizer(" " + str(made["key"]) + ".")["input_ids"])


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_multi_hides_three_keys_and_asks_for_the_one_at_the_depth(tokenizer, depth):
    made = trial(SHAPES["multi"], tokenizer, 400, depth, 0, 0)
    keys = made["keys"]
    assert len(set(keys)) == 3 and made["key"] == keys[0]
    colour = re.search(r"pass key of the (\w+) door\?", made["text"]).group(1)
    text = body(made["text"], needles.MULTI_INSTRUCTION)
    found = re.findall(r"The pass key of the (\w+) door is (\d+)\.", text)
    assert len(found) == 3 and {int(k) for _, k in found} == set(keys)
    assert dict(found)[colour] == str(made["key"])  # the question asks for the first key's door
    sentences = [s for s in re.split(r"(?<=\.)\s+", text) if s]
    where = [i for i, s in enumerate(sentences) if s.startswith(f"The pass key of the {colour} door")][0]
    fillers = sum(s in passkey.FILLER_SENTENCES for s in sentences)
    before = sum(s in passkey.FILLER_SENTENCES for s in sentences[:where])
    assert before == round(depth * fillers)


def test_insert_keeps_needles_at_one_depth_in_the_order_given():
    text = needles.insert("I.", ["a.", "b.", "c.", "d."], [(0.5, "X."), (0.5, "Y."), (0.0, "Z.")], "Q?")
    assert text == "I. Z. a. b. X. Y. c. d.\nQ?"


def test_a_length_below_a_template_is_one_clear_error(tokenizer):
    with pytest.raises(passkey.PromptError, match="cannot hold the multi template"):
        trial(SHAPES["multi"], tokenizer, 60, 0.5, 0, 0)


def test_missed_counts_needles_a_reference_found_and_the_model_did_not():
    records = [{"shape": s, "length": 100, "key": 1, "keys": [1]} for s in ("passkey", "passkey", "multi", "multi")]

    def said(*flags):
        return [{"correct": f, "answered_other": False} for f in flags]

    answers = {
        "original": said(True, True, True, False),
        "converted": said(True, False, False, True),
        "baseline": said(False, True, True, True),
    }
    rows = needles.summarise(records, answers, ["passkey", "multi"], [100], "baseline")
    assert rows["converted"]["accuracy"] == {"passkey": {100: 0.5}, "multi": {100: 0.5}}
    assert rows["converted"]["missed"] == {"original": {"passkey": 1, "multi": 1}, "baseline": {"passkey": 1, "multi": 1}}
    assert rows["baseline"]["missed"] == {"original": {"passkey": 1, "multi": 0}}
    assert rows["original"]["missed"] == {"baseline": {"passkey": 0, "multi": 1}}
    assert rows["original"]["overall"] == 0.75


@pytest.mark.slow
def test_cli_measures_every_model_on_the_same_prompts(converted_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(converted_dir, model)
    out = tmp_path / "needles"
    code, stdout, err = run_cli(
        ["eval", "needles", "--model", str(model), "--shapes", "passkey,prose,multi", "--lengths", "200,256",
         "--depths", "0,1", "--trials", "1", "--output", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads((out / "needles.json").read_text())
    names = list(result["rows"])
    assert names[:3] == ["original", "converted", "converted, state off"]
    assert names[3].startswith("sink_recent(sink=4,window=") and result["baseline"] == names[3]
    assert len(result["records"]) == 3 * 2 * 2
    for record in result["records"]:
        assert record["prompt_tokens"] <= record["length"] - SHAPES[record["shape"]].new_tokens
        assert set(record["answers"]) == set(names)
    for name, row in result["rows"].items():
        hits = [r["answers"][name]["correct"] for r in result["records"] if r["shape"] == "multi" and r["length"] == 256]
        assert row["accuracy"]["multi"]["256"] == sum(hits) / 2
    assert set(result["rows"]["converted"]["missed"]) == {"original", names[3]}
    assert (out / "needles.png").stat().st_size > 0
    assert "| original |" in stdout and "multi 256" in stdout
    (entry,) = evaluations.load(model).values()
    assert "prose needle accuracy, 200 tokens" in entry["rows"]
    assert "Needle tests" in (model / "README.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shapes", "hay"], "--shapes: unknown shape 'hay'; allowed: passkey, prose"),
        (["--shapes", "long,long"], "--shapes: a shape is given twice"),
        (["--shapes", " , "], "--shapes: give at least one of"),
        (["--lengths", "90", "--shapes", "multi"], "--lengths: 90 tokens cannot hold the multi template and its 8-token answer"),
        (["--lengths", "300"], "--lengths: 300 tokens is beyond what the model can take"),
        (["--trials", "0"], "--trials: must be an integer >= 1"),
        (["--baseline", "mamba"], "--baseline: 'mamba' has weights to train"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(converted_dir, args, message, capsys):
    code, _, err = run_cli(["eval", "needles", "--model", str(converted_dir), "--lengths", "256", *args], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_recipe_is_refused(capsys):
    code, _, err = run_cli(["eval", "needles", "--model", "recipes/smollm2_b05.yaml"], capsys)
    assert code == 2 and "give a converted model directory" in err
