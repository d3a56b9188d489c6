"""benchmarks/state_audit.py: the fit's state audit on a saved model, writing a copy with the
chosen states closed, on the tiny converted model with one layer's state open."""

from __future__ import annotations

import json

import pytest

from helpers import floor_the_state_turns_away, load_script, one_state_open

SMALL = ["--lengths", "160", "--depths", "0,0.5,1", "--trials", "3", "--guards", ""]


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
    floor = floor_the_state_turns_away(on, off)  # quotes the opened state turns away
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


@pytest.mark.slow
def test_gates_from_a_fits_checkpoint_start_the_audit_from_the_trained_gates(converted_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    script = load_script("benchmarks/state_audit.py")
    src = tmp_path / "model"
    first, gates = one_state_open(converted_dir, src)  # as a fit's own audit leaves it: closed gates
    weights = load_file(next(src.glob("*.safetensors")))
    trained = {name: torch.full_like(weights[name], 0.5) for name in gates}  # what training left
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"model." + name: value for name, value in trained.items()}}, ckpt)
    dst = tmp_path / "reopened"
    # nothing closed (a floor below every margin), yet the copy is written: its gates are new
    assert script.main([str(src), str(dst), *SMALL, "--min-margin", "-1000", "--gates-from", str(ckpt)]) == 0
    report = json.loads((dst / "state_audit.json").read_text())
    assert report["closed"] == [] and report["gates_from"] == {"checkpoint": str(ckpt), "step": None, "reset": gates}
    got = load_file(next(dst.glob("*.safetensors")))
    assert all(torch.equal(got[name], trained[name]) for name in gates)
    # a checkpoint of another model, or no file: one line, exit 2 or a stop naming the flag
    assert script.main([str(src), str(tmp_path / "x"), *SMALL, "--gates-from", str(tmp_path / "missing.ckpt")]) == 2
    torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
    with pytest.raises(SystemExit, match="--gates-from: .* has no gate"):
        script.main([str(src), str(tmp_path / "y"), *SMALL, "--gates-from", str(tmp_path / "other.ckpt")])


@pytest.mark.slow
def test_gates_from_a_fits_summary_start_the_audit_from_the_gates_its_audit_started_from(converted_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    from rfkit.config.loading import load_model
    from rfkit.training.state_audit import gate_slots, stateful_layers

    script = load_script("benchmarks/state_audit.py")
    src = tmp_path / "model"
    first, gates = one_state_open(converted_dir, src)
    layers = stateful_layers(load_model(str(src)).model)
    before = {str(i): [0.25 + 0.125 * h for h in range(len(gate_slots(m)))] for i, m in layers.items()}  # as a fit's audit records them
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"state_audit": {"gates_before": before}}))
    dst = tmp_path / "reopened"
    assert script.main([str(src), str(dst), *SMALL, "--min-margin", "-1000", "--gates-from", str(summary)]) == 0
    report = json.loads((dst / "state_audit.json").read_text())
    assert report["gates_from"]["summary"] == str(summary) and report["gates_before"] == before  # the audit started there
    got = load_file(next(dst.glob("*.safetensors")))
    for name in [first, *gates]:
        layer = name.split(".layers.")[1].split(".")[0]
        assert got[name].tolist() == before[layer]
    # another model's gates, or a summary without an audit: a stop naming the flag
    summary.write_text(json.dumps({"state_audit": {"gates_before": {"0": [1.0]}}}))
    with pytest.raises(SystemExit, match="--gates-from: .* not this model's"):
        script.main([str(src), str(tmp_path / "y"), *SMALL, "--gates-from", str(summary)])
    summary.write_text(json.dumps({"ppl_ratio": 1.0}))
    capsys.readouterr()
    assert script.main([str(src), str(tmp_path / "z"), *SMALL, "--gates-from", str(summary)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gates-from: " in err[0] and "has no state audit's gates_before" in err[0]
