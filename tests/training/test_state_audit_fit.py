"""The ``state_audit`` section of ``rfkit fit``: after training, before the final perplexity and
the save, the audit closes the chosen layers' states; the summary records it, the saved weights
carry the closed gates; bad settings are one line, exit 2, before any model loads."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli, tiny_args

MAMBA_RECIPE = "recipes/smollm2_mamba_b05.yaml"


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


@pytest.mark.slow
def test_fit_reads_the_states_sharper_before_measuring_and_saving(tiny_model_dir, tiny_corpus, tmp_path, capsys, data_cache, monkeypatch):
    """``state_audit.read_sharpness``: trained at 1, the saved model reads every hybrid block at
    the new value, its operator record says so, and the summary's perplexity is that model's."""
    import torch
    from transformers import AutoModelForCausalLM

    from rfkit.data import TextDataModule
    from rfkit.evals.perplexity import evaluate_perplexity
    from rfkit.models.hybrid import HybridWindowAttention

    root = tmp_path / "runs"
    args = [  # a window of 8 in 32-token blocks: the state reads most of each block
        "fit", *tiny_args(tiny_model_dir, tiny_corpus, root), "--model.operator.init_args.window", "8",
        "--state_audit.read_sharpness", "2",
    ]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    run = next(root.glob("lightning_logs/version_*"))
    summary = json.loads((run / "summary.json").read_text())
    blocks = summary["read_sharpness"]["blocks"]
    assert summary["read_sharpness"] == {"trained": 1.0, "read": 2.0, "blocks": blocks} and blocks == 2  # one per tiny layer
    assert "read sharpness: the 2 hybrid blocks, trained at sharpness 1, are read and saved at 2" in out
    config = json.loads((run / "model" / "config.json").read_text())
    assert config["rf_operator"]["init_args"]["sharpness"] == 2.0 and config["rf_operator"]["init_args"]["window"] == 8
    assert "read at sharpness 2 (trained at 1; `state_audit.read_sharpness`)" in (run / "model" / "README.md").read_text()

    saved = AutoModelForCausalLM.from_pretrained(str(run / "model")).eval()
    hybrid = [m for m in saved.modules() if isinstance(m, HybridWindowAttention)]
    assert len(hybrid) == 2 and all(m.sharpness == 2.0 for m in hybrid)
    data = TextDataModule(
        source=str(tiny_corpus), tokenizer=str(tiny_model_dir), seq_len=32, batch_size=2, calibration_samples=4,
        val_blocks=4, split=[0.1, 0.1],
    )  # fmt: skip
    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    with torch.no_grad():
        sharp = evaluate_perplexity(saved, data.val_dataloader())
        for m in hybrid:
            m.sharpness = 1.0
        trained = evaluate_perplexity(saved, data.val_dataloader())
    assert sharp == pytest.approx(summary["ppl_converted"], rel=1e-5)  # measured after the change
    assert abs(trained - sharp) > 1e-6 * sharp  # and the change is one the perplexity sees


@pytest.mark.slow
def test_fit_closes_the_states_a_recipe_names_without_measuring(tiny_model_dir, tiny_corpus, tmp_path, capsys, data_cache):
    """``state_audit.close_layers`` / ``close_heads``: an audit's ``closed`` and ``closed_heads``
    copied into a recipe close the same gates when training ends, before the perplexity and the
    save, with no audit forward."""
    from safetensors.torch import load_file

    root = tmp_path / "runs"
    args = [
        "fit", *tiny_args(tiny_model_dir, tiny_corpus, root),
        "--state_audit.close_layers", "[1, 0]", "--state_audit.close_heads", '{"1": [0]}',
    ]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    assert "closed states: layers 1 (heads 0), 0 (state_audit.close_layers, chosen before training; nothing measured)" in out
    run = next(root.glob("lightning_logs/version_*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["closed_states"] == {"closed": [1, 0], "closed_heads": {"1": [0]}}
    assert "state_audit" not in summary and "audit" not in summary["phases"]  # nothing measured
    card = (run / "model" / "README.md").read_text()
    assert "- Closed states: gates 0 in decoder layers 1 (heads 0), 0, named by the recipe" in card
    weights = load_file(next((run / "model").glob("*.safetensors")))
    gates = {int(k.split(".layers.")[1].split(".")[0]): v for k, v in weights.items() if k.endswith("mixer.gate")}
    assert sorted(gates) == [0, 1] and gates[1].numel() > 1
    assert not gates[0].any()  # the whole layer
    assert gates[1][0] == 0 and gates[1][1:].all()  # only head 0; training opened the others


def test_a_closing_the_model_cannot_take_fails_before_training(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    """Layer and head numbers are checked against the converted model before the first step."""
    for extra, message in [
        (["--state_audit.close_layers", "[2]"], "state_audit.close_layers: layer 2 has no state to close; layers with one: 0, 1"),
        (["--state_audit.close_layers", "[0]", "--state_audit.close_heads", '{"0": [40]}'], "state_audit.close_layers: layer 0 has "),
    ]:
        root = tmp_path / f"runs_{len(extra)}"
        args = ["fit", *tiny_args(tiny_model_dir, tiny_corpus, root), "--model.transfer.steps", "0", *extra]
        code, out, err = run_cli(args, capsys)
        lines = [line for line in err.splitlines() if line.startswith("rfkit: error:")]
        assert code == 2 and len(lines) == 1, err[-2000:]
        assert message in lines[0]
        assert not list(root.rglob("summary.json"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--state_audit.max_layers", "-1"], "state_audit.max_layers: must be an integer >= 0"),
        (["--state_audit.max_layers", "2", "--state_audit.split", "validation"], "state_audit.split: allowed: train, calibration"),
        (["--state_audit.max_layers", "2", "--state_audit.shape", "multi"], "state_audit.shape: allowed: prose, plays"),
        (["--state_audit.max_layers", "2", "--state_audit.lengths", "[]"], "state_audit.lengths: give prompt lengths"),
        (["--state_audit.read_sharpness", "0.5"], "state_audit.read_sharpness: 0.5 is not allowed"),
        (["--state_audit.read_sharpness", "nan"], "state_audit.read_sharpness: expected a number"),
        (["--state_audit.close_layers", "[3, 3]"], "state_audit.close_layers: a list of distinct decoder layer numbers"),
        (["--state_audit.close_layers", "[3]", "--state_audit.close_heads", '{"5": [0]}'], "state_audit.close_heads: layer 5 is not in state_audit.close_layers [3]"),
        (["--state_audit.close_layers", "[3]", "--state_audit.close_heads", '{"3": []}'], "state_audit.close_heads: layer 3: a non-empty list"),
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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--state_audit.read_sharpness", "1.25"], "state_audit.read_sharpness: only rfkit.operators.HybridOperator reads its state with a sharpness; model.operator is rfkit.operators.MambaOperator (use 1)"),
        (["--state_audit.close_layers", "[0]"], "state_audit.close_layers: only rfkit.operators.HybridOperator and rfkit.operators.HybridMambaOperator have a state gate to close; model.operator is rfkit.operators.MambaOperator (use [])"),
    ],
)
def test_a_state_setting_needs_its_operator_before_anything_loads(tiny_model_dir, tiny_corpus, tmp_path, capsys, args, message):
    """The Mamba recipe has no sharpness and no state gate: read_sharpness and close_layers are refused."""
    root = tmp_path / "runs"
    code, out, err = run_cli(["fit", *tiny_args(tiny_model_dir, tiny_corpus, root, recipe=MAMBA_RECIPE), *args], capsys)
    lines = [line for line in err.splitlines() if line.startswith("rfkit: error:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert message in lines[0]
    assert "transfer" not in out
    assert not root.exists() or not any(root.rglob("*.json"))
