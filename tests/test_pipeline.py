"""The pipeline's named steps (rfkit/pipeline.py): ``rfkit fit``, ``rfkit convert`` and ``rfkit profile``
run them, and a model spec is resolved once per run, its resolution serving the config, the
weights and the tokenizer."""

from __future__ import annotations

import sys

import pytest
from helpers import run_cli, tiny_args

import rfkit.hub
import rfkit.pipeline

STEPS = ("resolve", "load", "profile", "select", "measure", "convert", "improve", "save", "save_head_map")


@pytest.fixture
def resolutions(monkeypatch):
    """Every call of :func:`rfkit.hub.resolve_model`, wherever a module bound it by name: the
    names it was asked to resolve, in order."""
    real = rfkit.hub.resolve_model
    calls: list[str] = []

    def counting(name):
        calls.append(str(name))
        return real(name)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("rfkit") and getattr(module, "resolve_model", None) is real:
            monkeypatch.setattr(module, "resolve_model", counting)
    return calls


@pytest.fixture
def steps(monkeypatch):
    """The pipeline steps called, in order (each still does its work)."""
    called: list[str] = []
    for name in STEPS:
        real = getattr(rfkit.pipeline, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(rfkit.pipeline, name, recording)
    return called


def test_a_saved_models_base_is_resolved_once_for_its_config_weights_and_tokenizer(converted_dir, resolutions):
    from rfkit.config.loading import load_model
    from rfkit.conversion.headmap import HeadMap

    base = HeadMap.load(converted_dir / "head_map.json").model
    loaded = load_model(str(converted_dir), original=True)
    assert not loaded.converted and loaded.base_model == base
    assert resolutions == [base]


def test_a_model_source_is_not_resolved_again():
    source = rfkit.hub.resolve_source(".")
    assert rfkit.hub.resolve_source(source) is source
    assert rfkit.pipeline.resolve(source) is source


CONVERSION = ["resolve", "load", "profile", "select", "measure", "convert", "improve", "measure", "save"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, extra, expected",
    [
        ("fit", [], CONVERSION),
        ("convert", ["--output", "{tmp}/converted"], CONVERSION),
        ("profile", ["--output", "{tmp}/profiled/head_map.json", "--report", "false"], ["resolve", "load", "profile", "select", "save_head_map"]),
    ],
)  # fmt: skip
def test_fit_convert_and_profile_run_the_pipeline_steps_and_resolve_the_model_once(
    command, extra, expected, tiny_model_dir, tiny_corpus, tmp_path, capsys, steps, resolutions
):
    extra = [arg.replace("{tmp}", str(tmp_path)) for arg in extra]
    code, out, err = run_cli([command, *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), *extra], capsys)
    assert code == 0, err
    assert steps == expected
    assert resolutions == [str(tiny_model_dir)]  # the data's tokenizer, the long blocks and the model share it
