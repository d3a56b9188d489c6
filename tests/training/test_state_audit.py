"""rfkit.training.state_audit: calibration prompts from the train split, the margins, and the
greedy closing of the states that lower them, on the tiny converted model."""

from __future__ import annotations

import pytest
import torch

from helpers import one_state_open
from rfkit.errors import RFKitError


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _settings(**kw):
    from rfkit.training.state_audit import StateAuditConfig

    return StateAuditConfig(**{"lengths": [192], "trials": 2, "max_layers": 2, **kw})


def test_calibration_prompts_read_the_train_split_and_other_keys(tokenizer):
    from rfkit.evals import needles

    shape = needles.SHAPES["plays"]
    from rfkit.evals import passkey

    train = needles.filler_sentences(shape.filler, "train")
    held_out = needles.held_out_sentences(shape.filler)
    held_only = set(held_out) - set(train)  # short lines ("Farewell, my lord.") recur across plays
    assert len(held_only) > len(held_out) // 2
    for index in range(3):
        asked = needles.trial(shape, tokenizer, 400, 1.0, 0, index)  # what rfkit eval needles asks
        calib = needles.trial(shape, tokenizer, 400, 1.0, 0, index, split="train")
        assert calib["key"] != asked["key"]
        body = calib["text"][len(passkey.INSTRUCTION) + 1 :]  # the filler starts at a drawn sentence of the split
        assert any(body.startswith(s) for s in train) and not any(body.startswith(s) for s in held_only)
    # the evaluation's own prompts are what they were before the split argument
    assert needles.trial(shape, tokenizer, 400, 1.0, 0, 0) == needles.trial(shape, tokenizer, 400, 1.0, 0, 0, "validation")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("shape", "passkey", "state_audit.shape: allowed: prose, plays"),
        ("split", "validation", "state_audit.split: allowed: train, calibration"),
        ("lengths", [16], "state_audit.lengths"),
        ("depths", [1.5], "state_audit.depths"),
        ("trials", 0, "state_audit.trials"),
        ("max_layers", 0, "state_audit.max_layers"),
        ("min_margin", float("nan"), "state_audit.min_margin"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    with pytest.raises(RFKitError, match=message):
        _settings(**{field: value})


def _load(path):
    from rfkit.config.loading import load_model

    loaded = load_model(str(path))
    return loaded.model.eval(), loaded.tokenizer


def _gates(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mixer.gate")}


@pytest.mark.slow
def test_audit_measures_each_state_and_closes_the_one_that_lowers_a_quote(converted_dir, tmp_path):
    from rfkit.training.state_audit import audit, margins, prompt_pairs
    from rfkit.evals import needles

    first, _ = one_state_open(converted_dir, tmp_path / "model")  # only the first converted layer's state counts
    opened = int(first.split(".layers.")[1].split(".")[0])
    model, tok = _load(tmp_path / "model")
    before = _gates(model)
    # every prompt a target (a floor below every margin): each layer's change on each prompt
    measured = audit(model, tok, _settings(depths=[0.5], trials=3, min_margin=-1e6), close=False, progress=False)
    assert all(torch.equal(before[n], p) for n, p in _gates(model).items())  # close=False leaves every gate
    on, off = measured["every_state_on"], measured["every_state_off"]
    assert len(measured["prompts"]) == 3 and measured["targets"] == [0, 1, 2]
    assert measured["closed"] == [] and measured["all_targets_quoted"]  # every margin is above the floor
    changes = {int(k): v for k, v in measured["layer_changes"].items()}
    assert changes[opened] == [round(b - a, 4) for a, b in zip(on, off)] and any(c != 0 for c in changes[opened])
    assert all(c == 0 for layer, change in changes.items() if layer != opened for c in change)  # closed gates

    # a floor between one prompt's margins with and without the state: a quote the state turns away
    worst = max(range(3), key=lambda i: off[i] - on[i])
    assert off[worst] > on[worst], f"the opened state lowers no margin here: {on} vs {off}"
    floor = (on[worst] + off[worst]) / 2
    done = audit(model, tok, _settings(depths=[0.5], trials=3, min_margin=floor), progress=False)
    assert done["targets"] == [i for i, m in enumerate(off) if m > floor] and worst in done["targets"]
    assert done["closed"] == [opened] and done["all_targets_quoted"]
    for name, gate in _gates(model).items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        assert torch.equal(gate, torch.zeros_like(gate) if layer == opened else before[name])
    # the targets' margins after the closing are the closed model's: the window's alone
    records = needles.prompts(tok, [needles.SHAPES["plays"]], [192], [0.5], 3, 0, split="train")
    now = [m["margin"] for m in margins(model, [prompt_pairs(tok, records)[i] for i in done["targets"]])]
    assert now == done["steps"][-1]["target_margins"] == [off[i] for i in done["targets"]]


def test_the_greedy_closing_takes_the_strongest_state_first_and_stops_when_every_key_is_quoted():
    from rfkit.training.state_audit import choose

    effect = {3: 0.2, 5: 0.7, 9: -0.4, 12: 0.5}
    after = {5: [0.1, -0.2], 12: [0.3, 0.1], 3: [0.4, 0.2]}  # the targets' margins once that layer is closed too
    asked = []

    def close_and_measure(layer):
        asked.append(layer)
        return after[layer]

    steps, now = choose(effect, [-0.5, -0.6], 3, close_and_measure)
    assert asked == [5, 12] and now == [0.3, 0.1]  # 5, then 12: both keys quoted, so 3 stays open
    assert [s["layer"] for s in steps] == [5, 12] and steps[0] == {"layer": 5, "effect": 0.7, "target_margins": [0.1, -0.2]}
    asked.clear()
    steps, now = choose(effect, [-0.5, -0.6], 1, close_and_measure)  # max_layers
    assert asked == [5] and now == [0.1, -0.2]
    asked.clear()
    assert choose(effect, [0.2, 0.1], 3, close_and_measure) == ([], [0.2, 0.1]) and not asked  # already quoted
    # a layer whose state helps the quotes (negative effect) is never closed
    steps, _ = choose({9: -0.4, 1: 0.0}, [-0.5], 3, close_and_measure)
    assert steps == [] and not asked


def test_a_model_without_a_state_is_refused(converted_dir):
    from rfkit.training.state_audit import audit
    from rfkit.config.loading import load_model

    original = load_model(str(converted_dir), original=True)
    with pytest.raises(RFKitError, match="no mixer with a state"):
        audit(original.model, original.tokenizer, _settings(), progress=False)
