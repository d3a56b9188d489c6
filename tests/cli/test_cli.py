"""The rfkit command line: subcommands, recipes, plugins and bad input."""

import json

import pytest
import torch
from helpers import MAMBA, RECIPES, ROOT, SMOLLM, run_cli, tiny_args  # noqa: F401
from transformers import AutoModelForCausalLM

from rfkit.config.parse_errors import tidy_parse_error


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_parses_against_the_signatures_it_names(recipe):
    from rfkit.config.lightning_cli import make_cli

    text = recipe.read_text()
    assert text.startswith("#") and "rfkit fit --config recipes/" in text  # comment block with the command
    # instantiated on this CPU: a GPU recipe's FSDP strategy refuses the CPU accelerator, so the
    # strategy is replaced here (test_ddp.py checks what the FSDP settings parse to)
    cli = make_cli(
        ["--config", str(recipe), "--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.strategy", "auto"],
        run=False,
        trainer_defaults={"logger": False, "enable_checkpointing": False},
    )
    assert 0.0 <= cli.model.policy.beta <= 1.0
    assert cli.datamodule.seq_len >= 512


@pytest.mark.slow
def test_fit_writes_summary_head_map_and_a_model_that_reloads(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    code, out, err = run_cli(["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path)], capsys)
    assert code == 0, err
    summary_path = next(tmp_path.rglob("summary.json"))
    summary = json.loads(summary_path.read_text())
    for key in (
        "ppl_original", "ppl_converted", "cache_bytes_per_token_original", "cache_bytes_per_token_converted",
        "params_added", "params_removed", "replaced_heads", "total_heads", "train_tokens", "wall_seconds",
    ):  # fmt: skip
        assert summary[key] is not None, key
    assert summary["total_heads"] == 8 and summary["replaced_heads"] == 4  # beta 0.5 of 4 KV groups
    assert summary["cache_bytes_per_token_converted"] == summary["cache_bytes_per_token_original"] / 2
    assert summary["train_tokens"] == 2 * 32 + 96  # max_steps 2: a batch of 2 x 32 tokens, then a long block of 96
    assert "rfkit fit: done" in out and f"{summary['ppl_ratio']:.3f}" in out  # the end screen shows the ratio too
    run = summary_path.parent
    assert (run / "config.yaml").exists()  # the resolved recipe next to the logs
    head_map = json.loads((run / "head_map.json").read_text())
    assert len(head_map["rai"]) == 2 and len(head_map["rai"][0]) == 4
    model = AutoModelForCausalLM.from_pretrained(str(run / "model"))
    assert type(model).__name__ == "RecurFormerLlamaForCausalLM"
    assert sum(len(s) for s in model.config.rf_selected) == 4


@pytest.mark.slow
def test_profile_and_convert_subcommands(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    args = tiny_args(tiny_model_dir, tiny_corpus, tmp_path)
    code, out, err = run_cli(["profile", *args, "--output", str(tmp_path / "hm.json")], capsys)
    assert code == 0, err
    head_map = json.loads((tmp_path / "hm.json").read_text())
    assert head_map["window"] == 4 and head_map["samples"] == 4 and head_map["seq_len"] == 32
    for name in ("rai_heatmap.png", "attention_maps.png", "first_token_contribution.md"):
        assert (tmp_path / name).stat().st_size > 0, name  # the head report beside the map
    code, out, err = run_cli(["convert", *args, "--output", str(tmp_path / "conv")], capsys)
    assert code == 0, err
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / "conv"))
    assert converted.config.rf_selected == head_map["selected"]  # the cached profile was reused
    ids = torch.randint(0, 100, (1, 16))
    assert converted(ids).logits.shape == (1, 16, converted.config.vocab_size)
    config = json.loads((tmp_path / "conv" / "config.json").read_text())  # convert's folder carries its code too
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_rfkit.RecurFormerLlamaForCausalLM"
    assert (tmp_path / "conv" / "modeling_rfkit.py").is_file() and (tmp_path / "conv" / "configuration_rfkit.py").is_file()


@pytest.mark.slow
def test_custom_policy_from_the_working_directory_drives_a_conversion(
    tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch
):
    (tmp_path / "my_policies.py").write_text(
        "from rfkit.conversion.policies import HeadSelectionPolicy\n"
        "class EvenLayers(HeadSelectionPolicy):\n"
        "    '''Replace every query head of even layers.'''\n"
        "    def select(self, layout, profile):\n"
        "        return [list(range(layout.num_heads)) if i % 2 == 0 else [] for i in range(layout.num_layers)]\n"
    )
    monkeypatch.chdir(tmp_path)
    policy = json.dumps({"class_path": "my_policies.EvenLayers", "init_args": {"beta": 0.5}})
    args = tiny_args(tiny_model_dir, tiny_corpus, tmp_path)
    code, out, err = run_cli(["convert", *args, "--model.policy", policy, "--output", str(tmp_path / "even")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "even" / "head_map.json").read_text())["selected"] == [[0, 1, 2, 3], []]


BAD = [
    (["--model.policy.init_args.beta", "1.5"], "model.policy.beta"),
    (["--model.policy.init_args.beta", "-0.2"], "model.policy.beta"),
    (["--model.policy.init_args.alpha", "1.2"], "model.policy.alpha"),
    (["--model.policy.init_args.window", "0"], "model.policy.window"),
    (["--model.policy.class_path", "nowhere.Policy"], "model.policy"),
    (["--model.policy.class_path", "torch.nn.Linear"], "model.policy"),
    (["--model.operator.class_path", "nowhere.Operator"], "model.operator"),
    (["--model.operator.init_args.d_state", "0"], "model.operator.d_state"),
    (["--model.base_model", "./no/such/model"], "model.base_model"),
    (["--data.source", "./no/such/file.jsonl"], "data.source"),
    (["--model.freeze", "sometimes"], "model.freeze"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra, field", BAD, ids=[b[1] + ":" + b[0][-1] for b in BAD])
def test_bad_recipe_values_get_one_line_and_exit_2(extra, field, capsys, monkeypatch):
    import rfkit.conversion.convert

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(rfkit.conversion.convert, "load_base_model", no_loading)
    code, out, err = run_cli(["fit", "--config", SMOLLM, *extra], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("rfkit: error:")]
    assert len(lines) == 1 and field in lines[0], err
    assert "Traceback" not in err


def test_missing_config_file(capsys):
    code, out, err = run_cli(["fit", "--config", "no_such_recipe.yaml"], capsys)
    assert code == 2 and err.strip() == (
        "rfkit: error: --config: 'no_such_recipe.yaml' is neither a file nor a catalogue recipe; "
        "recipes: llama2_b09, llama2_b09_hybrid, qwen2_05b_b05, qwen2_05b_b05_hybrid, qwen2_7b_b09, ... (rfkit recipes list)"
    )


@pytest.mark.parametrize("command", [["fit", "--config", SMOLLM], ["profile", "--config", SMOLLM], ["convert", "--config", SMOLLM]])
def test_other_model_families_are_refused_before_loading_with_one_line(command, tmp_path, capsys):
    model_dir = tmp_path / "gpt2ish"  # a config only: had anything tried to load weights, it would fail differently
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8}))
    extra = ["--output", str(tmp_path / "out")] if command[0] != "fit" else []
    code, out, err = run_cli([*command, "--model.base_model", str(model_dir), *extra], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "model.base_model" in err and "'gpt2'" in err and "allowed: llama, mistral, qwen2" in err, err
    assert not (tmp_path / "out").exists()


def test_tidy_parse_error_keeps_the_field():
    msg = 'Parser key "model.policy":\n  Does not validate ... Problem with given class_path \'x.Y\': No module named \'x\'\n - Expected'
    assert tidy_parse_error(msg) == "model.policy: class 'x.Y' cannot be used: No module named 'x'"


@pytest.mark.slow
def test_validate_subcommand_converts_and_reports_perplexity(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    code, out, err = run_cli(["validate", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path)], capsys)
    assert code == 0, err
    assert "val_ppl" in out and "val_loss" in out


class _FakeEntryPoint:
    def __init__(self, name, target, dist="my-rfkit-plugin"):
        self.name, self._target = name, target
        self.dist = type("Dist", (), {"name": dist})()

    def load(self):
        return self._target()


def test_plugins_are_imported_before_parsing(monkeypatch):
    import rfkit.cli

    loaded = []
    monkeypatch.setattr(rfkit.cli, "entry_points", lambda group: [_FakeEntryPoint("ok", lambda: loaded.append(group))])
    rfkit.cli.load_plugins()
    assert loaded == ["rfkit.plugins"]


def test_a_plugin_that_fails_to_import_is_named(monkeypatch, capsys):
    import rfkit.cli

    def broken():
        raise ImportError("No module named 'missing_dependency'")

    monkeypatch.setattr(rfkit.cli, "entry_points", lambda group: [_FakeEntryPoint("entropy", broken)])
    code, out, err = run_cli(["fit", "--config", SMOLLM], capsys)
    assert code == 2
    assert err.strip() == (
        "rfkit: error: plugin 'entropy' from package 'my-rfkit-plugin' failed to import: "
        "No module named 'missing_dependency'"
    )


@pytest.mark.slow
def test_a_head_map_for_another_model_is_a_one_line_error(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    wrong = {"model": "other", "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "window": 4, "alpha": 0.5,
             "beta": 0.5, "exclude_first_token": True, "seq_len": 32, "samples": 4, "rai": [], "rr_mean": [],
             "selected": [[0, 1, 2]] + [[]] * 29}  # fmt: skip
    (tmp_path / "other.json").write_text(json.dumps(wrong))
    args = tiny_args(tiny_model_dir, tiny_corpus, tmp_path)
    code, out, err = run_cli(["convert", *args, "--model.head_map", str(tmp_path / "other.json"),
                              "--output", str(tmp_path / "x")], capsys)  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("rfkit: error: model.head_map: the head map is for (layers, heads, kv_heads) = (30, 9, 3)")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("subcommand", ["fit", "convert"])
def test_a_subcommand_builds_its_own_parser_alone(subcommand, capsys, monkeypatch):
    """``rfkit fit`` (or ``convert``) builds that subcommand's parser, not the four others' (each
    holds every class signature of the model, data, trainer and callbacks); its help and its
    checks are the subcommand's own."""
    from rfkit.config.lightning_cli import RFKitCLI

    built = []
    prepare = RFKitCLI._prepare_subcommand_parser

    def counting(self, klass, name, **kwargs):
        built.append(name)
        return prepare(self, klass, name, **kwargs)

    monkeypatch.setattr(RFKitCLI, "_prepare_subcommand_parser", counting)
    code, _, err = run_cli([subcommand, "--config", SMOLLM, "--model.policy.init_args.beta", "2"], capsys)
    assert code == 2 and "model.policy.beta" in err
    assert built == [subcommand]
    assert set(RFKitCLI.subcommands()) == {"fit", "validate", "test", "profile", "convert"}  # the class still lists all
    built.clear()
    code, out, _ = run_cli([subcommand, "--help"], capsys)
    assert code == 0 and built == [subcommand] and "--model.policy" in out
