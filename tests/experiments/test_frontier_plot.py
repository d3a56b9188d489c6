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
