"""benchmarks/state_audit.py: the fit's state audit on a saved model, writing a copy with the
chosen states closed, on the tiny converted model with one layer's state open."""

from __future__ import annotations

import json

import pytest

from helpers import load_script, one_state_open

SMALL = ["--lengths", "192", "--depths", "0.5", "--trials", "3"]


@pytest.mark.slow
def test_the_audited_copy_has_the_chosen_state_closed(converted_dir, tmp_path):
    from safetensors.torch import load_file

    script = load_script("benchmarks/state_audit.py")
    src = tmp_path / "model"
    first, gates = one_state_open(converted_dir, src)
    # a floor below every margin: every key counts as quoted, nothing is closed, no copy written
    assert script.main([str(src), str(tmp_path / "none"), *SMALL, "--min-margin", "-1000"]) == 0
    measured = json.loads((tmp_path / "none.state_audit.json").read_text())
    assert measured["closed"] == [] and not (tmp_path / "none").exists() and "provenance" in measured
    on, off = measured["every_state_on"], measured["every_state_off"]
    worst = max(range(len(on)), key=lambda i: off[i] - on[i])
    assert off[worst] > on[worst]
    floor = (on[worst] + off[worst]) / 2  # a quote the opened state turns away
    dst = tmp_path / "audited"
    assert script.main([str(src), str(dst), *SMALL, "--min-margin", str(floor)]) == 0
    report = json.loads((dst / "state_audit.json").read_text())
    opened = int(first.split(".layers.")[1].split(".")[0])
    assert report["closed"] == [opened] and report["all_targets_quoted"] and report["audited_model"] == str(dst)
    weights = load_file(next(dst.glob("*.safetensors")))
    assert not weights[first].any() and all(not weights[g].any() for g in gates)  # the others were closed already


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--split", "validation"], "state_audit.split: allowed: train, calibration"),
        (["--max-layers", "0"], "state_audit.max_layers"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(converted_dir, tmp_path, capsys, args, message):
    script = load_script("benchmarks/state_audit.py")
    assert script.main([str(converted_dir), str(tmp_path / "dst"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not (tmp_path / "dst").exists()
