"""benchmarks/state_by_layer.py: the per-layer state ablation at a length, on the tiny converted model."""

from __future__ import annotations

import json
import math

import pytest

from helpers import load_script, one_state_open


@pytest.mark.slow
def test_each_layers_state_alone_off_and_the_split_losses(converted_dir, tiny_corpus, tmp_path):

    script = load_script("benchmarks/state_by_layer.py")
    model = tmp_path / "model"
    first, gates = one_state_open(converted_dir, model)  # only the first converted layer's state counts
    out = tmp_path / "report"
    assert script.main([str(model), "--source", str(tiny_corpus), "--length", "64", "--split", "32", "--output", str(out)]) == 0
    result = json.loads((out / "state_by_layer.json").read_text())
    assert result["length"] == 64 and result["blocks"] == 1 and "provenance" in result
    layers = {row["layer"]: row for row in result["layers"]}
    assert len(layers) == len(gates)
    opened = int(first.split(".layers.")[1].split(".")[0])
    for layer, row in layers.items():
        if layer == opened:  # the only state that does anything
            assert row["delta_all"] != 0.0
        else:  # a closed gate: switching the state off changes nothing
            assert row["delta_all"] == 0.0 and row["delta_before"] == 0.0 and row["delta_after"] == 0.0
    on, off = result["ppl_ratio"]["state_on"], result["ppl_ratio"]["state_off"]
    assert on["all"] != off["all"]
    assert math.log(off["all"]) - math.log(on["all"]) == pytest.approx(layers[opened]["delta_all"], abs=2e-4)
    assert "| layer | all | before 32 | from 32 on |" in (out / "state_by_layer.md").read_text()
    # by position: spans of 8 predicted positions (the default, an eighth) cover the 63 of a
    # 64-token block, and their token-weighted log ratios add up to the whole block's
    spans = result["by_span"]
    assert [(s["from"], s["to"]) for s in spans] == [(a, a + 8) for a in range(0, 56, 8)] + [(56, 63)]  # an eighth: 8
    for key, whole in (("state_on", on["all"]), ("state_off", off["all"])):
        weighted = sum((s["to"] - s["from"]) * math.log(s[key]) for s in spans) / 63
        assert weighted == pytest.approx(math.log(whole), abs=1e-3)
    assert any(s["state_on"] != s["state_off"] for s in spans)

    # without the per-layer rows: the same totals from two forwards, no layer table
    quick = tmp_path / "quick"
    assert script.main([str(model), "--source", str(tiny_corpus), "--length", "64", "--split", "32", "--span", "32", "--no-layers", "--output", str(quick)]) == 0
    fast = json.loads((quick / "state_by_layer.json").read_text())
    assert fast["layers"] == [] and fast["ppl_ratio"] == result["ppl_ratio"]
    assert [(s["from"], s["to"]) for s in fast["by_span"]] == [(0, 32), (32, 63)]
    assert "| layer |" not in (quick / "state_by_layer.md").read_text()


def test_a_split_outside_the_block_is_refused():
    script = load_script("benchmarks/state_by_layer.py")
    with pytest.raises(SystemExit, match="--split: 64 is not allowed"):
        script.report("unused", "embedded:shakespeare", 64, 1, 64)
    with pytest.raises(SystemExit, match="--span: 0 is not allowed"):
        script.report("unused", "embedded:shakespeare", 64, 1, 32, span=0)
