"""Safe loading: safetensors weights only, weights_only checkpoints, no remote code by default."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMOLLM, run_cli, tiny_args
from safetensors.torch import load_file

from rfkit.training.module import RecurFormerModule

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "rfkit").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")])


def calls(name: str):
    """(file, call node) for every call of ``<anything>.name(...)`` in rfkit's sources."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
                yield path, node


def keyword(node: ast.Call, name: str):
    for kw in node.keywords:
        if kw.arg == name:
            return kw.value
    return None


def test_every_torch_load_passes_weights_only_true():
    found = [(p, n) for p, n in calls("load") if isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"]
    assert found, "expected torch.load calls to check"
    for path, node in found:
        value = keyword(node, "weights_only")
        assert isinstance(value, ast.Constant) and value.value is True, f"{path.name}:{node.lineno}"


@pytest.mark.slow
def test_every_model_load_asks_for_safetensors():
    """Weights come from safetensors files (or the embedded GGUF, which is not pickle)."""
    found = [
        (p, n) for p, n in calls("from_pretrained")
        if isinstance(n.func.value, ast.Name) and n.func.value.id.endswith("ForCausalLM")
    ]  # fmt: skip
    assert len(found) >= 3
    for path, node in found:
        safe = keyword(node, "use_safetensors")
        gguf = keyword(node, "gguf_file")
        assert (isinstance(safe, ast.Constant) and safe.value is True) or gguf is not None, f"{path.name}:{node.lineno}"


@pytest.mark.slow
def test_a_model_with_only_pickle_weights_is_refused_in_one_line(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    pickled = tmp_path / "pickled-llama"
    pickled.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (pickled / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(tiny_model_dir / "model.safetensors"), pickled / "pytorch_model.bin")
    root = tmp_path / "run"
    code, out, err = run_cli(["fit", *tiny_args(pickled, tiny_corpus, root), "--model.base_model", str(pickled)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("rfkit: error: model.base_model:") and "safetensors" in lines[-1], err
    assert "Traceback" not in err
    assert not root.exists()


def test_trust_remote_code_is_off_by_default_and_settable_in_a_recipe(tmp_path):
    assert inspect.signature(RecurFormerModule).parameters["trust_remote_code"].default is False
    for recipe in RECIPES:
        assert "trust_remote_code: true" not in recipe.read_text(), recipe.name
    from rfkit.config.lightning_cli import make_cli

    cli = make_cli(
        ["--config", SMOLLM, "--model.trust_remote_code", "true", "--trainer.accelerator", "cpu"],
        run=False,
        trainer_defaults={"logger": False, "enable_checkpointing": False},
    )
    assert cli.model.trust_remote_code is True


@pytest.mark.slow
def test_a_model_that_needs_remote_code_is_refused_without_the_flag(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    custom = tmp_path / "custom-model"
    custom.mkdir()
    for f in tiny_model_dir.iterdir():
        (custom / f.name).write_bytes(f.read_bytes())
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomModel"}
    config["model_type"] = "custom-remote"
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    root = tmp_path / "run"
    code, out, err = run_cli(["fit", *tiny_args(custom, tiny_corpus, root), "--model.base_model", str(custom)], capsys)
    assert code == 2
    assert "remote code ran" not in out + err
    line = err.strip().splitlines()[-1]
    assert line.startswith("rfkit: error: model.base_model:") and "trust_remote_code" in line, err
    assert not root.exists()
