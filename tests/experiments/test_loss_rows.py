"""benchmarks/loss_rows.py: the plain CE + KL expressions against rowwise_loss (compiled, and its
PyTorch twin), timed side by side."""

from __future__ import annotations

import json

from helpers import load_script


def test_both_loss_forms_are_timed_and_agree(tmp_path):
    bench = load_script("benchmarks/loss_rows.py")
    out = tmp_path / "kl.json"
    assert bench.main(["--shape", "2x37x33", "--dtype", "float32", "--runs", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"] == [2, 37, 33] and set(result["median_s"]) == {"plain", "rowwise", "rowwise_pytorch"}
    assert result["compiled"] is True and result["speedup_over_pytorch_rowwise"] > 0
    assert all(len(ts) == 2 and min(ts) > 0 for ts in result["seconds"].values())
    assert result["value_difference"] < 1e-5 and result["grad_max_difference"] < 1e-7 < result["grad_max"]
    assert result["provenance"]["command"].startswith("python benchmarks/loss_rows.py --shape 2x37x33")
