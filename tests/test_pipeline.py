"""The pipeline's named steps (rfkit/pipeline.py): ``rfkit fit``, ``rfkit convert`` and ``rfkit profile``
run them, ``rfkit eval``, ``rfkit bench`` and ``rfkit sweep`` load through them, and a model spec is
resolved once per run, its resolution serving the config, the weights and the tokenizer."""

from __future__ import annotations

import sys

import pytest
import yaml
from helpers import SMOLLM, run_cli, tiny_args

import rfkit.data.datamodule  # noqa: F401  (binds resolve_model by name: imported before resolutions counts)
import rfkit.hub
import rfkit.pipeline

STEPS = ("resolve", "load", "load_saved", "profile", "select", "measure", "convert", "improve", "save", "save_head_map")


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


# -- the commands that load a model to measure it walk the same steps -------------------------
@pytest.fixture(scope="module")
def tiny_recipe(tiny_model_dir, tiny_corpus, tmp_path_factory):
    """The default recipe at the tiny model's scale (tiny_args' settings; one transfer step), as a file."""
    config = yaml.safe_load(open(SMOLLM))
    config["model"]["base_model"] = str(tiny_model_dir)
    config["model"]["policy"]["init_args"]["window"] = 4
    config["model"]["transfer"].update(steps=1, long_source=str(tiny_corpus), long_seq_len=48, long_samples=1)
    config["data"].update(
        source=str(tiny_corpus), seq_len=32, batch_size=2, calibration_samples=4, val_blocks=4, split=[0.1, 0.1],
        long_source=None,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("recipe") / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def fresh_data(monkeypatch, tmp_path):
    """An empty packed-block cache: every command tokenises its data, so a tokenizer that
    resolved the model again would be counted."""
    from rfkit.data import datamodule

    monkeypatch.setattr(datamodule, "data_cache_dir", lambda: tmp_path / "data-cache")


MEASURING = {  # command -> its arguments after --model SPEC ({corpus} filled in)
    "eval ppl": ["--source", "{corpus}", "--block-size", "32", "--val-blocks", "2"],
    "eval passkey": ["--lengths", "100", "--depths", "0", "--trials", "1"],
    "bench cache": ["--lengths", "6", "--prompt-len", "2", "--no-peak"],
    "bench speed": ["--contexts", "16", "--runs", "1", "--decode-tokens", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, given",
    [(command, given) for command in MEASURING for given in ("directory", "recipe") if (command, given) != ("bench speed", "recipe")],
)  # bench speed loads its pair as bench cache does
def test_measuring_commands_resolve_the_base_once_and_load_through_the_pipeline(
    command, given, converted_dir, tiny_recipe, tiny_model_dir, tiny_corpus, tmp_path, capsys, steps, resolutions, fresh_data
):
    """``rfkit eval`` and ``rfkit bench``, given a saved converted directory (``--original`` for the
    evaluations: they then need the base) or a recipe converted on the spot: the base model's
    spec is resolved once, for its config, weights and tokenizer and the data's tokenizer, and
    its weights load through :func:`rfkit.pipeline.load`."""
    spec = str(converted_dir) if given == "directory" else str(tiny_recipe)
    extra = [a.replace("{corpus}", str(tiny_corpus)) for a in MEASURING[command]]
    if command.startswith("eval") and given == "directory":
        extra.append("--original")
    code, out, err = run_cli([*command.split(), "--model", spec, *extra, "--no-record"], capsys)
    assert code == 0, err
    assert resolutions == [str(tiny_model_dir)]
    bench = command.startswith("bench")
    if given == "directory":  # bench: the converted model as saved, then the original; eval --original: the original
        assert steps == (["load_saved"] if bench else []) + ["resolve", "load"]
    elif bench:  # the architecture rfkit convert saves, without its transfer or adapters; then the original
        assert steps == [step for step in CONVERSION[:-1] if step != "improve"] + ["load"]
    else:  # converted as rfkit convert converts, without saving
        assert steps == CONVERSION[:-1]


@pytest.mark.slow
def test_eval_context_resolves_the_base_once(converted_dir, tiny_model_dir, tiny_corpus, tmp_path, capsys, steps, resolutions, fresh_data):
    args = ["eval", "context", "--model", str(converted_dir), "--source", str(tiny_corpus), "--lengths", "100",
            "--tokens", "100", "--no-passkey", "--output", str(tmp_path / "ctx"), "--no-record"]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert resolutions == [str(tiny_model_dir)]  # the original's weights and every length's blocks
    assert steps[:3] == ["load_saved", "resolve", "load"] and "convert" in steps  # the baseline


@pytest.mark.slow
def test_sweep_resolves_the_base_once_for_every_row(tiny_recipe, converted_dir, tiny_model_dir, tiny_corpus, tmp_path, capsys, steps, resolutions, fresh_data):
    """Two betas converted from one loaded base, a saved model beside them, long blocks at two
    lengths and attention transfer's long blocks: one resolution of the base for all of them."""
    args = ["sweep", "--config", str(tiny_recipe), "--betas", "0,0.5", "--output", str(tmp_path / "sweep"),
            "--cache-length", "16", "--transfer", "--trained", str(converted_dir), "--no-record",
            "--long", str(tiny_corpus), "--long-lengths", "48,64", "--long-blocks", "1"]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert resolutions == [str(tiny_model_dir)]
    assert steps.count("load") == 1 and steps.count("load_saved") == 1


@pytest.mark.slow
def test_sweep_hands_its_resolution_to_the_fits_it_runs(tiny_recipe, tiny_model_dir, tmp_path, capsys, steps, resolutions, fresh_data):
    """``--fit`` runs ``rfkit fit`` in process for the beta 0.5 row (beta 0 is the original): it
    walks the pipeline's steps on the sweep's resolution of the base."""
    args = ["sweep", "--config", str(tiny_recipe), "--betas", "0,0.5", "--output", str(tmp_path / "sweep"),
            "--cache-length", "16", "--fit", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path / "runs"),
            "--model.transfer", "null", "--model.distill", "null", "--summary.save_model", "false"]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert resolutions == [str(tiny_model_dir)]
    assert steps.count("resolve") == 2 and steps.count("load") == 2  # the sweep's base, then the fit's
