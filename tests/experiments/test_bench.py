"""``rfkit bench cache`` / ``rfkit bench speed`` on a tiny converted model, and their bad input.

Timings are not asserted (benchmarks, not timed tests); the cache bytes are, exactly.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from helpers import SMOLLM, run_cli
from transformers import AutoModelForCausalLM

from rfkit.conversion import evaluations
from rfkit.conversion.headmap import HeadMap
from rfkit.experiments import bench
from rfkit.experiments.footprint import step_bytes, weight_bytes_per_step
from rfkit.experiments.speed import cache_bytes_per_sequence
from rfkit.models.cache import cache_bytes


@pytest.fixture(scope="module")
def tiny_recipe(tiny_model_dir, tiny_corpus, tmp_path_factory):
    """The SmolLM2 recipe pointed at the tiny model and corpus, as a file."""
    config = yaml.safe_load(open(SMOLLM))
    config["model"]["base_model"] = str(tiny_model_dir)
    config["model"]["policy"]["init_args"]["window"] = 4
    config["data"].update(
        source=str(tiny_corpus), seq_len=32, batch_size=2, calibration_samples=4, val_blocks=4, split=[0.1, 0.1]
    )
    config["model"]["transfer"].update(steps=5, long_source=str(tiny_corpus), long_seq_len=64, long_samples=2)
    path = tmp_path_factory.mktemp("recipe") / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_cache_bench_measures_exact_bytes_and_the_analytic_prediction(converted_dir, tmp_path, capsys):
    out = tmp_path / "cache.json"
    model_dir = tmp_path / "model"  # a copy: the bench adds its numbers to the model's card
    shutil.copytree(converted_dir, model_dir)
    code, stdout, err = run_cli(
        ["bench", "cache", "--model", str(model_dir), "--lengths", "8,40", "--prompt-len", "4", "--chunk", "7",
         "--json", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    head_map = HeadMap.load(converted_dir / "head_map.json")
    model = AutoModelForCausalLM.from_pretrained(str(converted_dir))
    # by hand: 2 layers x 2 KV heads x (K and V) x head_dim 16 x e bytes per token in the original,
    # e the bytes of the weights' dtype (the recipe's model.dtype auto: 2 where the CPU computes bf16)
    e = _weight_dtype(converted_dir).itemsize
    kv_orig = 2 * 2 * 2 * 16 * e
    kept_kv = 0
    state = 0
    for heads in head_map.selected:
        replaced_kv = len({h // 2 for h in heads})  # kv_group selection: whole groups
        kept_kv += 2 - replaced_kv
        if heads:  # the recipe's hybrid: K and V of 4 sink + 56 recent tokens, a long counter,
            # and a 16-feature linear-attention state (16 x (16 + 1)), float32 in every dtype, per replaced KV head
            state += replaced_kv * (2 * (4 + 56) * 16 * e + 16 * (16 + 1) * 4) + 8
    kv_conv = kept_kv * 2 * 16 * e
    for row, length in zip(result["rows"], (8, 40)):
        tokens = 4 + length
        assert row["cache_bytes_original"] == kv_orig * tokens
        assert row["cache_bytes_converted"] == kv_conv * tokens + state
        assert row["state_bytes_converted"] == state > 0
        assert row["cs"] == pytest.approx((kv_conv * tokens + state) / (kv_orig * tokens), abs=1e-12)
        assert row["cs_rel_diff"] < 1e-9
        assert row["prefill_peak_bytes_original"] >= 0 and "RSS" in row["peak_method"]
    assert result["kept_kv_fraction"] == kept_kv / 4
    assert "| 40 |" in stdout and "cs analytic" in stdout
    # the card of the measured model now carries both models' bytes, credited to the command
    (record,) = evaluations.load(model_dir).values()
    assert record["rows"]["cache bytes, l_g 40"] == {"original": kv_orig * 44, "converted": kv_conv * 44 + state}
    assert record["commands"]["converted"].startswith(f"rfkit bench cache --model {model_dir} --lengths 8,40")
    card = (model_dir / "README.md").read_text()
    assert f"| cache bytes, l_g 40 | {kv_orig * 44:,} | {kv_conv * 44 + state:,} |" in card


@pytest.mark.slow
def test_chunked_cache_growth_holds_what_token_by_token_generate_holds(converted_dir):
    model = AutoModelForCausalLM.from_pretrained(str(converted_dir)).eval()
    prompt, new = 5, 9
    ids = bench._random_ids(model, prompt, seed=3, device=torch.device("cpu"))
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    held = cache_bytes(gen.past_key_values)
    # generate feeds the prompt and new - 1 generated tokens (the last one is never fed back)
    for chunk in (1, 3, 100):
        measured = bench.cache_after_generation(model, prompt, new - 1, chunk, seed=3, device=torch.device("cpu"))
        assert {k: measured[k] for k in held} == held
        assert measured["tokens"] == prompt + new - 1


def test_max_input_search_brackets_the_budget(monkeypatch):
    # The search itself, on a measurement with a known answer: peak = 1000 bytes per token.
    monkeypatch.setattr(bench, "prefill_peak", lambda model, n, seed, device: {"peak_bytes": 1000 * n})
    found = bench.max_input_length(None, 300_000, 0, "cpu", start=64)
    assert 300 - (512 - 256) // 32 <= found["max_input"] <= 300
    assert all(p["peak_bytes"] == 1000 * p["length"] for p in found["probes"])
    assert bench.max_input_length(None, 10, 0, "cpu", start=64)["max_input"] == 0


@pytest.mark.slow
def test_prefill_peak_on_cpu_covers_the_cache():
    from helpers import tiny_model

    model = tiny_model("llama")
    peak = bench.prefill_peak(model, 6000, seed=0, device=torch.device("cpu"))
    assert peak["cache_bytes"] == 2 * 2 * 2 * 16 * 4 * 6000
    assert peak["peak_bytes"] >= peak["cache_bytes"]


@pytest.mark.slow
def test_speed_bench_rows(converted_dir, tmp_path, capsys):
    out = tmp_path / "speed.json"
    code, stdout, err = run_cli(
        ["bench", "speed", "--model", str(converted_dir), "--contexts", "16,48", "--runs", "2",
         "--decode-tokens", "3", "--json", str(out), "--no-record"], capsys)  # fmt: skip
    assert code == 0, err
    assert not (converted_dir / evaluations.FILE).exists()  # --no-record: the model directory is left alone
    result = json.loads(out.read_text())
    assert [r["context"] for r in result["rows"]] == [16, 48]
    for row in result["rows"]:
        for key in ("prefill_tps_original", "prefill_tps_converted", "decode_tps_original", "decode_tps_converted"):
            assert row[key] > 0
        assert len(row["prefill_s_runs_original"]) == len(row["decode_s_per_token_runs_converted"]) == 2
    assert "| 48 |" in stdout and "Median of 2 interleaved runs" in stdout
    original = bench.load_pair(str(converted_dir), torch.device("cpu")).original
    e = _weight_dtype(converted_dir).itemsize
    for row in result["rows"]:  # the original reads its weights and 2 layers x 2 KV heads x K, V x 16 x e per token
        weights = weight_bytes_per_step(original)
        assert row["bytes_per_step_original"] == weights + 2 * 2 * 2 * 16 * e * row["context"]
        assert row["bytes_ratio"] == row["bytes_per_step_original"] / row["bytes_per_step_converted"]
    # fewer cached tokens, more bytes saved: the ratio grows with the context
    assert result["rows"][1]["bytes_ratio"] > result["rows"][0]["bytes_ratio"]
    assert "bytes ratio" in stdout and f"{result['rows'][1]['bytes_ratio']:.2f}x |" in stdout


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_reads_every_weight_once_and_one_row_of_an_input_table_it_does_not_share(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config)
    # by hand, float32: q and o 32 x 32, k and v 32 x 16 (2 KV heads of 8), the MLP 3 x 32 x 64, two norms
    layer = 4 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32)
    head = 4 * 100 * 32  # the output head reads the whole table
    input_row = 0 if tied else 4 * 32  # an input table of its own: one row a token
    assert weight_bytes_per_step(model) == 2 * layer + 4 * 32 + head + input_row
    # and the cache: 2 layers x 2 KV heads x K, V x 8 x 4 bytes per token per sequence, no state
    step = step_bytes(model, context=10, batch=3)
    assert step["cache"] == 3 * 10 * 2 * 2 * 2 * 8 * 4
    assert step["total"] == step["weights"] + step["cache"]


def test_speed_bench_compile_runs_the_compiled_steady_step(converted_dir, tmp_path, capsys, monkeypatch):
    """--compile compiles every window mixer's steady step; with the C step off (as on a GPU)
    the decode runs through it and gives rows as before."""
    from rfkit.models.window import WindowAttention

    monkeypatch.setattr(WindowAttention, "use_kernel", False)
    torch._dynamo.utils.counters.clear()
    out = tmp_path / "speed.json"
    code, _, err = run_cli(
        ["bench", "speed", "--model", str(converted_dir), "--contexts", "96", "--runs", "1",
         "--decode-tokens", "4", "--compile", "--json", str(out), "--no-record"], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert any(n.startswith("compiled the steady decode step of ") for n in result["notes"])
    assert result["rows"][0]["decode_tps_converted"] > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the compiled step ran


@pytest.mark.slow
def test_speed_bench_batches_budget_and_layer_step(converted_dir, tmp_path, capsys):
    """--batch gives one row per context and batch; --max-input picks the largest batch whose
    measured cache fits (more for the converted model, whose cache is smaller); --layer-step
    times one layer's decode step and counts its torch calls."""
    out = tmp_path / "speed.json"
    code, stdout, err = run_cli(
        ["bench", "speed", "--model", str(converted_dir), "--contexts", "200", "--runs", "1", "--decode-tokens", "3",
         "--batch", "1,2", "--max-input", "400KiB", "--max-batch", "64", "--layer-step", "--json", str(out),
         "--no-record"], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert [(r["context"], r["batch"]) for r in result["rows"]] == [(200, 1), (200, 2)]
    model = AutoModelForCausalLM.from_pretrained(str(converted_dir))
    (budget,) = result["budget"]
    for name in ("original", "converted"):
        per_seq = budget[f"cache_bytes_per_sequence_{name}"]
        assert per_seq == cache_bytes_per_sequence(model if name == "converted" else _original(converted_dir), 200, 0, torch.device("cpu"))
        assert budget[f"batch_fits_{name}"] == 400 * 1024 // per_seq
        assert budget[f"decode_tps_{name}"] > 0
    assert budget["batch_fits_converted"] > budget["batch_fits_original"]
    (step,) = result["layer_step"]
    assert step["layers_converted"] == sum(1 for heads in HeadMap.load(converted_dir / "head_map.json").selected if heads)
    assert step["torch_calls_original"] > 0 and step["torch_calls_converted"] > 0 and step["step_us_converted"] > 0
    assert "One attention layer's decode step" in stdout and "within a cache budget of 0.39 MiB" in stdout


@pytest.mark.slow
def test_decode_layers_benchmark_times_every_layer_and_bounds_the_step(converted_dir, tmp_path, monkeypatch):
    """benchmarks/decode_layers.py on the tiny converted model: one row per context, every layer
    timed in both models and classed by what the head map did to it, and a head-map bound that
    only removes time (at most the original's step, at least the original's projections)."""
    import importlib.util
    import sys

    from helpers import ROOT

    spec = importlib.util.spec_from_file_location("decode_layers", ROOT / "benchmarks" / "decode_layers.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "layers.json"
    argv = ["decode_layers.py", "--model", str(converted_dir), "--contexts", "40,80", "--runs", "2", "--tokens", "3", "--output", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    result = json.loads(out.read_text())
    assert result["provenance"]["command"].startswith("python benchmarks/decode_layers.py --model ")
    selected = HeadMap.load(converted_dir / "head_map.json").selected
    model = AutoModelForCausalLM.from_pretrained(str(converted_dir))
    kv = model.config.num_key_value_heads
    assert [r["context"] for r in result["rows"]] == [40, 80]
    for row in result["rows"]:
        layers = row["layers"]
        assert len(layers) == len(selected)
        for layer, heads in zip(layers, selected):
            assert layer["replaced_kv_heads"] == len(heads) * kv // model.config.num_attention_heads  # whole KV groups
            assert layer["kind"] == ("unconverted" if not heads else "converted, no kept heads" if layer["replaced_kv_heads"] == kv else "converted, kept heads")
            assert 0 < layer["original_projections_us"] < layer["original_us"] and layer["converted_us"] > 0
        assert sum(g["layers"] for g in row["by_kind"].values()) == len(selected)
        projections = sum(layer["original_projections_us"] for layer in layers) / 1000
        assert row["step_ms_original"] - row["attention_ms_original"] + projections <= row["head_map_bound_step_ms"] <= row["step_ms_original"]
        assert row["head_map_bound_ratio"] == pytest.approx(row["step_ms_original"] / row["head_map_bound_step_ms"])
        assert len(row["step_ms_runs"]["original"]) == len(row["step_ms_runs"]["converted"]) == 2


def _weight_dtype(model_dir) -> torch.dtype:
    from rfkit.config.loading import dir_dtype

    return dir_dtype(model_dir)


def _original(converted_dir):
    """The converted model's original, in the dtype the converted model was saved in."""
    from rfkit.config.loading import DTYPE_NAMES
    from rfkit.conversion.convert import load_base_model

    dtype = DTYPE_NAMES[_weight_dtype(converted_dir)]
    return load_base_model(HeadMap.load(converted_dir / "head_map.json").model, dtype).eval()


@pytest.mark.slow
def test_cache_bench_from_a_recipe_converts_without_training(tiny_recipe, capsys):
    code, stdout, err = run_cli(
        ["bench", "cache", "--model", str(tiny_recipe), "--lengths", "6", "--prompt-len", "2", "--no-peak"], capsys
    )
    assert code == 0, err
    assert "converted from the recipe without training" in stdout
    assert "prefill peak" not in stdout


@pytest.mark.slow
def test_a_recipe_is_benched_as_the_architecture_its_fit_saves(tiny_recipe, tmp_path, monkeypatch):
    """No attention transfer (weights change neither cache size nor speed) and no LoRA adapters (a
    saved fit has them merged, and unmerged they would add their own products to every step): the
    bench measures the saved model's architecture, its new weights float32 as saved."""
    from rfkit import pipeline
    from rfkit.config.loading import ModelSpec

    config = yaml.safe_load(tiny_recipe.read_text())
    config["model"]["lora"] = {"r": 2}
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(pipeline, "transfer", lambda *args, **kwargs: pytest.fail("the bench ran the attention transfer"))
    model = bench.load_pair(str(recipe), torch.device("cpu")).converted
    assert not any(".lora_" in name for name, _ in model.named_parameters())
    mixers = [m for name, m in model.named_modules() if name.endswith(".mixer")]
    assert mixers and all(p.dtype == torch.float32 for m in mixers for p in m.parameters())
    # the same recipe made ready to train (fit, convert, eval): the adapters are there
    monkeypatch.setattr(pipeline, "transfer", lambda *args, **kwargs: None)
    trained = ModelSpec.of(str(recipe), require_converted=True).converted("cpu")
    assert any(".lora_" in name for name, _ in trained.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["cache", "--lengths", "0"], "--lengths: lengths must be positive integers, got 0"),
        (["cache", "--lengths", "1024,-5"], "--lengths: lengths must be positive integers, got -5"),
        (["cache", "--lengths", "ten"], "--lengths: 'ten' is not an integer"),
        (["speed", "--contexts", "0"], "--contexts: lengths must be positive integers, got 0"),
        (["speed", "--runs", "0"], "--runs: must be a positive integer"),
        (["speed", "--batch", "0"], "--batch: batch sizes must be positive integers, got 0"),
        (["speed", "--batch", "four"], "--batch: 'four' is not an integer; give positive integers like 1,4"),
        (["speed", "--max-input", "lots"], "--max-input: 'lots' is not a byte budget"),
        (["speed", "--max-batch", "0"], "--max-batch: must be a positive integer"),
        (["cache", "--max-input"], "--max-input: needs a value (a memory budget"),
        (["cache", "--max-input", "lots"], "--max-input: 'lots' is not a byte budget"),
        (["cache", "--max-input", "0MiB"], "--max-input: the budget must be positive"),
        (["cache", "--prompt-len", "0"], "--prompt-len: must be a positive integer"),
        (["cache", "--device", "tpu"], "--device: 'tpu' is not allowed"),
        (["cache", "--json", "/nonexistent/dir/out.json"], "--json: directory '/nonexistent/dir' does not exist"),
        ([], "the following arguments are required: cache|speed"),
    ],
)
def test_bad_bench_input_is_one_line_and_exit_2(converted_dir, args, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "load_pair", lambda *a: pytest.fail("a model was loaded"))
    argv = ["bench", *args[:1], "--model", str(converted_dir), *args[1:]] if args else ["bench"]
    code, stdout, err = run_cli(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


def test_bad_model_arguments(tiny_model_dir, tmp_path, capsys):
    cases = [
        (str(tmp_path), "is not a model directory (no config.json)"),
        (str(tiny_model_dir), "holds a 'llama' model, not an rfkit-converted one"),
        (str(tmp_path / "missing"), "does not exist"),
        (str(tiny_model_dir / "config.json"), "is a file but not a recipe"),
    ]
    for spec, message in cases:
        code, stdout, err = run_cli(["bench", "cache", "--model", spec], capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_recipe_that_cannot_be_converted(tiny_recipe, tmp_path, capsys):
    config = yaml.safe_load(tiny_recipe.read_text())
    config["model"]["base_model"] = str(tmp_path / "no-such-model")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    out = tmp_path / "out.json"
    code, stdout, err = run_cli(["bench", "cache", "--model", str(bad), "--json", str(out)], capsys)
    assert code == 2 and "model.base_model" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_rotation_agreement_decodes_the_same_tokens_both_ways(converted_dir, tmp_path, monkeypatch):
    """benchmarks/rotation_agreement.py: a model whose layer 0 keeps no head decodes with the
    rotation inside the compiled step and with the rotary matrix, greedy tokens and logits alike
    (and the layers are left rotating in the step); the command line writes its file for a saved
    model (the tiny one keeps heads in every layer: nothing rotates in the step, nothing differs)."""
    import sys

    from helpers import converted_tiny, load_script, random_ids

    from rfkit.operators import HybridOperator

    script = load_script("benchmarks/rotation_agreement.py")
    model = converted_tiny(HybridOperator(sink=2, window=6, feature_dim=4), torch.float32, layers=((0, 1, 2, 3), (2, 3)))
    found = script.agreement(model, random_ids(2, 16, seed=9), 8)
    assert found["layers_rotating_in_step"] == 1 and found["converted_layers"] == 2
    assert found["tokens_identical"] and found["max_abs_logit_difference"] < 1e-5 < found["max_logit"]
    assert model.model.layers[0].self_attn._mixer_rotates

    out = tmp_path / "agreement.json"
    argv = ["rotation_agreement.py", "--model", str(converted_dir), "--context", "40", "--tokens", "6", "--output", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    result = json.loads(out.read_text())
    assert result["provenance"]["command"].startswith("python benchmarks/rotation_agreement.py --model ")
    assert result["context"] == 40 and result["layers_rotating_in_step"] == 0 and result["tokens_identical"]
