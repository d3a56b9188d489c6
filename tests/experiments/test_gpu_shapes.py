"""benchmarks/gpu/shapes.py, the GPU shape benchmark, rehearsed on the CPU in its --tiny mode:
the same code path (random-init models of the same families, RandomHeads, rfkit's conversion,
bench's cache and speed measurements) on 2-layer configs and short lengths.

Timings are not asserted (benchmarks, not timed tests); bytes and the shape of the record are.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import ROOT


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: tiny models gain nothing from two, and on a shared 2-core runner two
    OpenMP threads wait on each other for milliseconds per call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shapes():
    spec = importlib.util.spec_from_file_location("gpu_shapes", ROOT / "benchmarks" / "gpu" / "shapes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _rows(path, **match):
    rows = json.loads(path.read_text())["rows"]
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _env_ok(row):
    assert row["device"] == "cpu" and row["dtype"] == "bfloat16"
    assert row["torch"] == torch.__version__ and row["transformers"] and row["wall_s"] >= 0


@pytest.mark.slow
def test_speed_tiny_measures_eager_and_compiled_cells_and_skips_what_does_not_fit(shapes, tmp_path, capsys):
    # 1 MiB: batch 1 at 256 tokens needs ~0.5 MiB, batch 4 ~2 MiB, so the batch-4 cells are skipped
    argv = ["speed", "--tiny", "--device", "cpu", "--output", str(tmp_path), "--runs", "1", "--contexts", "256", "--memory-limit", "1MiB"]
    assert shapes.main(argv) == 0
    out = tmp_path / "speed.json"
    result = json.loads(out.read_text())
    assert result["heads"].startswith("random") and result["weights"].startswith("random")
    assert result["provenance"]["command"].startswith("python benchmarks/gpu/shapes.py speed --tiny")
    (model,) = _rows(out, measurement="model", model="converted")
    assert model["dtypes"] == {"pretrained": ["bfloat16"], "new": ["float32"]} and model["devices"] == ["cpu"]
    assert model["operator_spec"]["class_path"].endswith("HybridOperator") and model["recipe"] == "recipes/smollm2_b05.yaml"
    for compiled in (False, True):
        (cell,) = _rows(out, measurement="speed", batch=1, compiled=compiled)
        _env_ok(cell)
        for key in ("prefill_tps_original", "prefill_tps_converted", "decode_tps_original", "decode_tps_converted"):
            assert cell[key] > 0
        assert cell["decode_ratio"] == pytest.approx(cell["decode_tps_converted"] / cell["decode_tps_original"])
        # what one step reads: the converted model keeps half the K/V (beta 0.5), so it reads less
        assert cell["bytes_per_step_original"] > cell["bytes_per_step_converted"] > 0
        assert cell["bytes_ratio"] == cell["bytes_per_step_original"] / cell["bytes_per_step_converted"]
        assert cell["method"] == "generate" and cell["beta"] == 0.5
        (skipped,) = _rows(out, measurement="speed", batch=4, compiled=compiled)
        assert skipped["skipped"].startswith("memory") and skipped["estimated_bytes"] > skipped["available_bytes"] == 2**20
    assert _rows(out, measurement="speed", compiled=True, batch=1)[0]["compiled_mixers"] == 2  # both layers converted
    text = (tmp_path / "speed.md").read_text()
    assert "| smollm2-135m | hybrid | 256 | 1 | yes |" in text and "skipped: memory" in text
    assert f"| {cell['bytes_ratio']:.2f}x |" in text and "bytes ratio" in text
    printed = capsys.readouterr().out
    assert printed.count("speed smollm2-135m hybrid") == 4


def test_table2_tiny_cache_ratio_is_below_one_and_matches_the_analytic_prediction(shapes, tmp_path):
    argv = ["table2", "--tiny", "--device", "cpu", "--output", str(tmp_path), "--runs", "1", "--shapes", "qwen2-7b", "--contexts", "256"]
    assert shapes.main(argv) == 0
    out = tmp_path / "table2.json"
    assert all("error" not in r and "skipped" not in r for r in _rows(out))
    for length in (256, 1024):
        (orig,) = _rows(out, measurement="cache", model="original", generated_tokens=length)
        assert orig["ratio"] == 1.0 and orig["cache_bytes"] == orig["cache_bytes_analytic"] > 0
        for op in ("mamba", "hybrid"):
            (conv,) = _rows(out, measurement="cache", model="converted", operator=op, generated_tokens=length)
            _env_ok(conv)
            assert conv["beta"] == 0.9 and conv["cache_tokens"] == 16 + length
            assert 0 < conv["ratio"] < 1 and conv["cache_bytes"] == pytest.approx(conv["ratio"] * orig["cache_bytes"])
            assert conv["kv_bytes"] == conv["kv_bytes_per_token_analytic"] * (16 + length)  # the kept K/V: exact
            # analytic_cache counts the Mamba conv state in the dtype it is held in (float32 beside bf16)
            assert conv["ratio"] == pytest.approx(conv["ratio_analytic"], rel=1e-9)
            assert conv["state_bytes"] == conv["state_bytes_analytic"]
    for op in ("mamba", "hybrid"):
        (model,) = _rows(out, measurement="model", model="converted", operator=op)
        assert model["dtypes"] == {"pretrained": ["bfloat16"], "new": ["float32"]} and 0 < model["replaced_heads"] < model["heads"]
        (decode,) = _rows(out, measurement="decode", operator=op, context=256)
        assert decode["decode_tps_original"] > 0 and decode["decode_tps_converted"] > 0 and decode["decode_ratio"] > 0
        (longest,) = _rows(out, measurement="max_input", model="converted", operator=op)
        assert longest["max_input"] > 0 and longest["probes"] and len(longest["probes"]) <= 4
        assert longest["ratio"] == pytest.approx(longest["max_input"] / longest["max_input_original"])
    text = (tmp_path / "table2.md").read_text()
    assert "| qwen2-7b | converted | hybrid | 1,024 |" in text
    # the hybrid recipe ranks its heads by measured loss: what that costs at this shape, one row
    (heads,) = _rows(out, measurement="heads")
    assert (heads["recipe"], heads["policy"]) == ("recipes/qwen2_7b_b09_hybrid.yaml", "StreamedLossPolicy")
    assert heads["units_total"] == 2 * 4 and heads["units_timed"] == 2 and heads["layers_timed"] == [0, 1]  # 2 layers x 4 KV groups
    assert heads["lengths"] == [64, 128] and heads["blocks"] == [2, 1]  # the recipe's block counts at the rehearsal's lengths
    assert heads["seconds_per_unit"] > 0 and heads["estimated_s"] >= heads["kept_pass_s"] + 8 * heads["seconds_per_unit"] - 0.1
    assert "| qwen2-7b | recipes/qwen2_7b_b09_hybrid.yaml | 2 x 64 + 1 x 128 | 8 | 2 |" in text


def test_budget_zero_records_every_measurement_as_skipped_without_building_a_model(shapes, tmp_path, monkeypatch):
    monkeypatch.setattr(shapes, "build_original", lambda *a, **k: pytest.fail("a model was built"))
    assert shapes.main(["table2", "--tiny", "--device", "cpu", "--output", str(tmp_path), "--budget-s", "0"]) == 0
    rows = _rows(tmp_path / "table2.json")
    # per shape: the original's model row, 2 cache lengths, l_m; per operator: model, 2 caches, 2 decodes, l_m;
    # the two beta 0.9 shapes' head measurement (their hybrid recipes rank heads by measured loss)
    assert len(rows) == 3 * (4 + 2 * 6) + 2
    assert sorted(r["shape"] for r in rows if r["measurement"] == "heads") == ["llama2-7b", "qwen2-7b"]
    assert all(r["skipped"] == "time budget" for r in rows)
    assert {r["shape"] for r in rows} == {"llama2-7b", "qwen2-7b", "qwen2-0.5b"}
    assert "skipped: time budget" in (tmp_path / "table2.md").read_text()


def test_a_run_killed_midway_leaves_valid_json_and_resume_measures_only_the_rest(shapes, tmp_path, monkeypatch):
    real = shapes.cache_numbers
    calls = []

    def killed_on_the_fourth(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 4:
            raise KeyboardInterrupt  # what a time limit's signal does: not caught as a failed measurement
        return real(*args, **kwargs)

    monkeypatch.setattr(shapes, "cache_numbers", killed_on_the_fourth)
    argv = ["table2", "--tiny", "--device", "cpu", "--output", str(tmp_path), "--runs", "1", "--shapes", "qwen2-0.5b",
            "--operators", "hybrid", "--contexts", "256"]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        shapes.main(argv)
    out = tmp_path / "table2.json"
    rows = _rows(out)  # parses: every write was a whole file
    assert [r["measurement"] for r in rows] == ["model", "cache", "cache", "max_input", "model", "cache"]
    assert not [p for p in tmp_path.iterdir() if p.name not in ("table2.json", "table2.md")]  # no temporary files left
    calls.clear()
    monkeypatch.setattr(shapes, "cache_numbers", lambda *a, **k: (calls.append(a[1]), real(*a, **k))[1])
    assert shapes.main([*argv, "--resume"]) == 0
    assert calls == [1024]  # only the converted model's second length was measured again
    rows = _rows(out)
    assert len(rows) == 4 + 5 and not [r for r in rows if "error" in r or "skipped" in r]
    (conv,) = _rows(out, measurement="cache", model="converted", generated_tokens=1024)
    assert 0 < conv["ratio"] < 1


def test_the_length_search_brackets_the_budget_counts_out_of_memory_as_too_long_and_stops_at_the_cap(shapes, monkeypatch):
    def fake_probe(peak_per_token, oom_above):
        def probe(model, length, device):
            peak = peak_per_token * length
            if peak > oom_above:
                return {"length": length, "peak_bytes": None, "oom": True, "s": 0.0}
            return {"length": length, "peak_bytes": peak, "oom": False, "s": 0.0}

        return probe

    budget = 64 * 2**30
    # a Llama-2-7B-like original: ~0.66 MB a token, the doubling probe would run out of memory
    monkeypatch.setattr(shapes, "_probe", fake_probe(660_000, 68 * 2**30))
    found = shapes.max_input_search(None, budget, None, 32768, 131072, 1024, 4)
    true = budget / 660_000
    assert found["max_input"] <= true < found["first_too_long"] and found["first_too_long"] - found["max_input"] <= true / 64 + 1024
    assert len(found["probes"]) <= 4 and not found["at_cap"]
    # the first probe out of memory: counted as too long, the search goes below it
    monkeypatch.setattr(shapes, "_probe", fake_probe(2_500_000, 68 * 2**30))
    found = shapes.max_input_search(None, budget, None, 32768, 131072, 1024, 4)
    assert found["probes"][0]["oom"] and found["max_input"] <= budget / 2_500_000 < found["first_too_long"]
    # far beyond the cap: two probes, reported as a lower bound
    monkeypatch.setattr(shapes, "_probe", fake_probe(100_000, 68 * 2**30))
    found = shapes.max_input_search(None, budget, None, 32768, 131072, 1024, 4)
    assert found["at_cap"] and found["max_input"] == 131072 and [p["length"] for p in found["probes"]] == [32768, 131072]


def test_a_prefill_out_of_memory_is_measured_again_with_a_chunked_prefill(shapes, tmp_path, monkeypatch):
    from rfkit.experiments import speed

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 60.00 GiB")

    monkeypatch.setattr(speed, "time_generate", no_memory)
    argv = ["table2", "--tiny", "--device", "cpu", "--output", str(tmp_path), "--runs", "1", "--shapes", "llama2-7b",
            "--operators", "mamba", "--contexts", "256", "--budget-s", "3600"]  # fmt: skip
    assert shapes.main(argv) == 0
    (decode,) = _rows(tmp_path / "table2.json", measurement="decode")
    assert decode["method"].startswith("chunked prefill (128 tokens") and decode["generate_error"].startswith("out of memory")
    assert decode["decode_tps_original"] > 0 and decode["decode_tps_converted"] > 0
    assert "(chunked prefill)" in (tmp_path / "table2.md").read_text()


def test_bad_flags_are_one_line_errors(shapes, tmp_path):
    with pytest.raises(shapes.ShapesError, match="unknown shapes"):
        shapes.main(["table2", "--tiny", "--output", str(tmp_path), "--shapes", "gpt2"])
    with pytest.raises(shapes.ShapesError, match="--contexts"):
        shapes.main(["speed", "--tiny", "--output", str(tmp_path), "--contexts", "0"])


@pytest.mark.slow
def test_every_true_shape_converts_with_its_recipes_on_the_meta_device(shapes):
    """The GPU run's models at their true shapes, built and converted without memory (meta tensors):
    the shapes, the recipes' operators and the sizes the GPU plan counts on."""
    from rfkit.experiments.footprint import analytic_cache

    meta = torch.device("meta")
    expected = {  # (weights GiB of the original, kept KV fraction of the converted)
        "smollm2-135m": (0.25, 0.5), "llama2-7b": (12.55, 102 / 1024), "qwen2-7b": (14.19, 11 / 112), "qwen2-0.5b": (0.92, 0.5),
    }  # fmt: skip
    for name, (gib, kept) in expected.items():
        original, info = shapes.build_original(name, False, meta, torch.bfloat16)
        assert info["param_bytes"] / 2**30 == pytest.approx(gib, abs=0.01) and info["dtypes"] == {"pretrained": ["bfloat16"]}
        per_token = analytic_cache(original)["kv_bytes_per_token"]
        for op, recipe in shapes.SHAPES[name]["recipes"].items():
            operator, beta, _ = shapes.read_recipe(recipe)
            converted, cinfo = shapes.build_converted(name, False, meta, torch.bfloat16, operator, beta)
            assert cinfo["devices"] == ["meta"] and cinfo["dtypes"] == {"pretrained": ["bfloat16"], "new": ["float32"]}
            assert not converted.rf_originals
            predicted = analytic_cache(converted)
            assert predicted["kept_kv_fraction"] == pytest.approx(kept)
            if name == "llama2-7b" and op == "mamba":  # the paper's cs_10k / cs_60k: 0.1030 / 0.1000
                for length, paper in ((10240, 0.1030), (61440, 0.1000)):
                    tokens = 64 + length
                    cs = (predicted["kv_bytes_per_token"] * tokens + predicted["state_bytes"]) / (per_token * tokens)
                    assert cs == pytest.approx(paper, abs=0.001)
                assert cinfo["new_param_bytes"] / 2**30 == pytest.approx(10.25, abs=0.01)  # float32 Mamba blocks
