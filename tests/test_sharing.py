"""A saved converted model that anyone can load and evaluate with the standard tools, without rfkit.

``rfkit fit`` and ``rfkit convert`` write the code of the model classes into the folder
(:mod:`rfkit.models.export`); ``rfkit export`` does it for folders saved before. The checks run in
a process where ``import rfkit`` fails (``benchmarks/standalone_check.py`` puts a ``rfkit`` package
that refuses to import first on the import path), with ``trust_remote_code=True``:

- for every operator (hybrid, Mamba, sink + recent) on a GQA base and on an MHA base: the logits,
  greedy, beam-search and sampled generations, and ``pipeline("text-generation")``, equal what the
  rfkit-loaded model gives;
- a model saved by the previous release (``tests/fixtures/previous_release``) loads with rfkit as
  it did, and ``rfkit export`` makes it load without rfkit, with the logits that release computed;
- lm-evaluation-harness's own CLI scores a folder on the offline fixture task with the accuracy
  ``rfkit eval lm-eval`` reports.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY, run_cli, small_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, pipeline

import rfkit  # noqa: F401  (registers the converted model types)
from rfkit.conversion.convert import build_head_map, save_converted
from rfkit.conversion.policies import ExplicitHeads
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridOperator, MambaOperator, SinkRecentOperator

OPERATORS = {
    "hybrid": lambda: HybridOperator(sink=2, window=6, feature_dim=4, decay_horizon=16.0),
    "mamba": lambda: MambaOperator(d_state=4, zero_init_output=False),
    "sink_recent": lambda: SinkRecentOperator(sink=2, window=6),
}
BASES = {"gqa": (4, 2, [[0, 1], [2, 3]]), "mha": (4, 4, [[1, 2], [0, 3]])}
CASES = [(op, base) for base in BASES for op in OPERATORS]
PREVIOUS = ROOT / "tests" / "fixtures" / "previous_release" / "hybrid_8774ff5"
TASKS = ROOT / "tests" / "fixtures" / "lm_eval"
TASK = "rfkit_tiny_mc"
PROMPT = "the river city"


def standalone():
    spec = importlib.util.spec_from_file_location("rf_standalone", ROOT / "benchmarks" / "standalone_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_case(operator: str, base: str, tokenizer, root: Path) -> Path:
    """A tiny converted model saved as rfkit fit saves it, its mixers made to matter (open gates,
    a louder Mamba read-out) so that a wrong state would show in the logits."""
    heads, kv, selected = BASES[base]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY, vocab_size=320), num_attention_heads=heads, num_key_value_heads=kv)).eval()
    head_map = build_head_map(model, "tiny-random-llama", ExplicitHeads(selected))
    model = to_recurformer(model, head_map.selected, OPERATORS[operator]())
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = layer.self_attn.mixer
            if hasattr(mixer, "gate"):
                mixer.gate.fill_(1.0)
            if hasattr(mixer, "out_proj"):
                mixer.out_proj.weight.mul_(8.0)
    out = root / f"{operator}_{base}"
    save_converted(model, head_map, out, tokenizer)
    return out


def reference(folder: Path, ids: torch.Tensor) -> dict:
    """What the rfkit-loaded folder gives (no trust_remote_code: rfkit's registered classes)."""
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert type(model).__module__ == "rfkit.models.modeling"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    found = standalone().probe_outputs(model, ids)  # what the probe computes, here with rfkit's classes
    generator = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(str(folder)))
    found["pipeline"] = generator(PROMPT, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    return found


@pytest.fixture(scope="module")
def shared(tiny_corpus, tmp_path_factory):
    """Every case's folder, the previous release's folder after ``rfkit export``, the rfkit-side
    references, and one probe run over all of them where rfkit cannot be imported."""
    root = tmp_path_factory.mktemp("sharing")
    tokenizer = small_tokenizer(tiny_corpus)
    ids = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(3))  # tokens leave the 2 + 6 window
    folders, refs = {}, {}
    for operator, base in CASES:
        tag = f"{operator}_{base}"
        folders[tag] = save_case(operator, base, tokenizer, root)
        refs[tag] = reference(folders[tag], ids)
    exported = root / "previous_exported"
    code = run_cli_quiet(["export", "--model", str(PREVIOUS), "--output", str(exported)])
    assert code == 0
    previous_ids = torch.load(PREVIOUS / "reference.pt")["ids"]
    jobs = [{"path": folders[tag], "tag": tag, "inputs": {"ids": ids, "prompt": PROMPT}} for tag in folders]
    jobs.append({"path": exported, "tag": "previous", "inputs": {"ids": previous_ids}})
    probe = standalone().run_probe(jobs, root / "probe")
    return {"folders": folders, "refs": refs, "probe": probe, "exported": exported, "root": root}


def run_cli_quiet(args) -> int:
    from rfkit.cli import main

    try:
        main(list(args))
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else 1
    return 0


@pytest.mark.slow
def test_the_probe_ran_without_rfkit(shared):
    assert shared["probe"]["rfkit_import_error"] == "rfkit is blocked in this process"
    for tag, found in shared["probe"]["folders"].items():
        assert found["model_module"].startswith("transformers_modules.") and found["model_module"].endswith(".modeling_rfkit")
        assert found["config_class"].startswith("RecurFormer") and found["model_class"].startswith("RecurFormer"), tag


@pytest.mark.slow
@pytest.mark.parametrize("operator, base", CASES)
def test_a_saved_model_loads_without_rfkit_and_computes_what_rfkit_does(operator, base, shared):
    tag = f"{operator}_{base}"
    ref, found = shared["refs"][tag], shared["probe"]["folders"][tag]
    got = found["tensors"]
    # rfkit may run its compiled CPU kernels where the folder's code runs the PyTorch paths: float32 noise
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
    for kind in ("greedy", "beams", "sampled"):
        assert torch.equal(got[kind], ref[kind]), kind
    assert found["pipeline"] == ref["pipeline"] == found["pipeline_by_path"]
    assert len(found["pipeline"]) > len(PROMPT)
    folder = shared["folders"][tag]
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": f"configuration_rfkit.{found['config_class']}",
        "AutoModelForCausalLM": f"modeling_rfkit.{found['model_class']}",
    }
    header = (folder / "modeling_rfkit.py").read_text().splitlines()[:3]
    assert header[0].startswith(f"# Generated by rfkit {rfkit.__version__} from rfkit/models/modeling.py")
    assert header[2].startswith("# Supports transformers >=5")


@pytest.mark.slow
def test_the_previous_release_model_loads_and_export_makes_it_self_contained(shared):
    reference_logits = torch.load(PREVIOUS / "reference.pt")
    with torch.no_grad():  # as before, with rfkit: the same logits as the release that saved it
        model = AutoModelForCausalLM.from_pretrained(str(PREVIOUS)).eval()
        torch.testing.assert_close(model(reference_logits["ids"]).logits, reference_logits["logits"], atol=1e-5, rtol=1e-5)
    assert "auto_map" not in json.loads((PREVIOUS / "config.json").read_text())  # it carried no code
    got = shared["probe"]["folders"]["previous"]["tensors"]["logits"]
    torch.testing.assert_close(got, reference_logits["logits"], atol=1e-5, rtol=1e-5)  # without rfkit, after export
    exported = shared["exported"]
    card = (exported / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "trust_remote_code=True" in card
    assert "## Head map" in card and "tiny-random-llama" in card  # the rest of the card kept
    assert sorted(p.name for p in PREVIOUS.iterdir()) == sorted(
        p.name for p in exported.iterdir() if not p.name.startswith(("modeling_rfkit", "configuration_rfkit", "rfkit_"))
    )


def test_export_refuses_bad_input_with_one_line(tmp_path, capsys):
    cases = [
        (["--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o")], "--model:"),
        (["--model", str(PREVIOUS), "--output", str(PREVIOUS / "inside")], "is the model directory or inside it"),
        (["--model", str(PREVIOUS), "--output", str(tmp_path)], "already exists; add --force"),
        (["--model", str(ROOT / "recipes" / "smollm2_b05.yaml"), "--output", str(tmp_path / "o")], "is a recipe"),
    ]
    for args, words in cases:
        code, out, err = run_cli(["export", *args], capsys)
        assert code == 2 and err.startswith("rfkit export: error: ") and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_lm_evals_own_cli_scores_the_folder_without_rfkit_as_rfkit_eval_does(shared, capsys, monkeypatch):
    folder = shared["folders"]["hybrid_gqa"]
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.chdir(ROOT)  # the task's data_files are relative to the repository root
    out = shared["root"] / "rfkit_lm_eval.json"
    code, _, err = run_cli(["eval", "lm-eval", "--model", str(folder), "--tasks", TASK, "--include-path", str(TASKS),
                            "--batch-size", "4", "--no-record", "--json", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    expected = json.loads(out.read_text())["results"][TASK]["acc,none"]

    harness = Path(sys.executable).parent / "lm_eval"  # the console script: the checkout is not on its path
    results = shared["root"] / "lm_eval_cli"
    done = standalone().run_without_rfkit(
        [str(harness), "--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True,dtype=float32",
         "--tasks", TASK, "--include_path", str(TASKS), "--batch_size", "4", "--device", "cpu",
         "--output_path", str(results)],
        shared["root"] / "harness", timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    written = sorted(results.rglob("results*.json"))
    assert written, done.stdout[-2000:]
    found = json.loads(written[-1].read_text())["results"][TASK]["acc,none"]
    assert found == pytest.approx(expected)


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def shown_commands(section: str) -> list[list[str]]:
    """Every ``rfkit`` command line of the section's bash blocks (continuations joined), split
    as a shell would; ``make`` lines too."""
    import re
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#", 1)[0])
            if words:
                commands.append(words)
    return commands


def test_the_readmes_convert_your_own_model_commands_parse(monkeypatch):
    """The section's commands, as a reader copies them: the fit parses (recipe, overrides and all,
    nothing loaded), the make target exists, and the inline rfkit commands parse too."""
    import subprocess

    import rfkit.config.lightning_cli as lightning_cli
    from rfkit.config.sharing import build_parser as export_parser
    from rfkit.experiments.sweep import build_parser as sweep_parser

    section = readme_section("Convert your own model")
    commands = shown_commands(section)
    assert [c[0] for c in commands] == ["make", ".venv/bin/rfkit"], commands
    make = subprocess.run(["make", "-n", *commands[0][1:]], cwd=ROOT, capture_output=True, text=True)
    assert make.returncode == 0, make.stderr

    class ParseOnly(lightning_cli.RFKitCLI):
        def before_instantiate_classes(self):  # the preflight would look for your-org/your-model
            pass

        def instantiate_classes(self):
            pass

        def after_instantiate_classes(self):
            pass

    fit = commands[1][1:]
    assert fit[0] == "fit" and "--model.base_model" in fit and "--data.source" in fit
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(lightning_cli, "RFKitCLI", ParseOnly)
    config = lightning_cli.make_cli(fit[1:], run=False).config
    assert config.model.base_model == "your-org/your-model" and config.data.init_args.source == "wikimedia/wikipedia:20231101.en"
    assert config.model.operator.class_path == "rfkit.operators.HybridOperator"

    sweep = "rfkit sweep --config RECIPE --betas 0.25,0.5,0.75"
    export = "rfkit export --model DIR --output NEW_DIR"
    assert sweep in " ".join(section.split()) and export in section
    parsed = sweep_parser().parse_args(["--config", "recipes/qwen2_05b_b05_hybrid.yaml", *sweep.split()[4:]])
    assert parsed.betas
    assert export_parser().parse_args(export.split()[2:]).output == "NEW_DIR"


def test_auto_map_names_the_classes_rfkit_registers():
    from rfkit.models.export import MODEL_TYPES, auto_map
    from rfkit.models.modeling import _FAMILIES

    assert set(MODEL_TYPES) == {cfg.model_type for cfg, _ in _FAMILIES.values()}
    for cfg, model in _FAMILIES.values():
        assert auto_map(cfg.model_type) == {
            "AutoConfig": f"configuration_rfkit.{cfg.__name__}",
            "AutoModelForCausalLM": f"modeling_rfkit.{model.__name__}",
        }
    assert auto_map("rf_qwen2") == {
        "AutoConfig": "configuration_rfkit.RecurFormerQwen2Config",
        "AutoModelForCausalLM": "modeling_rfkit.RecurFormerQwen2ForCausalLM",
    }


def test_the_folders_code_warns_outside_the_transformers_range_it_states():
    from rfkit.models.export import _version_check

    with pytest.warns(UserWarning, match=r"supports transformers <1, not the installed"):
        exec(_version_check("<1", "9.9"), {})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(_version_check(">=5.0,<6", "9.9"), {})  # the installed one: silent


def test_the_folders_code_is_generated_once_while_the_sources_stay_the_same(monkeypatch):
    from rfkit.models import export

    made = []
    real = export._generate
    monkeypatch.setattr(export, "_GENERATED", {})
    monkeypatch.setattr(export, "_generate", lambda: made.append(1) or real())
    first = export.generated_files()
    first["modeling_rfkit.py"] = "changed by a caller"
    second = export.generated_files()
    assert len(made) == 1 and second["modeling_rfkit.py"] != "changed by a caller"  # kept, handed out as a copy
    stamp = export._source_stamp()
    assert any(path.endswith("/models/modeling.py") for path, _, _ in stamp)
    monkeypatch.setattr(export, "_source_stamp", lambda: stamp[1:])  # a source file changed (or went)
    assert export.generated_files() == second and len(made) == 2  # made again
