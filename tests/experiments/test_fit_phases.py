"""benchmarks/fit_phases.py: a fit's time split into its phases, transfer's capture and training,
and each training step's forward, backward and the rest, by block length."""

from __future__ import annotations

import json

import pytest
from helpers import load_script, tiny_args


@pytest.mark.slow
def test_a_tiny_fit_is_split_into_phases_and_step_parts(tiny_model_dir, tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    phases = load_script("benchmarks/fit_phases.py")
    out = tmp_path / "phases.json"
    root = tmp_path / "run"
    assert phases.main(["--output", str(out), "--profile-step", "1", "--", "fit", *tiny_args(tiny_model_dir, tiny_corpus, root)]) == 0
    result = json.loads(out.read_text())
    assert result["provenance"]["command"].startswith("python benchmarks/fit_phases.py --output ")
    assert set(result["phases_s"]) >= {"load", "transfer", "train"}
    assert result["transfer"]["capture_calls"] >= 1 and result["transfer"]["capture_s"] > 0
    transfer = result["transfer"]
    assert sum(transfer["capture_by_length_s"].values()) == pytest.approx(transfer["capture_s"], abs=0.01)
    parts = transfer["parts_s"]
    assert set(parts) >= {"capture", "evaluate", "gradient steps"} and all(v > 0 for v in parts.values())
    assert sum(parts.values()) <= result["phases_s"]["transfer"] + 0.5  # parts of the stage, not more
    from rfkit.training import transfer as module

    assert module.capture.__module__ == "rfkit.training.transfer"  # put back after the run
    by_length = result["train"]["by_block_length"]
    assert sum(v["steps"] for v in by_length.values()) == 2  # the tiny fit's two steps
    assert len(by_length) == 2  # a short batch and a long block (the recipe's long mix)
    for part in by_length.values():
        assert part["forward_s"] > 0 and part["backward_s"] > 0 and part["rest_s"] >= 0
    assert result["train"]["steps_s"] <= result["phases_s"]["train"] + 0.5
    profile = result["profile"]  # the second step, through torch.profiler
    assert profile["step"] == 1 and profile["tokens"] == result["steps"][1]["tokens"]
    assert profile["regions_s"]["mixer forward"] > 0  # the hooks on the replacement mixers fired
    assert profile["by_kind_s"]["matrix products"] > 0 and profile["by_kind_s"]["the rest"] > 0
    assert profile["top_ops"] and all(o["calls"] >= 1 for o in profile["top_ops"])
    assert [o["self_s"] for o in profile["top_ops"]] == sorted((o["self_s"] for o in profile["top_ops"]), reverse=True)
