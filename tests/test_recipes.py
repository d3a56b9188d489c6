"""The recipe catalogue: ``rfkit recipes list|show|cp`` and ``--config NAME``."""

from importlib import resources
from pathlib import Path

import pytest
import yaml
from helpers import run_cli  # pytest puts tests/ on sys.path

from rfkit.config import catalog

ROOT = Path(__file__).resolve().parents[1]
RECIPE_FILES = sorted((ROOT / "recipes").glob("*.yaml"))
NAMES = [p.stem for p in RECIPE_FILES]


def test_the_catalogue_is_the_packaged_recipes_directory():
    assert catalog.recipe_names() == NAMES and "smollm2_b05" in NAMES
    packaged = sorted(p.name for p in resources.files("rfkit.recipes").iterdir() if p.name.endswith(".yaml"))
    assert packaged == [p.name for p in RECIPE_FILES]  # what a wheel install would see


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_every_recipe_says_what_it_reproduces_in_its_header(path):
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    found = [line for line in header if line.startswith("# Reproduces: ")]
    assert len(found) == 1 and len(found[0]) > len("# Reproduces: ") + 10
    assert catalog.describe(path.stem)["reproduces"] == found[0][len("# Reproduces: ") :]


def test_describe_reads_model_policy_and_operator_from_the_yaml():
    info = catalog.describe("smollm2_b05.yaml")
    assert info["name"] == "smollm2_b05" and info["kind"] == "fit"
    assert info["base_model"] == "embedded:smollm2-135m-instruct" and info["beta"] == 0.5
    assert info["policy"] == "RecencyRatioPolicy" and info["operator"] == "HybridOperator"
    assert catalog.describe("smollm2_mamba_b05")["operator"] == "MambaOperator"  # the paper's own operator
    assert catalog.describe("llama2_b09")["base_model"] == "meta-llama/Llama-2-7b-hf"
    mqar = catalog.describe("mqar_smoke")
    assert mqar["kind"] == "eval mqar" and mqar["beta"] is None and mqar["betas"] == [0, 0.25, 0.5, 0.75, 1.0]


def test_list_shows_every_recipe_with_base_model_beta_and_operator(capsys):
    code, out, err = run_cli(["recipes", "list"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["name", "kind", "base", "model", "beta", "operator", "reproduces"]
    column = lines[0].index("reproduces")
    for path in RECIPE_FILES:
        config = yaml.safe_load(path.read_text())
        row = next(line for line in lines if line.split()[:1] == [path.stem])
        if path.stem.startswith("mqar_"):
            assert "eval mqar" in row and "0,0.25,0.5,0.75,1" in row and "MambaOperator" in row
        else:
            model = config["model"]
            beta = f"{model['policy']['init_args']['beta']:g}"
            operator = model.get("operator", {}).get("class_path", "MambaOperator").rsplit(".", 1)[-1]
            assert row.split()[1:5] == ["fit", model["base_model"], beta, operator], row
        assert row[column:] == catalog.describe(path.stem)["reproduces"]  # aligned under the header


def test_show_prints_the_recipe_file(capsys):
    code, out, err = run_cli(["recipes", "show", "smollm2_b05"], capsys)
    assert code == 0 and err == ""
    assert out == (ROOT / "recipes" / "smollm2_b05.yaml").read_text()


def test_cp_writes_an_identical_file_and_refuses_to_overwrite(tmp_path, capsys):
    source = (ROOT / "recipes" / "qwen2_05b_b05.yaml").read_text()
    dest = tmp_path / "mine.yaml"
    code, out, err = run_cli(["recipes", "cp", "qwen2_05b_b05", str(dest)], capsys)
    assert code == 0, err
    assert dest.read_text() == source and str(dest) in out

    dest.write_text("edited: true\n")
    code, out, err = run_cli(["recipes", "cp", "qwen2_05b_b05", str(dest)], capsys)
    assert code == 2 and dest.read_text() == "edited: true\n"
    assert err == f"rfkit recipes: error: DEST: '{dest}' already exists; add --force to overwrite it\n"

    code, out, err = run_cli(["recipes", "cp", "qwen2_05b_b05.yaml", str(dest), "--force"], capsys)
    assert code == 0 and dest.read_text() == source

    code, out, err = run_cli(["recipes", "cp", "smollm2_b05", str(tmp_path)], capsys)  # a directory
    assert code == 0 and (tmp_path / "smollm2_b05.yaml").read_text() == (ROOT / "recipes" / "smollm2_b05.yaml").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_resolve_config_takes_a_file_or_a_catalogue_name(tmp_path, monkeypatch):
    recipe = str(ROOT / "recipes" / "smollm2_b05.yaml")
    assert catalog.resolve_config("smollm2_b05") == recipe
    assert catalog.resolve_config("smollm2_b05.yaml") == recipe
    assert catalog.resolve_config(recipe) == recipe
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2_b05.yaml").write_text("# my own copy\n")
    assert catalog.resolve_config("smollm2_b05.yaml") == "smollm2_b05.yaml"  # an existing file wins


@pytest.mark.slow
def test_fit_config_by_name_finds_the_packaged_recipe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no recipes/ here: the name alone must find it
    code, out, err = run_cli(["fit", "--config", "smollm2_b05", "--model.policy.init_args.beta", "2"], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("rfkit: error: model.policy.beta")  # parsed the recipe


def test_an_unknown_name_suggests_the_nearest(capsys):
    expected = (
        "--config: 'smollm_b05' is neither a file nor a catalogue recipe; "
        "nearest: smollm2_b05, smollm2_b075, smollm2_b09 (rfkit recipes list)"
    )
    with pytest.raises(catalog.CatalogError) as raised:
        catalog.resolve_config("smollm_b05")
    assert str(raised.value) == expected

    code, out, err = run_cli(["fit", "--config=smollm_b05"], capsys)
    assert code == 2 and err == f"rfkit: error: {expected}\n"

    code, out, err = run_cli(["recipes", "show", "smollm_b05"], capsys)
    assert code == 2 and out == ""
    assert err == (
        "rfkit recipes: error: NAME: 'smollm_b05' is not a catalogue recipe; "
        "nearest: smollm2_b05, smollm2_b075, smollm2_b09 (rfkit recipes list)\n"
    )


def test_sweep_takes_a_recipe_name_and_names_the_nearest(capsys):
    code, out, err = run_cli(["sweep", "--config", "smollm_b05"], capsys)
    assert code == 2 and err.startswith("rfkit sweep: error: --config: 'smollm_b05'") and "nearest: smollm2_b05" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give a command: list | show NAME | cp NAME DEST [--force]"),
        (["copy"], "command: 'copy' is not one of list, show, cp"),
        (["show"], "show: needs NAME, like: rfkit recipes show smollm2_b05"),
        (["cp", "smollm2_b05"], "cp: needs NAME and DEST, like: rfkit recipes cp smollm2_b05 my_recipe.yaml"),
    ],
)
def test_bad_recipes_arguments_get_one_line_and_exit_2(args, message, capsys):
    code, out, err = run_cli(["recipes", *args], capsys)
    assert code == 2 and err == f"rfkit recipes: error: {message}\n"


def test_a_missing_path_says_it_does_not_exist_and_names_the_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # e.g. a wheel install: the header's `recipes/NAME.yaml` is not here
    with pytest.raises(catalog.CatalogError) as raised:
        catalog.resolve_config("recipes/smollm2_b05.yaml")
    assert str(raised.value) == (
        "--config: 'recipes/smollm2_b05.yaml' does not exist; nearest: smollm2_b05 (rfkit recipes list)"
    )


def test_eval_and_bench_take_a_catalogue_name_for_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no recipes/ here
    assert catalog.resolve_model_spec("smollm2_b05") == str(catalog.recipe_path("smollm2_b05"))
    assert catalog.resolve_model_spec("no_such_thing") == "no_such_thing"  # left to the command's own check
    (tmp_path / "smollm2_b05").mkdir()  # an existing directory of that name wins
    assert catalog.resolve_model_spec("smollm2_b05") == "smollm2_b05"
    monkeypatch.chdir(ROOT)
    # SmolLM2's context is 8,192 tokens: the recipe's model config was read, so the name resolved
    code, out, err = run_cli(["eval", "passkey", "--model", "smollm2_b05", "--lengths", "99999"], capsys)
    assert code == 2 and "99999" in err.strip().splitlines()[-1] and "8192" in err, err
    code, out, err = run_cli(["bench", "cache", "--model", "smollm2_b5", "--lengths", "64"], capsys)
    assert code == 2 and "'smollm2_b5' does not exist" in err


def test_eval_mqar_takes_a_catalogue_name(capsys):
    from rfkit.experiments.mqar import parse_config

    cfg = parse_config(["--config", "mqar_smoke"])
    assert cfg.betas == [0, 0.25, 0.5, 0.75, 1]
    with pytest.raises(catalog.CatalogError, match="nearest: mqar_smoke"):
        parse_config(["--config", "mqar_smok"])


def test_the_recipes_page_lists_every_operator_with_its_defaults_and_every_recipe():
    """docs/recipes.md's operator table: each built-in operator as ``Name(arg=default, ...)``, the
    recipes using it; its recipe table: every recipe of the catalogue."""
    import inspect

    import rfkit.operators as operators

    page = (ROOT / "docs" / "recipes.md").read_text()
    table = page[page.index("| operator (`class_path: rfkit.operators.X`)") :].split("\n\n")[0]
    for name in operators.__all__:
        cls = getattr(operators, name)
        if not (inspect.isclass(cls) and issubclass(cls, operators.ReplacementOperator)) or inspect.isabstract(cls):
            continue
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        shown = ", ".join(f"{p.name}={p.default!r}".replace("'", '"') for p in params)
        assert f"`{name}({shown})`" in table, f"docs/recipes.md: {name}({shown}) is not in the operator table"
    for path in RECIPE_FILES:
        uses = yaml.safe_load(path.read_text()).get("model", {}).get("operator", {}).get("class_path", "")
        if uses:
            row = next(line for line in table.split("\n") if f"`{uses.rsplit('.', 1)[1]}(" in line)
            gpu_hybrid = "`*_hybrid` GPU recipes" in row and path.stem.endswith("_hybrid")
            assert f"`{path.stem}`" in row or gpu_hybrid, f"docs/recipes.md: {path.stem} is not in its operator's row"
        assert f"`{path.stem}`" in page, f"docs/recipes.md does not list {path.stem}"
