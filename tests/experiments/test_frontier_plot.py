"""benchmarks/frontier_plot.py on committed sweep results: one point per row, one figure."""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, load_script

SWEEP = ROOT / "benchmarks" / "results" / "policies_smollm2" / "sweep.json"


def test_every_row_becomes_a_point_at_its_cache_and_long_document_ratio(tmp_path):
    script = load_script("benchmarks/frontier_plot.py")
    # the same rows measured twice (a later sweep repeating a training-free row) are one point each
    assert script.main([str(SWEEP), str(SWEEP), "--length", "8192", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "frontier.json").read_text())
    rows = json.loads(SWEEP.read_text())["rows"]
    assert len(result["points"]) == len(rows) == 6 and "provenance" in result
    first = result["points"][0]
    assert first["cache_ratio"] == rows[0]["cache_ratio"] and first["ppl_ratio"] == rows[0]["long_ppl_ratio"]["shakespeare@8192"]
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweeps_measured_on_other_long_documents_are_not_mixed(tmp_path):
    other = json.loads(SWEEP.read_text())
    other["long"]["blocks"] = {k: v * 2 for k, v in other["long"]["blocks"].items()}
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    script = load_script("benchmarks/frontier_plot.py")
    with pytest.raises(SystemExit, match="differ from the first file's"):
        script.main([str(SWEEP), str(path), "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="no long documents of 4096 tokens"):
        script.main([str(SWEEP), "--length", "4096", "--output", str(tmp_path / "out")])


def test_skip_model_leaves_out_one_trained_model_of_a_shared_label(tmp_path):
    sweep = ROOT / "benchmarks" / "results" / "levers_smollm2_recall" / "sweep.json"
    rows = json.loads(sweep.read_text())["rows"]
    script = load_script("benchmarks/frontier_plot.py")
    # two trained models share a label at beta 0.75: without --skip-model the first one is drawn
    assert script.main([str(sweep), "--length", "8192", "--output", str(tmp_path / "all")]) == 0
    first = [r for r in rows if r.get("trained") and r["beta"] == 0.75 and not r["operator"].endswith("state off")]
    assert len(first) == 2
    drawn = json.loads((tmp_path / "all" / "frontier.json").read_text())["points"]
    trained = [p for p in drawn if p["beta"] == 0.75 and p["label"].endswith("trained")]
    assert [p["ppl_ratio"] for p in trained] == [first[0]["long_ppl_ratio"]["shakespeare@8192"]]
    skip = first[0]["model"].split("/")[1]  # its run directory
    assert script.main([str(sweep), "--length", "8192", "--skip-model", skip, "--output", str(tmp_path / "one")]) == 0
    result = json.loads((tmp_path / "one" / "frontier.json").read_text())
    trained = [p for p in result["points"] if p["beta"] == 0.75 and p["label"].endswith("trained")]
    assert [p["ppl_ratio"] for p in trained] == [first[1]["long_ppl_ratio"]["shakespeare@8192"]]
    assert result["skipped"] == [skip]

