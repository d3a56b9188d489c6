"""``model.operator.init_args.stateless_layers`` through the CLI: the default recipe's code paths
(transfer with long blocks) at beta 0.75 convert the tiny model with one layer left without a
state, and the saved folder keeps that; a layer that replaces no head is one line, exit 2, and
nothing written."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli, tiny_args

BETA = ["--model.policy.init_args.beta", "0.75"]  # three of the four KV groups: both layers replace heads


@pytest.mark.slow
def test_a_stateless_layer_converts_and_is_saved(tiny_model_dir, tiny_corpus, tmp_path, capsys, data_cache):
    out = tmp_path / "out"
    args = ["convert", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs"), "--output", str(out), *BETA]
    code, _, err = run_cli([*args, "--model.operator.init_args.stateless_layers", "[1]"], capsys)
    assert code == 0, err[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["rf_operator"]["init_args"]["stateless_layers"] == [1]

    from rfkit.config.loading import load_model
    from rfkit.models.hybrid import HybridWindowAttention
    from rfkit.models.window import WindowAttention

    mixers = [layer.self_attn.mixer for layer in load_model(str(out)).model.model.layers]
    assert isinstance(mixers[0], HybridWindowAttention) and type(mixers[1]) is WindowAttention

    bad = tmp_path / "bad"
    args = ["convert", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path / "runs2"), "--output", str(bad), *BETA]
    code, _, err = run_cli([*args, "--model.operator.init_args.stateless_layers", "[5]"], capsys)
    lines = [line for line in err.splitlines() if line.startswith("rfkit: error:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert "model.operator.stateless_layers: layer 5 replaces no head" in lines[0] and not bad.exists()
