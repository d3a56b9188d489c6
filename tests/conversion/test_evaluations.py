"""Evaluations kept with a converted model: evaluations.json and the card's section."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_cli

from rfkit.conversion import evaluations

CARD = "# tiny\n\nabout\n\n## Measured results\n\nrows\n\n## Recipe\n\n```yaml\nseed: 0\n```\n"


def _dir(tmp_path):
    (tmp_path / "head_map.json").write_text("{}")
    (tmp_path / "README.md").write_text(CARD)
    return tmp_path


def test_columns_merge_and_the_card_section_sits_before_the_recipe(tmp_path):
    model = _dir(tmp_path)
    evaluations.record(model, "k", "Passkey", {"accuracy, 1,024 tokens": {"converted": 0.5}}, {"converted": "cmd A"}, {"accuracy, 1,024 tokens": ".2f"})
    evaluations.record(model, "k", "Passkey", {"accuracy, 1,024 tokens": {"original": 1.0}}, {"original": "cmd B"})
    (entry,) = evaluations.load(model).values()
    assert entry["rows"] == {"accuracy, 1,024 tokens": {"converted": 0.5, "original": 1.0}}
    assert entry["commands"] == {"converted": "cmd A", "original": "cmd B"}
    card = (model / "README.md").read_text()
    # original first whatever the order measured; the ratio is converted / original
    assert "| measure | original | converted | converted / original |" in card
    assert "| accuracy, 1,024 tokens | 1.00 | 0.50 | 0.500 |" in card
    assert card.index(evaluations.START) > card.index("## Measured results")
    assert card.index(evaluations.END) < card.index("## Recipe")
    assert card.count(evaluations.START) == 1 and "seed: 0" in card
    assert "- original (" in card and "): `cmd B`" in card and "- converted (" in card


def test_columns_measured_by_one_command_share_its_line(tmp_path):
    model = _dir(tmp_path)
    evaluations.record(model, "k", "Sweep", {"x": {"original": 1.0, "converted": 2.0}}, {"original": "cmd", "converted": "cmd"})
    card = (model / "README.md").read_text()
    assert card.count("`cmd`") == 1 and "- original, converted (" in card


def test_rewriting_the_section_is_stable_and_keys_keep_separate_tables(tmp_path):
    model = _dir(tmp_path)
    evaluations.record(model, "a", "First", {"x": {"converted": 2.0}})
    evaluations.record(model, "b", "Second", {"y": {"original": 3.0, "baseline": 4.0}})
    once = (model / "README.md").read_text()
    evaluations.record(model, "b", "Second", {"y": {"original": 3.0}})  # same values again
    assert (model / "README.md").read_text() == once
    assert once.count("### ") == 2 and "| y | 3 | 4 |" in once  # no converted column: no ratio
    assert json.loads((model / evaluations.FILE).read_text())["records"]["a"]["rows"]["x"] == {"converted": 2.0}


def test_a_card_without_recipe_gets_the_section_at_the_end_and_other_dirs_are_left_alone(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "head_map.json").write_text("{}")
    (model / "README.md").write_text("# card\n")
    evaluations.record(model, "a", "First", {"x": {"converted": 1.0}})
    text = (model / "README.md").read_text()
    assert text.startswith("# card\n\n" + evaluations.START) and text.rstrip().endswith(evaluations.END)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert evaluations.add_to_model(plain, "a", "First", {"x": {"converted": 1.0}}, "cmd") is None
    assert not (plain / evaluations.FILE).exists()


@pytest.mark.slow
def test_ppl_of_the_converted_model_and_of_its_original_fill_one_table(converted_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(converted_dir, model)
    argv = ["eval", "ppl", "--model", str(model), "--val-blocks", "2", "--block-size", "128"]  # past the 60-token window
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "added to the model card" in err
    code, _, err = run_cli([*argv, "--original"], capsys)
    assert code == 0, err
    (entry,) = evaluations.load(model).values()
    cells = entry["rows"]["perplexity"]
    assert set(cells) == {"original", "converted"} and cells["original"] != cells["converted"]
    assert entry["commands"]["original"] == "rfkit " + " ".join([*argv, "--original"])
    assert f"| perplexity | {cells['original']:.3f} | {cells['converted']:.3f} |" in (model / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "task, args, measure",
    [
        ("passkey", ["--lengths", "100", "--depths", "0", "--trials", "1"], "accuracy, 100 tokens"),
        ("hashhop", ["--samples", "2", "--hops", "2", "--chars", "200", "--max-new-tokens", "5"], "h_gq"),
    ],
)
def test_generation_evals_add_their_score_to_the_card(converted_dir, tmp_path, capsys, task, args, measure):
    model = tmp_path / "model"
    shutil.copytree(converted_dir, model)
    out = tmp_path / "r.json"
    code, _, err = run_cli(["eval", task, "--model", str(model), *args, "--json", str(out)], capsys)
    assert code == 0, err
    result = json.loads(out.read_text())
    expected = result["by_length"][0]["accuracy"] if task == "passkey" else result["h_gq"]
    (entry,) = evaluations.load(model).values()
    assert entry["rows"][measure] == {"converted": expected}
    assert f"| {measure} | " in (model / "README.md").read_text()
