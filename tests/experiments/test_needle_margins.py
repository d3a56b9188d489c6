"""benchmarks/needle_margins.py: the first answer token's margin on needle prompts, per layer's
state, on the tiny converted model."""

from __future__ import annotations

import json

import pytest

from helpers import load_script, one_state_open


@pytest.mark.slow
def test_each_layers_state_alone_off_moves_only_its_own_margin(converted_dir, tmp_path):
    from transformers import AutoTokenizer

    from rfkit.evals import needles

    script = load_script("benchmarks/needle_margins.py")
    model = tmp_path / "model"
    first, gates = one_state_open(converted_dir, model)  # only the first converted layer's state counts
    out = tmp_path / "report"
    args = [str(model), "--shape", "passkey", "--lengths", "160", "--depths", "0,1", "--trials", "1", "--output", str(out)]
    assert script.main(args) == 0
    result = json.loads((out / "needle_margins.json").read_text())
    assert "provenance" in result and len(result["prompts"]) == 2
    # the prompts and keys are the ones rfkit eval needles asks with the same settings
    tok = AutoTokenizer.from_pretrained(str(model))
    asked = needles.prompts(tok, [needles.SHAPES["passkey"]], [160], [0.0, 1.0], 1, 0)
    assert [p["key"] for p in result["prompts"]] == [r["key"] for r in asked]
    for p, r in zip(result["prompts"], asked):  # the answer's first token: the key's, as it follows the prompt
        assert p["key_token"] == tok(r["text"] + f" {r['key']}")["input_ids"][len(tok(r["text"])["input_ids"])]
    rows = result["rows"]
    assert set(rows) == {"original", "every state on", "every state off"}
    opened = int(first.split(".layers.")[1].split(".")[0])
    layers = {row["layer"]: row for row in result["layers"]}
    assert len(layers) == len(gates)
    for layer, row in layers.items():
        if layer == opened:  # the only state that does anything: off alone is every state off
            assert row["margins"] == rows["every state off"] and any(c != 0 for c in row["change"])
        else:  # a closed gate: switching the state off changes nothing
            assert row["margins"] == rows["every state on"] and all(c == 0 for c in row["change"])
    # a margin above 0 is a greedy answer that starts with the key's token
    for margin, p in zip(rows["every state on"], result["prompts"]):
        assert (margin > 0) == (p["top_with_state"] == tok.decode([p["key_token"]]))
    assert "| layer |" in (out / "needle_margins.md").read_text()


def test_a_shape_with_several_keys_is_refused(tmp_path):
    script = load_script("benchmarks/needle_margins.py")
    with pytest.raises(SystemExit, match="--shape: multi hides several keys"):
        script.main([str(tmp_path), "--shape", "multi"])


@pytest.mark.slow
def test_the_whole_key_margin_is_the_weakest_of_its_tokens(converted_dir, tmp_path):
    """--token whole: the smallest margin over the key's tokens, never above the first token's."""
    from transformers import AutoTokenizer

    script = load_script("benchmarks/needle_margins.py")
    common = [str(converted_dir), "--shape", "long", "--lengths", "160", "--depths", "0,1", "--trials", "1"]
    assert script.main([*common, "--output", str(tmp_path / "first")]) == 0
    assert script.main([*common, "--token", "whole", "--output", str(tmp_path / "whole")]) == 0
    first = json.loads((tmp_path / "first" / "needle_margins.json").read_text())
    whole = json.loads((tmp_path / "whole" / "needle_margins.json").read_text())
    assert first["token"] == "first" and whole["token"] == "whole"
    assert [p["key"] for p in whole["prompts"]] == [p["key"] for p in first["prompts"]]
    digits = len(str(whole["prompts"][0]["key"]))
    tok = AutoTokenizer.from_pretrained(str(converted_dir))
    assert len(tok(" " + str(whole["prompts"][0]["key"]))["input_ids"]) >= digits  # a key of many tokens
    for name in whole["rows"]:
        for w, f in zip(whole["rows"][name], first["rows"][name]):
            assert w <= f + 1e-9, name
    assert any(w < f for w, f in zip(whole["rows"]["every state on"], first["rows"]["every state on"]))
    assert all(0 <= p["weakest_with_state"] < digits + 1 for p in whole["prompts"])
    assert "weakest key token" in (tmp_path / "whole" / "needle_margins.md").read_text()
