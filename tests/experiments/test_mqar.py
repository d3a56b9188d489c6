"""MQAR ablation (``rfkit eval mqar``): the generator, accuracy, head selection and conversion, the CLI."""

import json
from pathlib import Path

import pytest
import torch

from rfkit.experiments.mqar_task import MQARError, make_mqar, mqar_accuracy, vocab_split
from rfkit.experiments.mqar_training import (
    ModelSettings,
    SelectSettings,
    TrainSettings,
    build_model,
    convert_for_beta,
    head_map_for,
    lr_at,
    profile_model,
)

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "recipes" / "mqar_smoke.yaml")
TINY = ModelSettings(d_model=32, layers=2, heads=4, kv_heads=2, vocab_size=32, d_state=4, expand=1)


from helpers import run_cli  # noqa: E402  (tests/ is on sys.path: one in-process runner for all CLI tests)


# ------------------------------------------------------------------------------------ generator
def test_keys_and_values_come_from_disjoint_halves_and_labels_answer_their_key():
    n, length, pairs, vocab = 50, 64, 6, 40
    inputs, labels = make_mqar(n, length, pairs, vocab, seed=3)
    keys, values = vocab_split(vocab)
    assert set(keys).isdisjoint(values) and 0 not in keys and 0 not in values
    assert inputs.shape == labels.shape == (n, length)
    assert int(inputs.min()) >= 1 and int(inputs.max()) < vocab
    for row, lab in zip(inputs.tolist(), labels.tolist()):
        prefix_keys, prefix_values = row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2]
        assert all(k in keys for k in prefix_keys) and all(v in values for v in prefix_values)
        assert len(set(prefix_keys)) == pairs  # distinct keys
        answer = dict(zip(prefix_keys, prefix_values))
        asked = [t for t, y in enumerate(lab) if y != -100]
        assert len(asked) == pairs  # every key queried once by default
        assert min(asked) > 2 * pairs  # answers only in the query region
        for t in asked:
            assert row[t - 1] in answer and lab[t] == answer[row[t - 1]] == row[t]  # self-consistent alignment
        # a key token appears only in its pair and its query: noise is drawn from the value half
        key_positions = [t for t, tok in enumerate(row) if tok in keys]
        assert sorted(key_positions) == sorted(list(range(0, 2 * pairs, 2)) + [t - 1 for t in asked])


def test_fewer_queries_and_lengths_are_respected():
    inputs, labels = make_mqar(20, 40, 5, 32, seed=0, num_queries=2)
    assert inputs.shape == (20, 40)
    assert ((labels != -100).sum(1) == 2).all()


def test_placement_is_deterministic_in_the_seed_and_follows_the_power_law():
    a = make_mqar(200, 256, 8, 64, seed=5)
    b = make_mqar(200, 256, 8, 64, seed=5)
    c = make_mqar(200, 256, 8, 64, seed=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1] != -100, c[1] != -100)

    def mean_answer_position(power_a):
        _, labels = make_mqar(400, 256, 8, 64, power_a=power_a, seed=1)
        return (labels != -100).nonzero()[:, 1].float().mean().item()

    # power_a = 1 is uniform over the 120 slots (mean position ~ 16 + 120); 0.01 favours early slots
    assert mean_answer_position(0.01) < mean_answer_position(1.0) - 30


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"input_seq_len": 30, "num_kv_pairs": 8}, "input_seq_len"),  # 2*8 + 2*8 = 32 > 30
        ({"num_kv_pairs": 20, "vocab_size": 32}, "vocab_size"),
        ({"num_kv_pairs": 4, "num_queries": 5}, "num_queries"),
        ({"power_a": 0.0}, "power_a"),
        ({"num_examples": 0}, "num_examples"),
        ({"num_kv_pairs": -1}, "num_kv_pairs"),
    ],
)
def test_bad_settings_raise_naming_the_field(kwargs, field):
    settings = {"num_examples": 4, "input_seq_len": 64, "num_kv_pairs": 4, "vocab_size": 64}
    settings.update(kwargs)
    with pytest.raises(MQARError, match=field):
        make_mqar(**settings)


# ------------------------------------------------------------------------------------ accuracy
def test_accuracy_counts_the_argmax_of_the_previous_position():
    labels = torch.tensor([[-100, -100, 7, -100, 5], [-100, 3, -100, -100, -100]])
    logits = torch.zeros(2, 5, 10)
    logits[0, 1, 7] = 1.0  # predicts labels[0, 2] = 7: right
    logits[0, 3, 4] = 1.0  # predicts 4 for labels[0, 4] = 5: wrong
    logits[0, 4, 5] = 9.0  # the last position predicts nothing
    logits[1, 0, 3] = 1.0  # right
    assert mqar_accuracy(logits, labels) == (2, 3)


def test_learning_rate_schedule_ramps_then_decays_to_the_floor():
    t = TrainSettings(steps=100, warmup_steps=10, lr=1e-3, lr_warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, t) == pytest.approx(1e-4) and lr_at(9, t) == pytest.approx(1e-3)
    assert lr_at(99, t) == pytest.approx(1e-4, rel=0.01)
    assert lr_at(50, t) < lr_at(20, t)


# ------------------------------------------------------------------------------------ selection and conversion
@pytest.fixture(scope="module")
def tiny_profiled():
    model = build_model(TINY, 64, seed=0).eval()
    inputs, _ = make_mqar(8, 64, 4, TINY.vocab_size, seed=9)
    profile = profile_model(model, [{"input_ids": inputs}], SelectSettings(), window=6)
    return model, profile


def test_beta_zero_is_the_untouched_model(tiny_profiled):
    model, profile = tiny_profiled
    fresh = build_model(TINY, 64, seed=0).eval()
    head_map = head_map_for(model, profile, 0.0, SelectSettings(), window=6)
    assert head_map.replaced_heads == 0
    same = convert_for_beta(model, head_map, TINY)
    assert same is model and type(same).__name__ == "LlamaForCausalLM"
    ids, _ = make_mqar(2, 64, 4, TINY.vocab_size, seed=1)
    with torch.no_grad():
        assert torch.equal(same(ids).logits, fresh(ids).logits)


@pytest.mark.parametrize(
    "beta, granularity, expected", [(0.25, "kv_group", 2), (0.5, "kv_group", 4), (1.0, "kv_group", 8), (0.25, "query_head", 2)]
)
def test_selection_replaces_the_expected_heads(tiny_profiled, beta, granularity, expected):
    from rfkit.conversion.policies import RecencyRatioPolicy

    model, profile = tiny_profiled
    select = SelectSettings(granularity=granularity)
    head_map = head_map_for(model, profile, beta, select, window=6)
    assert head_map.replaced_heads == expected and head_map.total_heads == 8
    assert head_map.window == 6 and head_map.rai == profile.rai
    # the chosen units are the top-ranked ones of the profile
    policy = RecencyRatioPolicy(window=6, beta=beta, granularity=granularity)
    from rfkit.models.layout import AttentionLayout

    scores = policy.unit_scores(AttentionLayout.from_config(model.config), profile)
    ranked = sorted(scores, key=lambda k: (-scores[k][0], -scores[k][1], k))
    size = 2 if granularity == "kv_group" else 1
    top = ranked[: expected // size]
    chosen = {(layer, h // size) for layer, heads in enumerate(head_map.selected) for h in heads}
    assert chosen == set(top)
    converted = convert_for_beta(model, head_map, TINY)
    assert converted is not model and type(model).__name__ == "LlamaForCausalLM"  # the original stays as it was
    mixers = sum(1 for layer in converted.model.layers if hasattr(layer.self_attn, "mixer"))
    assert mixers == sum(1 for heads in head_map.selected if heads)
    ids, _ = make_mqar(2, 64, 4, TINY.vocab_size, seed=1)
    assert converted(ids).logits.shape == (2, 64, TINY.vocab_size)


# ------------------------------------------------------------------------------------ command line
TINY_ARGS = [
    "--config", SMOKE,
    "--model.d_model", "32", "--model.heads", "4", "--model.kv_heads", "2", "--model.d_state", "4",
    "--data.train_lengths", "[32]", "--data.train_kv_pairs", "[4]", "--data.train_examples", "64",
    "--data.eval_kv_pairs", "[4, 4]", "--data.eval_examples", "8", "--eval_lengths", "[32, 64]",
    "--train.steps", "4", "--train.warmup_steps", "2", "--train.batch_size", "4",
    "--select.profile_examples", "4", "--betas", "[0, 0.5, 1]", "--progress", "false",
]  # fmt: skip


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--betas", "[0, 1.5]"], "betas"),
        (["--eval_lengths", "[-4, 64]"], "eval_lengths"),
        (["--train.stepz", "3"], "train.stepz"),
        (["--train.steps", "many"], "train.steps"),
        (["--data.train_kv_pairs", "[4, 8]"], "data.train_kv_pairs"),
        (["--train.warmup_steps", "9"], "train.warmup_steps"),
        (["--select.granularity", "layer"], "select.granularity"),
    ],
)
def test_bad_config_values_are_one_line_and_exit_2(extra, field, tmp_path, capsys):
    code, _out, err = run_cli(["eval", "mqar", *TINY_ARGS, "--output_dir", str(tmp_path), *extra], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("rfkit eval: error:") and field in err, err
    assert not (tmp_path / "results.json").exists()


def test_unknown_key_in_the_recipe_is_one_line_and_exit_2(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(Path(SMOKE).read_text() + "\ncolour: red\n")
    code, _out, err = run_cli(["eval", "mqar", "--config", str(recipe)], capsys)
    assert code == 2 and err.count("\n") == 1 and "colour" in err, err


def check_outputs(out_dir: Path, betas, lengths):
    results = json.loads((out_dir / "results.json").read_text())
    assert list(results["accuracy"]) == [str(float(b)) for b in betas]
    for acc in results["accuracy"].values():
        assert list(acc) == [str(n) for n in lengths]
        assert all(0.0 <= a <= 1.0 for a in acc.values())
    assert (out_dir / "mqar.png").stat().st_size > 1000
    assert (out_dir / "mqar.md").read_text().startswith("| beta |")
    return results


@pytest.mark.parametrize("recipe", ["mqar_smoke.yaml", "mqar_ablation.yaml"])
def test_tiny_run_writes_results_plot_and_table(recipe, tmp_path, capsys):
    """Each MQAR recipe through its own command, every setting its own but the scale (TINY_ARGS)."""
    assert TINY_ARGS[:2] == ["--config", SMOKE]
    args = ["--config", str(ROOT / "recipes" / recipe), *TINY_ARGS[2:]]
    code, out, err = run_cli(["eval", "mqar", *args, "--output_dir", str(tmp_path)], capsys)
    assert code == 0, err
    results = check_outputs(tmp_path, [0, 0.5, 1], [32, 64])
    assert [results["replaced_heads"][b]["replaced"] for b in ("0.0", "0.5", "1.0")] == [0, 4, 8]
    assert results["head_maps"]["0.5"]["beta"] == 0.5 and results["settings"]["train"]["steps"] == 4
    assert "| 0.5 |" in out


@pytest.mark.slow
@pytest.mark.integration
def test_smoke_recipe_shows_that_attention_must_stay(tmp_path, capsys):
    # The recipe at a smaller scale: the two ends of its beta sweep (the middle betas cost 2 of
    # the suite's minutes), training at its shorter length only (64: 2/3 of the tokens per step,
    # and the circuit forms sooner there) and 500 steps with 400 of warm-up instead of 750 / 500.
    # Seeds 0/1/2 at this scale: beta 0 0.791/0.979/0.963, beta 1 0.029/0.024/0.034 at length 64
    # (at 600 steps: 1.000/0.978/1.000 and 0.029/0.035/0.024; a 300-step warm-up is too short).
    # Its own one thread: `make test` runs the suite on every core at once (pytest-xdist), where
    # two OpenMP threads per test made this run 3x slower.
    betas, lengths = [0.0, 1.0], [64, 128]
    scale = [
        "--betas", json.dumps(betas), "--eval_lengths", json.dumps(lengths), "--data.eval_kv_pairs", "[4, 8]",
        "--data.train_lengths", "[64]", "--data.train_kv_pairs", "[4]",
        "--train.steps", "500", "--train.warmup_steps", "400",
    ]  # fmt: skip
    args = ["eval", "mqar", "--config", SMOKE, *scale, "--output_dir", str(tmp_path)]
    code, _out, err = run_cli(args, capsys)
    assert code == 0, err
    results = check_outputs(tmp_path, betas, lengths)
    acc = results["accuracy"]
    shortest = str(min(lengths))
    assert results["replaced_heads"]["1.0"]["replaced"] == results["replaced_heads"]["1.0"]["total"]
    assert acc["0.0"][shortest] > 0.5  # the all-attention model learned MQAR
    assert acc["1.0"][shortest] < 0.2  # all heads Mamba: recall collapses
    assert acc["0.0"][shortest] > acc["1.0"][shortest] + 0.3


@pytest.mark.parametrize("name", ["mqar_smoke.yaml", "mqar_ablation.yaml"])
def test_mqar_recipes_parse_and_name_their_command(name):
    from rfkit.experiments.mqar import parse_config

    text = (ROOT / "recipes" / name).read_text()
    assert text.startswith("#") and f"rfkit eval mqar --config recipes/{name}" in text
    cfg = parse_config(["--config", str(ROOT / "recipes" / name)])
    assert cfg.betas == [0.0, 0.25, 0.5, 0.75, 1.0] and len(cfg.eval_lengths) >= 3
    assert 0 < cfg.train.warmup_steps < cfg.train.steps
    if name == "mqar_ablation.yaml":  # the paper's model
        m = cfg.model
        assert (m.layers, m.d_model, m.heads, m.kv_heads) == (2, 512, 8, 4)
        assert cfg.eval_lengths == [128, 256, 512, 1024]
