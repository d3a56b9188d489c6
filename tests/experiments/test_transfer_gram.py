"""benchmarks/transfer_gram.py: transfer's output-space loss with its Gram product in float32 and in
bf16, timed side by side at a head map's shapes."""

from __future__ import annotations

import json

from helpers import load_script


def test_both_gram_dtypes_are_timed_and_agree_to_bf16s_rounding(tmp_path):
    bench = load_script("benchmarks/transfer_gram.py")
    head_map = tmp_path / "head_map.json"
    head_map.write_text(json.dumps({"selected": [[0, 1], [], [2], [0, 1, 2]]}))
    out = tmp_path / "gram.json"
    args = ["--head-map", str(head_map), "--skip-layers", "3", "--batches", "2x16,1x40", "--hidden", "24",
            "--head-dim", "8", "--runs", "2", "--output", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert result["widths"] == [16, 8] and result["skipped_layers"] == [3]  # the empty layer and layer 3 left out
    assert result["batches"] == [[2, 16], [1, 40]]
    assert all(len(ts) == 2 and min(ts) > 0 for ts in result["seconds"].values())
    assert 0 < result["loss_max_rel_difference"] < 1e-2 and 0 < result["grad_max_rel_difference"] < 3e-2
    assert result["provenance"]["command"].startswith("python benchmarks/transfer_gram.py --head-map ")
