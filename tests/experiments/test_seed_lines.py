"""benchmarks/seed_lines.py: a recipe's seeds fitted, evaluated and checked against the lines of
their beta, resumable; and the same check over the seeds behind the README's beta tables."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
from helpers import SMOLLM, load_script, tiny_args


@pytest.fixture(scope="module")
def seed_lines():
    return load_script("benchmarks/seed_lines.py")


def _lines(result: dict, seed: int) -> dict:
    (entry,) = [s for s in result["seeds"] if s["seed"] == seed]
    return {line["line"]: line for line in entry["lines"]}


def test_the_shipped_beta_09_seeds_meet_every_line_against_the_default_fits_before_and_after(seed_lines, tmp_path, capsys):
    assert seed_lines.main(["--shipped", "b09", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "lines.json").read_text())
    assert result["beta"] == 0.9 and result["recipe"] == "recipes/smollm2_b09.yaml" and result["all_met"]
    assert [s["seed"] for s in result["seeds"]] == [0, 1, 2]
    assert result["provenance"]["command"].startswith("python benchmarks/seed_lines.py --shipped b09")
    for seed, value in (
        (0, "1.74x (12.3 vs 7.5 / 6.7 min, their mean; 1.65x / 1.84x each)"),
        (1, "1.74x (12.3 vs 7.5 / 6.7 min, their mean; 1.65x / 1.84x each)"),
        (2, "1.61x (11.4 vs 7.5 / 6.7 min, their mean; 1.52x / 1.71x each)"),
    ):
        lines = _lines(result, seed)
        assert all(line["ok"] for line in lines.values()), seed
        assert lines["fit <= 2x the default's"]["value"] == value  # under 2x against either default fit alone too
        assert lines["needles the training-free model finds, missed"]["value"] == "0 of 18"  # the 20-digit key too
        assert {"Wikipedia <= 1.05", "long documents 8192 <= 1.25", "long documents 8192 below training-free"} <= set(
            lines
        )
    assert "0 of 18 met" in (tmp_path / "lines.md").read_text() and "**missed**" not in (tmp_path / "lines.md").read_text()
    assert "| needles the training-free model finds, missed |" in capsys.readouterr().out


def test_the_shipped_beta_075_seeds_meet_every_quality_line_and_the_2k_decode_only_in_bf16(seed_lines, tmp_path):
    assert seed_lines.main(["--shipped", "b075", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "lines.json").read_text())
    for seed in (0, 1, 2):
        lines = _lines(result, seed)
        assert all(line["ok"] for line in lines.values()), seed
        assert lines["passkeys at 4096 as the original's"]["value"] == "6 vs 6 of 6"
        assert "Wikipedia below training-free" in lines
    float32, bf16, bf16_second = result["speed"]  # one entry per machine and dtype, each named with its machine
    assert float32["model"].endswith("float32, AMD EPYC, 2 threads")  # AVX2 only
    assert bf16["model"].endswith("bf16, AMD EPYC, 2 threads, avx512_bf16")
    assert bf16_second["model"].endswith("bf16, a second machine, AMD EPYC, 2 threads, avx512_bf16")
    speed = {line["line"]: line["ok"] for line in float32["lines"]}
    assert speed == {"decode at 2048 >= 1.3x": False, "decode at 8192 >= 1.9x": True}
    assert all(line["ok"] for line in bf16["lines"] + bf16_second["lines"]) and len(bf16_second["lines"]) == 2
    assert bf16_second["lines"][0]["value"] == "1.92x (bytes ratio 1.12x)"  # measured with the bytes a step reads
    assert not result["all_met"]  # a line missed on one machine is missed


def test_a_decode_line_names_the_bytes_ratio_where_the_bench_measured_it(seed_lines):
    rows = [
        {"context": 2048, "batch": 1, "decode_ratio": 1.134, "bytes_ratio": 1.121},
        {"context": 2048, "batch": 4, "decode_ratio": 2.5, "bytes_ratio": 2.6},  # not batch 1: not read
        {"context": 8192, "batch": 1, "decode_ratio": 1.95},  # a file from before the column
    ]
    lines = seed_lines.check_speed(0.75, {"rows": rows})
    assert [(x["value"], x["ok"]) for x in lines] == [("1.13x (bytes ratio 1.12x)", False), ("1.95x", True)]
    assert seed_lines.check_speed(0.9, {"rows": rows}) == []  # beta 0.9 has no decode line


def test_a_line_fails_when_its_value_crosses_it(seed_lines):
    from tables import load
    from tables.front import SHIPPED_B09

    spec = SHIPPED_B09
    seed = spec.seeds[2]  # every quality and needle line met as measured
    fit, context, needles = (load(name) for name in (seed.fit, seed.context, seed.needles))
    default = load(seed.default_fit[0])
    default = dict(default, wall_seconds=fit["wall_seconds"] / 1.5)  # and a default fit that makes the fit line met
    free = load(spec.free_context)
    assert all(line["ok"] for line in seed_lines.check_seed(0.9, fit, context, needles, default, free=free))
    worse = copy.deepcopy(context)
    worse["rows"]["converted"]["ppl_ratio"]["2048"] = 1.3  # above the 1.15 line and the training-free 1.21
    failed = [
        line["line"] for line in seed_lines.check_seed(0.9, fit, worse, needles, default, free=free) if not line["ok"]
    ]
    assert failed == ["long documents 2048 <= 1.15", "long documents 2048 below training-free"]
    slow = dict(fit, wall_seconds=2.01 * default["wall_seconds"])
    failed = [
        line["line"]
        for line in seed_lines.check_seed(0.9, slow, context, needles, default, free=free)
        if not line["ok"]
    ]
    assert failed == ["fit <= 2x the default's"]
    other = copy.deepcopy(free)
    other["rows"]["original"]["ppl"]["2048"] += 0.5  # the training-free row was scored on other blocks
    bare = copy.deepcopy(context)  # a context without its own training-free row reads the other file's
    bare["rows"] = {name: row for name, row in bare["rows"].items() if not name.endswith(", training-free")}
    assert all(line["ok"] for line in seed_lines.check_seed(0.9, fit, bare, needles, default, free=free))
    with pytest.raises(ValueError, match="other blocks"):
        seed_lines.check_seed(0.9, fit, bare, needles, default, free=other)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipe", "recipes/nope.yaml"], "--recipe: no such recipe file 'recipes/nope.yaml'"),
        (["--recipe", SMOLLM, "--seeds", "0,x"], "--seeds: expected integers separated by commas, got '0,x'"),
        (["--recipe", SMOLLM, "--seeds", "1,1"], "--seeds: expected distinct integers >= 0"),
        (["--recipe", SMOLLM, "--reference", "recipes/nope.yaml"], "--reference: no such recipe file"),
        (["--recipe", SMOLLM, "--needles-args", "--lengths 'open"], "--needles-args: No closing quotation"),
        ([], "--recipe: required (or --shipped)"),
        (["--recipe", SMOLLM, "--shipped", "b05"], "argument --shipped: invalid choice: 'b05'"),
        (["--recipe", SMOLLM, "--", "--seed_everything", "4"], "--seed_everything: set for each fit by seed_lines"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(seed_lines, args, message, tmp_path, capsys):
    assert seed_lines.main(["--output", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("seed_lines: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_both_recipes_are_profiled_untimed_before_the_first_fit(seed_lines, tmp_path):
    """The profile cache is filled before any timed fit: a default fit that fills it on a fresh
    machine spent 72 s of 9.2 min in it (benchmarks/results/seed_lines/b09_l3k_epyc_bf16/reference)."""
    overrides = ["--model.head_map", "m.json", "--trainer.max_steps", "3", "--data.long_seq_len", "3072"]
    opts = seed_lines.parse(["--recipe", SMOLLM, "--seeds", "1", "--output", str(tmp_path / "o"), "--", *overrides])
    steps = seed_lines.plan(opts)
    assert [s.name for s in steps][:4] == ["recipe profile", "reference profile", "reference fit", "seed 1: fit"]
    recipe, reference = steps[0].args, steps[1].args
    assert recipe[:3] == ["profile", "--config", SMOLLM]
    assert recipe[3:-2] == ["--model.head_map", "m.json", "--data.long_seq_len", "3072"]  # no trainer flags
    assert reference[:3] == ["profile", "--config", seed_lines.REFERENCE] and reference[3] == "--output"
    assert steps[3].args[-len(overrides) :] == overrides  # the fits keep every override
    opts = seed_lines.parse(["--recipe", SMOLLM, "--reference", "none", "--output", str(tmp_path / "o")])
    assert [s.name for s in seed_lines.plan(opts)][:2] == ["recipe profile", "seed 0: fit"]


def test_reference_after_refits_the_default_right_after_the_last_seeds_fit(seed_lines, tmp_path):
    out = tmp_path / "o"
    opts = seed_lines.parse(["--recipe", SMOLLM, "--seeds", "2,0", "--reference-after", "--output", str(out)])
    names = [s.name for s in seed_lines.plan(opts)]
    assert names.index("reference fit, after") == names.index("seed 0: fit") + 1  # the last seed's fit, then it
    after = seed_lines.plan(opts)[names.index("reference fit, after")]
    assert after.args[:3] == ["fit", "--config", seed_lines.REFERENCE]
    assert after.result == out / "reference_after" / "fit_summary.json"
    assert "reference fit, after" not in [s.name for s in seed_lines.plan(seed_lines.parse(["--recipe", SMOLLM, "--output", str(out)]))]
    with pytest.raises(seed_lines.InputError, match="--reference-after: needs a default recipe"):
        seed_lines.parse(["--recipe", SMOLLM, "--reference", "none", "--reference-after", "--output", str(out)])


def test_the_fit_time_line_compares_with_the_mean_of_the_fits_before_and_after(seed_lines):
    fit = {"wall_seconds": 600.0}
    one = seed_lines.fit_time_line(fit, {"wall_seconds": 280.0})
    assert (one["ok"], one["value"]) == (False, "2.14x (10.0 vs 4.7 min)")
    both = seed_lines.fit_time_line(fit, [{"wall_seconds": 280.0}, {"wall_seconds": 360.0}])
    assert (both["ok"], both["value"]) == (True, "1.88x (10.0 vs 4.7 / 6.0 min, their mean; 2.14x / 1.67x each)")
    assert not seed_lines.fit_time_line({"wall_seconds": 641.0}, [{"wall_seconds": 280.0}, {"wall_seconds": 360.0}])["ok"]


@pytest.mark.slow
def test_a_tiny_run_fits_evaluates_checks_and_resumes(
    seed_lines, tiny_model_dir, tiny_corpus, tmp_path, monkeypatch, capsys
):
    """The whole run on the tiny model, each rfkit command in this process (a fresh interpreter per
    step is what the script runs; here it would cost the suite a minute of imports)."""
    from rfkit.cli import main as rfkit_main

    monkeypatch.setenv("RFKIT_CACHE", str(tmp_path / "cache"))
    ran = []

    def in_process(cmd, log):
        assert cmd[1:3] == ["-m", "rfkit.cli"]
        ran.append(cmd[3:])
        with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            try:
                rfkit_main(cmd[3:])
            except SystemExit as exit:
                return exit.code or 0
        return 0

    monkeypatch.setattr(seed_lines, "_run", in_process)
    out, runs = tmp_path / "out", tmp_path / "runs"
    overrides = tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "unused")[2:]  # after --config RECIPE
    at = overrides.index("--trainer.default_root_dir")
    del overrides[at : at + 2]  # each fit's own under --runs
    args = [
        "--recipe", SMOLLM, "--seeds", "3", "--reference", "none", "--output", str(out), "--runs", str(runs),
        "--context-args", f"--lengths 128 --tokens 256 --source {tiny_corpus}",
        "--needles-args", "--shapes passkey --lengths 256 --depths 0,1 --trials 1",
        "--", *overrides,
    ]  # fmt: skip
    assert seed_lines.main(args) == 0, capsys.readouterr().err
    assert [cmd[:2] for cmd in ran] == [["profile", "--config"], ["fit", "--config"], ["eval", "context"], ["eval", "needles"]]
    warm = ran.pop(0)  # the recipe's profile first, with the overrides rfkit profile takes
    assert "--model.dtype" in warm and "--trainer.max_steps" not in warm
    assert (runs / "seed_profile" / "head_map.json").is_file()
    assert ran[0][2:5] == [SMOLLM, "--seed_everything", "3"] and "--trainer.max_steps" in ran[0]
    summary = json.loads((out / "seed3" / "fit_summary.json").read_text())
    model = summary["model_dir"]
    assert model.startswith(str(runs / "seed3"))  # the fit's own folder, under --runs
    for cmd in ran[1:]:
        assert cmd[2:4] == ["--model", model]  # each evaluation reads the model the fit saved
    assert cmd[cmd.index("--lengths") + 1] == "256"  # --needles-args win over the defaults
    context = json.loads((out / "seed3" / "context" / "context.json").read_text())
    assert context["lengths"] == [128] and any(n.endswith("training-free") for n in context["rows"])
    result = json.loads((out / "lines.json").read_text())
    assert result["beta"] == 0.5 and result["overrides"].startswith("--model.dtype float32")
    names = [line["line"] for line in result["seeds"][0]["lines"]]
    assert names == ["long documents 128 below training-free", "needles the training-free model finds, missed"]
    first = (runs / "logs" / "seed_3_fit.log").read_text().splitlines()[0]  # the step's command line first
    assert (
        f"-m rfkit.cli fit --config {SMOLLM} --seed_everything 3"
        f" --trainer.default_root_dir {runs / 'seed3'} --model.dtype" in first
    )

    # done steps are not run again; a missing result runs its step alone
    ran.clear()
    (out / "seed3" / "needles" / "needles.json").unlink()
    capsys.readouterr()
    assert seed_lines.main(["--dry-run", *args]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("seed 3: needles: ") and f"--model {model}" in line
    assert ran == []
    assert seed_lines.main(args) == 0
    assert [cmd[:2] for cmd in ran] == [["eval", "needles"]]
