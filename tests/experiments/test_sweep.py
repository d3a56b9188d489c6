"""rfkit sweep: one profile, then quality and cache per beta, on the tiny model and corpus."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_cli, sweep_overrides  # pytest puts tests/ on sys.path (rootdir conftest, prepend mode)

from rfkit.conversion import evaluations
from rfkit.devices import native_bf16

SMOLLM = "recipes/smollm2_b05.yaml"


@pytest.mark.slow
def test_sweep_profiles_once_and_measures_every_beta(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    out_dir = tmp_path / "sweep"
    args = ["sweep", "--config", SMOLLM, "--betas", "1,0,0.5", "--output", str(out_dir), "--cache-length", "64", "--operators", "mamba"]
    code, out, err = run_cli([*args, *sweep_overrides(tiny_model_dir, tiny_corpus)], capsys)
    assert code == 0, err
    result = json.loads((out_dir / "sweep.json").read_text())
    rows = {r["beta"]: r for r in result["rows"]}
    assert sorted(rows) == [0.0, 0.5, 1.0]
    # beta 0 is the untouched model: the same perplexity and cache, exactly
    assert rows[0.0]["replaced_heads"] == 0 and rows[0.0]["ppl_ratio"] == 1.0 and rows[0.0]["cache_ratio"] == 1.0
    # 4 KV groups (2 layers x 2): beta 0.5 replaces 2 groups = 4 of 8 query heads, beta 1 all of them
    assert rows[0.5]["replaced_heads"] == 4 and rows[1.0]["replaced_heads"] == 8
    assert rows[0.5]["kept_kv_fraction"] == 0.5 and rows[1.0]["kept_kv_fraction"] == 0.0
    # measured cache: half the K/V plus the Mamba state; at beta 1 only the state is left
    orig = result["original"]
    assert rows[0.5]["cache_bytes"] == orig["cache_bytes"] // 2 + rows[0.5]["state_bytes"]
    assert rows[1.0]["cache_bytes"] == rows[1.0]["state_bytes"] > 0
    assert rows[1.0]["cache_ratio"] < rows[0.5]["cache_ratio"] < 1.0
    # the selections of one profile nest: every head replaced at 0.5 is replaced at 1.0
    small = json.loads((out_dir / "beta_0.5" / "head_map.json").read_text())["selected"]
    large = json.loads((out_dir / "beta_1" / "head_map.json").read_text())["selected"]
    assert all(set(a) <= set(b) for a, b in zip(small, large))
    assert (out_dir / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out_dir / "sweep.md").read_text()
    assert "| 0.5 | 4/8 | 50.0% |" in table and table in out + "\n"


@pytest.mark.slow
def test_sweep_with_fit_trains_each_beta(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    out_dir = tmp_path / "sweep"
    args = ["sweep", "--config", SMOLLM, "--betas", "0,0.5", "--output", str(out_dir), "--cache-length", "64", "--fit"]
    extra = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1",
             "--trainer.enable_progress_bar", "false", "--model.lr_scheduler", "null",
             "--model.transfer.long_source", str(tiny_corpus), "--model.transfer.long_seq_len", "64",
             "--model.transfer.long_samples", "2", "--data.long_source", str(tiny_corpus), "--data.long_seq_len", "64",
             ]  # fmt: skip  (the recipe's long blocks, in transfer and in training, at the tiny scale)
    code, out, err = run_cli([*args, *sweep_overrides(tiny_model_dir, tiny_corpus), *extra], capsys)
    assert code == 0, err
    result = json.loads((out_dir / "sweep.json").read_text())
    trained = [r for r in result["rows"] if r["trained"]]
    assert [r["beta"] for r in trained] == [0.5]  # beta 0 has nothing to train
    summary = json.loads(open(trained[0]["summary"]).read())
    assert summary["replaced_heads"] == 4
    assert abs(summary["ppl_converted"] - trained[0]["ppl"]) / trained[0]["ppl"] < 1e-4


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--betas", "0,1.5"], "--betas"),
        (["--betas", "half"], "--betas"),
        (["--betas", ""], "--betas"),
        (["--cache-length", "0"], "--cache-length"),
        (["--val-blocks", "-1"], "--val-blocks"),
        (["--bogus"], "--bogus"),
        (["--model.policy", "rfkit.conversion.policies.ExplicitHeads", "--model.policy.heads", "[[0]]"], "model.policy"),
        (["--operators", "mamba,slidng_window"], "--operators: unknown name 'slidng_window'; nearest: sliding_window"),
        (["--operators", "sliding_window(window=0)"], "--operators"),
        (["--operators", "sink_recent(sink=4,windw=8)"], "SinkRecentOperator takes no 'windw'"),
        (["--policies", "random(sed=1)"], "--policies: RandomHeads takes no 'sed'"),
        (["--policies", "explicit(heads=[[0]])"], "does not take a beta"),
        (["--policies", "random,random"], "--policies: the same spec is given twice"),
        (["--long", "embedded:shakespear"], "--long: unknown embedded data 'embedded:shakespear'"),
        (["--long", "embedded:shakespeare", "--long-lengths", "2k"], "--long-lengths: '2k' is not an integer"),
        (["--long", "embedded:shakespeare", "--long-blocks", "0"], "--long-blocks"),
        (["--trained", "no/such/dir"], "--trained: 'no/such/dir' is not a converted model directory"),
    ],
)
@pytest.mark.slow
def test_bad_sweep_input_is_one_line_and_exit_2(extra, field, tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch):
    import rfkit.conversion.convert

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(rfkit.conversion.convert, "load_base_model", no_load)
    args = ["sweep", "--config", SMOLLM, "--output", str(tmp_path / "s"), *sweep_overrides(tiny_model_dir, tiny_corpus), *extra]
    code, out, err = run_cli(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rfkit sweep: error:") and field in lines[0], err
    assert not (tmp_path / "s" / "sweep.json").exists()


def test_sweep_rejects_a_missing_recipe(tmp_path, capsys):
    code, out, err = run_cli(["sweep", "--config", str(tmp_path / "none.yaml")], capsys)
    assert code == 2 and "--config" in err and "does not exist" in err


@pytest.mark.slow
def test_sweep_compares_policies_and_operators_at_matched_cache(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    out_dir = tmp_path / "sweep"
    # the recipe's model.dtype auto: bf16 K/V where this CPU computes bf16, beside the Mamba block's
    # float32 state, which then holds the bytes of twice the tokens (sink 4 + window 36, not 16)
    recent = 36 if native_bf16("cpu")[0] else 16
    sink_recent = f"sink_recent(sink=4,window={recent})"
    args = [
        "sweep", "--config", SMOLLM, "--betas", "0.5", "--output", str(out_dir), "--cache-length", "64",
        "--policies", "recipe,random(seed=1),layerwise,streamed_loss(blocks=2)",
        "--operators", f"mamba,{sink_recent},sliding_window(window=64)",
        "--transfer", "--model.transfer.steps", "2", "--model.transfer.samples", "4",
        # the recipe's long blocks at the tiny model's scale, as tiny_args has them
        "--model.transfer.long_source", str(tiny_corpus), "--model.transfer.long_seq_len", "64",
        "--model.transfer.long_samples", "2",
    ]  # fmt: skip
    code, out, err = run_cli([*args, *sweep_overrides(tiny_model_dir, tiny_corpus)], capsys)
    assert code == 0, err
    result = json.loads((out_dir / "sweep.json").read_text())
    rows = {(r["policy"], r["operator"]): r for r in result["rows"]}
    assert len(rows) == 12
    policies = ("RecencyRatioPolicy", "random(seed=1)", "layerwise", "streamed_loss(blocks=2)")
    operators = ("mamba", sink_recent, "sliding_window(window=64)")
    assert sorted(rows) == sorted((p, o) for p in policies for o in operators)
    orig = result["original"]
    for (policy, operator), r in rows.items():
        # the same beta replaces the same number of KV groups under every policy: matched K/V
        assert r["replaced_heads"] == 4 and r["kept_kv_fraction"] == 0.5
        assert r["cache_bytes"] == orig["cache_bytes"] // 2 + r["state_bytes"]
        assert r["transferred"] == (operator == "mamba")  # window heads have no weights to fit
    for policy in policies:
        # sink 4 + the recent window holds the Mamba block's bytes (plus an 8-byte token counter per layer)
        mamba, sink = rows[(policy, "mamba")], rows[(policy, sink_recent)]
        tag = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in policy).strip("_")  # the row's folder
        selected = json.loads((out_dir / f"{tag}__mamba__beta_0.5" / "head_map.json").read_text())["selected"]
        converted_layers = sum(1 for heads in selected if heads)
        assert sink["state_bytes"] == mamba["state_bytes"] + 8 * converted_layers
        # a window longer than the 32-token blocks is full attention: the original perplexity
        assert abs(rows[(policy, "sliding_window(window=64)")]["ppl_ratio"] - 1.0) < 1e-4
    layerwise = json.loads((out_dir / "layerwise__mamba__beta_0.5" / "head_map.json").read_text())["selected"]
    assert layerwise == [[], [0, 1, 2, 3]]  # a whole layer, layer 0 kept
    measured = json.loads((out_dir / "streamed_loss_blocks_2__mamba__beta_0.5" / "head_map.json").read_text())["measured"]
    assert measured["name"] == "streamed_loss" and measured["blocks"] == 2 and len(measured["delta"]) == 2
    table = (out_dir / "sweep.md").read_text()
    assert "| layerwise | sliding_window(window=64) | 0.5 | 4/8 | 50.0% |" in table
    assert (out_dir / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_sweep_adds_trained_models_and_long_documents(tiny_model_dir, tiny_corpus, converted_dir, tmp_path, capsys):
    """--trained rows come from saved converted models; --long measures every row (and the
    original) on a second set of longer blocks, with ratios to the original's."""
    out_dir = tmp_path / "sweep"
    model_dir = tmp_path / "model"  # a copy: the sweep adds the comparison to the trained model's card
    shutil.copytree(converted_dir, model_dir)
    args = [
        "sweep", "--config", SMOLLM, "--betas", "0.5", "--output", str(out_dir), "--cache-length", "64",
        "--operators", "sink_recent(sink=4,window=16)", "--trained", str(model_dir),
        "--long", str(tiny_corpus), "--long-lengths", "64,96", "--long-blocks", "2",
    ]  # fmt: skip
    code, out, err = run_cli([*args, *sweep_overrides(tiny_model_dir, tiny_corpus)], capsys)
    assert code == 0, err
    result = json.loads((out_dir / "sweep.json").read_text())
    name = tiny_corpus.name
    assert result["long"]["blocks"] == {f"{name}@64": 2, f"{name}@96": 2}
    assert sorted(result["original"]["long_ppl"]) == [f"{name}@64", f"{name}@96"]
    window, trained, off = result["rows"]
    assert window["operator"] == "sink_recent(sink=4,window=16)" and not window["trained"]
    head_map = json.loads((converted_dir / "head_map.json").read_text())
    assert trained["trained"] and trained["model"] == str(model_dir) and trained["beta"] == head_map["beta"]
    assert trained["operator"].startswith("hybrid") and trained["operator"].endswith(" trained")
    # the recipe's model is a hybrid: a second row closes its state's gates, same cache
    assert off["operator"] == trained["operator"] + ", state off" and off["cache_bytes"] == trained["cache_bytes"]
    # 32-token blocks never leave the 4 + 56 window, 96-token blocks do: only there the state counts
    assert off["ppl"] == pytest.approx(trained["ppl"], rel=1e-6)
    assert off["long_ppl"][f"{name}@96"] != pytest.approx(trained["long_ppl"][f"{name}@96"], rel=1e-6)
    for row in (window, trained, off):
        for key, ppl in row["long_ppl"].items():
            assert row["long_ppl_ratio"][key] == pytest.approx(ppl / result["original"]["long_ppl"][key])
    # the trained directory is measured as saved: its perplexity is what loading it gives
    from rfkit.evals.perplexity import evaluate_perplexity

    from rfkit.config.loading import load_model
    from rfkit.data import TextDataModule

    data = TextDataModule(source=str(tiny_corpus), tokenizer=str(tiny_model_dir), seq_len=64, val_blocks=2, batch_size=1)
    data.setup("validate")
    model = load_model(str(converted_dir)).model
    expected = evaluate_perplexity(model, [{"input_ids": b[None]} for b in data.validation])
    assert trained["long_ppl"][f"{name}@64"] == pytest.approx(expected, rel=1e-5)
    table = (out_dir / "sweep.md").read_text()
    assert f"PPL ratio {name}@64 | PPL ratio {name}@96 |" in table and "trained |" in table
    assert (out_dir / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the trained model's card: its two rows beside the original and the training-free one at its beta
    (entry,) = evaluations.load(model_dir).values()
    cells = entry["rows"][f"perplexity, 2 blocks {name}@96"]
    assert cells == {
        "original": result["original"]["long_ppl"][f"{name}@96"],
        "converted": trained["long_ppl"][f"{name}@96"],
        "converted, state off": off["long_ppl"][f"{name}@96"],
        "sink_recent(sink=4,window=16), training-free": window["long_ppl"][f"{name}@96"],
    }
    assert entry["commands"]["converted"].startswith("rfkit sweep --config")
