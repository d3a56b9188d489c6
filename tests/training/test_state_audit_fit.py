"""The ``state_audit`` section of ``rfkit fit``: after training, before the final perplexity and
the save, the audit closes the chosen layers' states; the summary records it, the saved weights
carry the closed gates; bad settings are one line, exit 2, before any model loads."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli, tiny_args


@pytest.mark.slow
def test_fit_audits_the_states_before_measuring_and_saving(tiny_model_dir, tiny_corpus, tmp_path, capsys, data_cache):
    root = tmp_path / "runs"
    args = [
        "fit", *tiny_args(tiny_model_dir, tiny_corpus, root),
        "--state_audit.max_layers", "2", "--state_audit.lengths", "[160]", "--state_audit.trials", "2",
    ]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    assert "state audit: closed the states of layers" in out
    run = next(root.glob("lightning_logs/version_*"))
    summary = json.loads((run / "summary.json").read_text())
    report = summary["state_audit"]
    assert report["applied"] and report["config"]["split"] == "train" and report["config"]["max_layers"] == 2
    assert len(report["layer_changes"]) == 2  # both tiny layers have a state
    # two target prompts, then the default guards: the long key at depths 0 and 0.5, two each
    assert [(p["shape"], p["depth"], p["guard"]) for p in report["prompts"]] == [("plays", 1.0, False)] * 2 + [("long", 0.0, True)] * 2 + [("long", 0.5, True)] * 2
    assert set(report["guards"]) <= {2, 3, 4, 5} and set(report["targets"]) <= {0, 1}
    assert "audit" in summary["phases"]
    card = (run / "model" / "README.md").read_text()
    from rfkit.conversion.model_card import describe_closed

    assert f"states closed (gates 0) in decoder layers {describe_closed(report)}" in card

    from safetensors.torch import load_file

    weights = load_file(next((run / "model").glob("*.safetensors")))
    gates = {int(k.split(".layers.")[1].split(".")[0]): v for k, v in weights.items() if k.endswith("mixer.gate")}
    for layer in report["closed"]:  # the saved model is the audited one
        shut = report["closed_heads"].get(str(layer), range(gates[layer].numel()))
        assert not gates[layer][list(shut)].any()
    for layer in set(gates) - set(report["closed"]):  # training opened the others' gates
        assert gates[layer].any()
    # the gates the audit started from, head by head: the saved ones but where it closed
    assert sorted(map(int, report["gates_before"])) == sorted(gates)
    for layer, values in report["gates_before"].items():
        shut = set(report["closed_heads"].get(layer, range(len(values)))) if int(layer) in report["closed"] else set()
        assert [0.0 if h in shut else v for h, v in enumerate(values)] == gates[int(layer)].tolist()
        assert any(v != 0.0 for v in values)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--state_audit.max_layers", "-1"], "state_audit.max_layers: must be an integer >= 0"),
        (["--state_audit.max_layers", "2", "--state_audit.split", "validation"], "state_audit.split: allowed: train, calibration"),
        (["--state_audit.max_layers", "2", "--state_audit.shape", "multi"], "state_audit.shape: allowed: prose, plays"),
        (["--state_audit.max_layers", "2", "--state_audit.lengths", "[]"], "state_audit.lengths: give prompt lengths"),
    ],
)
def test_bad_audit_settings_are_one_line_before_anything_loads(tiny_model_dir, tiny_corpus, tmp_path, capsys, args, message):
    root = tmp_path / "runs"
    code, _, err = run_cli(["fit", *tiny_args(tiny_model_dir, tiny_corpus, root), *args], capsys)
    lines = [line for line in err.splitlines() if line.startswith("rfkit: error:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert message in lines[0]
    assert not root.exists() or not any(root.rglob("*.json"))


@pytest.mark.slow
def test_lengths_that_cannot_hold_the_prompt_fail_before_training(tiny_model_dir, tiny_corpus, tmp_path, capsys, data_cache):
    root = tmp_path / "runs"
    args = ["fit", *tiny_args(tiny_model_dir, tiny_corpus, root), "--state_audit.max_layers", "1", "--state_audit.lengths", "[80]"]
    code, out, err = run_cli(args, capsys)
    lines = [line for line in err.splitlines() if line.startswith("rfkit: error:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert "state_audit.lengths: 80 tokens cannot hold the plays prompt" in lines[0]
    assert "transfer" not in out and not list(root.rglob("summary.json"))

