"""``rfkit eval passkey``: prompt construction, scoring, aggregation, the command and its bad input."""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from rfkit.evals import passkey
from rfkit.evals.passkey import FILLER_SENTENCES, INSTRUCTION, QUESTION, build_prompt, count_tokens, score


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def needle_position(text: str, key: int) -> tuple[int, int]:
    """(filler sentences before the needle, filler sentences after it)."""
    body = text[len(INSTRUCTION) : text.index("\n" + QUESTION)]
    before, after = body.split(passkey.NEEDLE.format(key=key))
    return tuple(sum(part.count(s) for s in FILLER_SENTENCES) for part in (before, after))


@pytest.mark.parametrize("length", [120, 333, 1024])
def test_prompt_is_at_most_the_target_and_within_one_sentence_of_it(tokenizer, length):
    longest_sentence = max(count_tokens(tokenizer, "x " + s) for s in FILLER_SENTENCES)
    for depth in (0.0, 0.5, 1.0):
        text, tokens = build_prompt(tokenizer, length, depth, 54321)
        assert tokens == len(tokenizer(text)["input_ids"]) <= length
        assert tokens > length - longest_sentence
        assert text.startswith(INSTRUCTION) and text.endswith("\n" + QUESTION)
        assert text.count("54321") == 2


def test_depth_places_the_needle_at_start_middle_and_end(tokenizer):
    text, _ = build_prompt(tokenizer, 400, 0.0, 11111)
    before, after = needle_position(text, 11111)
    assert before == 0 and after > 30
    text, _ = build_prompt(tokenizer, 400, 1.0, 22222)
    before, after = needle_position(text, 22222)
    assert after == 0 and before > 30
    text, _ = build_prompt(tokenizer, 400, 0.25, 33333)
    before, after = needle_position(text, 33333)
    assert before == round(0.25 * (before + after))


def test_a_length_below_the_template_is_one_clear_error(tokenizer):
    need = passkey.template_tokens(tokenizer)
    build_prompt(tokenizer, need, 0.5, 99999)  # fits exactly, with no filler
    with pytest.raises(passkey.PromptError, match="cannot hold the passkey template"):
        build_prompt(tokenizer, need - 1, 0.5, 99999)


def test_score_reads_the_first_integer():
    assert score(" 12345. Remember it.", 12345)
    assert score("12345", 12345)
    assert not score(" 1234 5", 12345)
    assert not score(" 123456", 12345)
    assert not score(" 54321 and 12345", 12345)
    assert not score(" no number here", 12345)


def test_keys_are_seeded_five_digit_and_differ_between_trials():
    keys = [passkey.trial_key(0, 512, 0.5, t) for t in range(20)]
    assert keys == [passkey.trial_key(0, 512, 0.5, t) for t in range(20)]
    assert all(10000 <= k <= 99999 for k in keys) and len(set(keys)) > 15
    assert keys != [passkey.trial_key(1, 512, 0.5, t) for t in range(20)]


def test_aggregation_with_an_oracle_that_only_finds_keys_near_the_question(tokenizer, monkeypatch):
    """A stand-in generator that answers right only when the needle is in the last 200
    characters: depth 1 is always right, depth 0 always wrong, and every mean follows."""

    def oracle(model, tok, prompts, max_new_tokens, batch_size=1, progress=None):
        outs = []
        for prompt in prompts:
            found = re.findall(r"The pass key is (\d{5})\.", prompt[-200:])
            outs.append(f" {found[0]}." if found else " 00000.")
            progress.update(1)
        return outs

    monkeypatch.setattr(passkey, "greedy_generate", oracle)
    result = passkey.evaluate_passkey(None, tokenizer, [150, 300], [0.0, 1.0], 3, seed=7, progress=False)
    cells = {(c["length"], c["depth"]): c for c in result["cells"]}
    assert cells[(150, 1.0)]["accuracy"] == cells[(300, 1.0)]["accuracy"] == 1.0
    assert cells[(150, 0.0)]["accuracy"] == cells[(300, 0.0)]["accuracy"] == 0.0
    assert [r["accuracy"] for r in result["by_length"]] == [0.5, 0.5]
    assert result["overall"] == 0.5 and len(result["records"]) == 12
    assert all(r["correct"] == (r["depth"] == 1.0) for r in result["records"])
    table = passkey.format_table(result)
    assert "| 150 | 0.00 | 1.00 | 0.50 |" in table and "overall accuracy: 0.500" in table


@pytest.mark.slow
def test_cli_on_a_tiny_model_writes_the_table_and_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "pk.json"
    code, stdout, err = run_cli(
        ["eval", "passkey", "--model", str(tiny_model_dir), "--lengths", "100,200", "--depths", "0,1",
         "--trials", "2", "--seed", "3", "--batch-size", "2", "--json", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert len(result["records"]) == 8 and len(result["cells"]) == 4
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for record in result["records"]:
        assert record["key"] == passkey.trial_key(3, record["length"], record["depth"], record["trial"])
        assert record["prompt_tokens"] <= record["length"]
        assert record["correct"] == score(record["output"], record["key"])
    # the recorded output is the model's greedy answer to the rebuilt prompt
    first = result["records"][0]
    text, _ = build_prompt(tokenizer, first["length"], first["depth"], first["key"])
    enc = tokenizer(text, return_tensors="pt")
    new = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(new[0, enc["input_ids"].shape[1] :], skip_special_tokens=True) == first["output"]
    expected = sum(r["correct"] for r in result["records"]) / 8
    assert result["overall"] == expected
    assert "| length | depth 0 | depth 1 | mean |" in stdout and "| 200 |" in stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "300"], "--lengths: 300 tokens plus 8 generated is beyond"),
        (["--lengths", "200", "--new-tokens", "100"], "--lengths: 200 tokens plus 100 generated is beyond"),
        (["--lengths", "40"], "--lengths: 40 tokens cannot hold the passkey template"),
        (["--lengths", "100,abc"], "--lengths: 'abc' is not an integer"),
        (["--lengths", "0"], "--lengths: lengths must be positive"),
        (["--lengths", "100", "--depths", "0,1.5"], "--depths: depths must be in [0, 1]"),
        (["--lengths", "100", "--depths", "half"], "--depths: 'half' is not a number"),
        (["--lengths", "100", "--trials", "0"], "--trials: must be an integer >= 1"),
        (["--lengths", "100", "--seed", "x"], "--seed"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_model_dir, args, message, capsys):
    code, _, err = run_cli(["eval", "passkey", "--model", str(tiny_model_dir), *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
