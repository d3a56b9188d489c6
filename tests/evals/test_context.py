"""``rfkit eval context`` on the tiny converted hybrid: every model on the same blocks and prompts."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_cli

from rfkit.config.loading import dir_dtype
from rfkit.conversion import evaluations
from rfkit.conversion.headmap import HeadMap


@pytest.mark.slow
def test_context_measures_original_converted_state_off_and_the_baseline(converted_dir, tiny_corpus, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(converted_dir, model)
    out = tmp_path / "ctx"
    code, stdout, err = run_cli(
        ["eval", "context", "--model", str(model), "--source", str(tiny_corpus), "--lengths", "128,192",
         "--tokens", "384", "--depths", "0,1", "--output", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads((out / "context.json").read_text())
    rows = result["rows"]
    # the matched baseline, by hand: per replaced KV head (head_dim 16) the hybrid holds K and V of
    # 4 + 56 tokens at e bytes (the weights' dtype) and a float32 16 x (16 + 1) state, which is
    # (1920 e + 1088) / (32 e) tokens of K/V: 68 in float32 (4 + 64), 77 in bf16 (4 + 73)
    e = dir_dtype(model).itemsize
    window = (1920 * e + 1088) // (32 * e) - 4
    assert window == {4: 64, 2: 73}[e]
    name = f"sink_recent(sink=4,window={window}), training-free"
    assert list(rows) == ["original", "converted", "converted, state off", name]
    assert result["blocks"] == {"128": 3, "192": 2}  # tokens // length blocks per length
    original = rows["original"]
    assert all(v == 1.0 for v in original["ppl_ratio"].values())
    # the baseline spends the hybrid's bytes: 4 + 64 tokens against 4 + 56 tokens plus the state (float32)
    head_map = HeadMap.load(model / "head_map.json")
    assert head_map.replaced_heads > 0
    for n in ("128", "192"):
        hybrid, baseline = rows["converted"]["cache_bytes"][n], rows[name]["cache_bytes"][n]
        assert hybrid < original["cache_bytes"][n]
        assert abs(hybrid - baseline) / baseline < 0.01
        assert rows["converted, state off"]["cache_bytes"][n] == hybrid
        assert set(rows["converted"]["passkey"]) == {"128", "192"}
    # closing the gates changes the model's output (the state is live) and is undone afterwards
    assert rows["converted, state off"]["ppl"] != rows["converted"]["ppl"]
    assert (out / "context.png").stat().st_size > 0
    assert "| original |" in stdout and "PPL ratio 192" in stdout
    (entry,) = evaluations.load(model).values()
    assert entry["rows"]["perplexity, 192 tokens"]["converted"] == pytest.approx(rows["converted"]["ppl"]["192"])
    assert "Quality against context length" in (model / "README.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--baseline", "nope"], "--baseline: unknown name 'nope'"),
        (["--baseline", "mamba"], "--baseline: 'mamba' has weights to train"),
        (["--lengths", "300"], "--lengths: 300 tokens is beyond what the model can take"),
        (["--lengths", "40"], "--lengths: 40 tokens cannot hold the passkey template"),
        (["--tokens", "0"], "--tokens: must be an integer >= 1"),
        (["--source", "embedded:nothing"], "--source:"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(converted_dir, args, message, capsys):
    code, _, err = run_cli(["eval", "context", "--model", str(converted_dir), "--lengths", "128", *args], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_model_that_is_not_converted_is_refused(tiny_model_dir, capsys):
    code, _, err = run_cli(["eval", "context", "--model", str(tiny_model_dir)], capsys)
    assert code == 2 and "not an rfkit-converted one" in err
