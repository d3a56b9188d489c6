"""rfkit.training.state_audit: calibration prompts from the train split, the margins, and the
greedy closing of the states that lower them, on the tiny converted model."""

from __future__ import annotations

import pytest
import torch

from helpers import floor_the_state_turns_away, one_state_open
from rfkit.errors import RFKitError


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _settings(**kw):
    from rfkit.training.state_audit import StateAuditConfig

    return StateAuditConfig(**{"lengths": [192], "trials": 2, "max_layers": 2, "guards": [], **kw})


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
        ("guards", ["passkey"], "state_audit.guards: a list of: prose, plays, long"),
        ("guards", "long", "state_audit.guards"),
        ("guard_depths", [-0.1], "state_audit.guard_depths"),
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
    measured = audit(model, tok, _settings(lengths=[160], depths=[0.0, 0.5, 1.0], trials=3, min_margin=-1e6), close=False, progress=False)
    assert all(torch.equal(before[n], p) for n, p in _gates(model).items())  # close=False leaves every gate
    on, off = measured["every_state_on"], measured["every_state_off"]
    assert len(measured["prompts"]) == 9 and measured["targets"] == list(range(9)) and measured["guards"] == []
    assert measured["closed"] == [] and measured["all_targets_quoted"]  # every margin is above the floor
    changes = {int(k): v for k, v in measured["layer_changes"].items()}
    assert changes[opened] == [round(b - a, 4) for a, b in zip(on, off)] and any(c != 0 for c in changes[opened])
    assert all(c == 0 for layer, change in changes.items() if layer != opened for c in change)  # closed gates

    # a floor the open state keeps some quotes below: the audit must close it
    floor = floor_the_state_turns_away(on, off)
    done = audit(model, tok, _settings(lengths=[160], depths=[0.0, 0.5, 1.0], trials=3, min_margin=floor), progress=False)
    assert done["targets"] == [i for i, m in enumerate(off) if m > floor]
    assert done["closed"] == [opened] and done["all_targets_quoted"]
    # every forward whole instead of replaying the layers before a change: the same report, bit for bit
    unreplayed, _ = _load(tmp_path / "model")
    assert audit(unreplayed, tok, _settings(lengths=[160], depths=[0.0, 0.5, 1.0], trials=3, min_margin=floor), progress=False, replay=False) == done
    for name, gate in _gates(model).items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        assert torch.equal(gate, torch.zeros_like(gate) if layer == opened else before[name])
    # the targets' margins after the closing are the closed model's: the window's alone
    records = needles.prompts(tok, [needles.SHAPES["plays"]], [160], [0.0, 0.5, 1.0], 3, 0, split="train")
    now = [m["margin"] for m in margins(model, [prompt_pairs(tok, records)[i] for i in done["targets"]])]
    assert now == done["steps"][-1]["target_margins"] == [off[i] for i in done["targets"]]


def test_the_greedy_closing_takes_the_strongest_state_first_and_stops_when_every_key_is_quoted():
    from rfkit.training.state_audit import choose

    effect = {3: 0.2, 5: 0.7, 9: -0.4, 12: 0.5}
    after = {5: [0.1, -0.2], 12: [0.3, 0.1], 3: [0.4, 0.2]}  # the targets' margins once that layer is closed too
    asked = []

    def try_close(layer):
        asked.append(layer)
        return {"kept": True, "target_margins": after[layer]}

    steps, now = choose(effect, [-0.5, -0.6], 3, try_close)
    assert asked == [5, 12] and now == [0.3, 0.1]  # 5, then 12: both keys quoted, so 3 stays open
    assert [s["layer"] for s in steps] == [5, 12] and steps[0] == {"layer": 5, "effect": 0.7, "kept": True, "target_margins": [0.1, -0.2]}
    asked.clear()
    steps, now = choose(effect, [-0.5, -0.6], 1, try_close)  # max_layers
    assert asked == [5] and now == [0.1, -0.2]
    asked.clear()
    assert choose(effect, [0.2, 0.1], 3, try_close) == ([], [0.2, 0.1]) and not asked  # already quoted
    # a layer whose state helps the quotes (negative effect) is never closed
    steps, _ = choose({9: -0.4, 1: 0.0}, [-0.5], 3, try_close)
    assert steps == [] and not asked


def test_a_closing_a_guard_refuses_does_not_count_and_the_next_layer_is_tried():
    from rfkit.training.state_audit import choose, guard_floor

    effect = {5: 0.7, 12: 0.5, 3: 0.2, 7: 0.1}
    refuse = {5}  # closing 5 costs a guard its key: undone, margins unchanged

    def try_close(layer):
        if layer in refuse:
            return {"kept": False, "target_margins": [0.9, 0.9], "guards_lost": [4]}
        return {"kept": True, "target_margins": {12: [0.1, -0.1], 3: [0.6, 0.7], 7: [0.8, 0.8]}[layer], "guards_lost": []}

    steps, now = choose(effect, [-0.5, -0.6], 2, try_close, min_margin=0.5)
    assert [(s["layer"], s["kept"]) for s in steps] == [(5, False), (12, True), (3, True)] and now == [0.6, 0.7]
    # at most 2 * max_layers tries, refused or not
    refuse.update({12, 3, 7})
    steps, now = choose(effect, [-0.5, -0.6], 1, try_close, min_margin=0.5)
    assert [s["layer"] for s in steps] == [5, 12] and now == [-0.5, -0.6]
    # what a guard must keep: never more than the floor, half its margin when it had less
    assert guard_floor(3.0, 0.5) == 0.5 and guard_floor(0.4, 0.5) == 0.2


@pytest.mark.slow
def test_a_closing_that_costs_a_guard_its_key_gives_the_gates_back(converted_dir, tmp_path):
    from rfkit.evals import needles
    from rfkit.training.state_audit import Measure, margins, prompt_pairs, stateful_layers, try_closing

    one_state_open(converted_dir, tmp_path / "model")
    model, tok = _load(tmp_path / "model")
    before = _gates(model)
    records = needles.prompts(tok, [needles.SHAPES["plays"], needles.SHAPES["long"]], [192], [0.0], 1, 0, split="train")
    prompts = prompt_pairs(tok, records)
    assert len(prompts[1][1]) > 10  # the long key: every one of its tokens is asked
    layer, mixers = next(iter(stateful_layers(model).items()))
    measure = Measure(model, prompts)
    # a guard that had a margin of 1e9 must keep more than the floor (1e9 here): it cannot, so undone
    got = try_closing(measure, layer, mixers, [0], [1], [0.0, 1e9], 1e9)
    assert got["kept"] is False and got["guards_lost"] == [1] and got["target_margins"] is None
    assert all(torch.equal(before[n], p) for n, p in _gates(model).items())
    # the guard with the smaller margin before is asked first; once it falls the others are not asked
    got = try_closing(measure, layer, mixers, [], [0, 1], [1e9, 1e8], 1e9)
    assert got["guards_lost"] == [1] and got["guard_margins"][0] is None and got["guard_margins"][1] is not None
    # a floor every margin clears: kept, the layer's gates at 0, margins those of the closed model
    got = try_closing(measure, layer, mixers, [0], [1], [0.0, 1e9], -1e9)
    assert got["kept"] is True and got["guards_lost"] == []
    for name, gate in _gates(model).items():
        closed = f".layers.{layer}." in name
        assert torch.equal(gate, torch.zeros_like(gate) if closed else before[name])
    assert [got["target_margins"][0], got["guard_margins"][0]] == [m["margin"] for m in margins(model, prompts)]


def test_a_forward_replays_the_layers_before_the_change_and_gets_the_same_margins(converted_dir):
    from rfkit.config.loading import load_model
    from rfkit.evals import needles
    from rfkit.models.modeling import decoder_layers
    from rfkit.training.state_audit import Measure, margins, prompt_pairs, stateful_layers, states_off

    loaded = load_model(str(converted_dir))
    model, tok = loaded.model.eval(), loaded.tokenizer
    records = needles.prompts(tok, [needles.SHAPES["plays"]], [160], [0.0, 1.0], 1, 0, split="train")
    prompts = prompt_pairs(tok, records)
    layers = stateful_layers(model)
    last = max(layers)
    assert last > 0  # a layer before it to replay
    runs = {j: 0 for j in range(len(decoder_layers(model)))}
    for j, layer in enumerate(decoder_layers(model)):
        layer.self_attn.register_forward_hook(lambda module, inputs, output, j=j: runs.__setitem__(j, runs[j] + 1))
    measure = Measure(model, prompts)
    on = measure([0, 1], record=True)
    measure.commit()
    assert on == [m["margin"] for m in margins(model, prompts)]
    for layer, mixers in layers.items():
        runs.update({j: 0 for j in runs})
        with states_off(mixers):
            replayed = measure([0, 1], start=layer)
            whole = [m["margin"] for m in margins(model, prompts)]
        assert replayed == whole  # bit for bit: the layers before did not change
        assert runs == {j: (2 if j < layer else 4) for j in runs}  # the replayed layers ran only in the whole forwards
    # with nothing kept (a prompt never recorded, or replay off) every layer runs
    runs.update({j: 0 for j in runs})
    assert Measure(model, prompts, replay=False)([0], start=last) == on[:1] and all(n == 1 for n in runs.values())
    # a change undone: discard keeps the outputs as they were; commit keeps only the prompts measured
    measure([0], start=last, record=True)
    measure.discard()
    assert sorted(measure.kept) == [0, 1] and not measure.pending
    measure([1], start=last, record=True)
    measure.commit()
    assert sorted(measure.kept) == [1]
    assert all(not (hasattr(layer, "forward") and "forward" in layer.__dict__) for layer in decoder_layers(model))  # nothing left patched


def test_the_margin_is_the_weakest_token_of_the_whole_key(converted_dir):
    from rfkit.config.loading import load_model
    from rfkit.evals import needles
    from rfkit.training.state_audit import margins, prompt_pairs

    loaded = load_model(str(converted_dir))
    model, tok = loaded.model.eval(), loaded.tokenizer
    record = needles.prompts(tok, [needles.SHAPES["long"]], [192], [0.5], 1, 0, split="train")[0]
    [(ids, answer)] = prompt_pairs(tok, [record])
    assert tok.decode(answer).strip() == str(record["key"])
    [got] = margins(model, [(ids, answer)])
    # by hand: one forward per answer token, the prompt and the key's tokens before it
    each = []
    with torch.no_grad():
        for j, token in enumerate(answer):
            given = torch.cat([ids, torch.tensor([answer[:j]], dtype=ids.dtype)], dim=1)
            logp = model(input_ids=given).logits[0, -1].float().log_softmax(-1)
            other = logp.clone()
            other[token] = float("-inf")
            each.append(float(logp[token] - other.max()))
    assert got["margin"] == pytest.approx(min(each), abs=1e-3) and got["first"] == pytest.approx(each[0], abs=1e-3)
    assert got["weakest"] == min(range(len(each)), key=each.__getitem__)
    assert got["top"] == int(model(input_ids=ids).logits[0, -1].argmax())


def test_a_model_without_a_state_is_refused(converted_dir):
    from rfkit.training.state_audit import audit
    from rfkit.config.loading import load_model

    original = load_model(str(converted_dir), original=True)
    with pytest.raises(RFKitError, match="no mixer with a state"):
        audit(original.model, original.tokenizer, _settings(), progress=False)


@pytest.mark.slow
def test_a_refused_layer_is_tried_head_by_head(converted_dir, tmp_path):
    from rfkit.evals import needles
    from rfkit.training.state_audit import Measure, close_states, gate_slots, margins, prompt_pairs, stateful_layers, try_heads

    one_state_open(converted_dir, tmp_path / "model")
    model, tok = _load(tmp_path / "model")
    before = _gates(model)
    records = needles.prompts(tok, [needles.SHAPES["plays"], needles.SHAPES["long"]], [160], [0.0, 0.5, 1.0], 1, 0, split="train")
    prompts = prompt_pairs(tok, records)
    layer, mixers = next(iter(stateful_layers(model).items()))  # the open one
    slots = gate_slots(mixers)
    assert len(slots) > 1
    targets, guards = [0, 1, 2], [3]
    now = [m["margin"] for m in margins(model, [prompts[i] for i in targets])]
    # no guard can fall (floor far below): every head with a positive effect is closed, the rest stay
    got = try_heads(Measure(model, prompts), layer, mixers, targets, guards, [0.0] * 6, -1e9)
    effects = {int(h): e for h, e in got["head_effects"].items()}
    assert sorted(effects) == list(range(len(slots)))  # every head open at the start was measured
    model_again, _ = _load(tmp_path / "model")  # head 0's effect: its gate alone at 0, the targets' mean change
    m0, a0 = gate_slots(next(iter(stateful_layers(model_again).values())))[0]
    with torch.no_grad():
        m0.gate[a0] = 0.0
    alone = [m["margin"] for m in margins(model_again, [prompts[i] for i in targets])]
    assert effects[0] == pytest.approx(sum(a - n for a, n in zip(alone, now)) / len(now), abs=1e-3)
    helped = sorted(h for h, e in effects.items() if e > 0)
    assert sorted(got["heads"]) == helped and got["kept"] == bool(helped), (effects, now)
    for h, (mixer, at) in enumerate(slots):
        assert (float(mixer.gate.detach()[at]) == 0.0) == (h in helped)
    # a guard that must keep 1e9: no head is kept, every gate as it was
    model, tok = _load(tmp_path / "model")
    layer, mixers = next(iter(stateful_layers(model).items()))
    got = try_heads(Measure(model, prompts), layer, mixers, targets, guards, [0.0, 0.0, 0.0, 1e9], 1e9, now)
    assert got["kept"] is False and got["heads"] == [] and got["guards_lost"] == [3] and got["target_margins"] is None
    assert all(torch.equal(before[n], p) for n, p in _gates(model).items())
    # close_states closes only the heads named
    close_states(model, [layer], {layer: [1]})
    assert [float(m.gate.detach()[at]) == 0.0 for m, at in gate_slots(mixers)] == [h == 1 for h in range(len(slots))]
    with pytest.raises(RFKitError, match=f"layer {layer} has {len(slots)} heads"):
        close_states(model, [layer], {layer: [len(slots)]})


def test_margins_read_float32_logits_from_a_bf16_model(converted_dir):
    from rfkit.config.loading import load_model
    from rfkit.training.state_audit import float32_logits

    model = load_model(str(converted_dir)).model.eval().to(torch.bfloat16)
    ids = torch.arange(5, 40).view(1, -1)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with float32_logits(model):
            exact = model(input_ids=ids, output_hidden_states=True)
    assert plain.dtype == torch.bfloat16 and exact.logits.dtype == torch.float32
    hidden = exact.hidden_states[-1].float()
    want = hidden @ model.get_output_embeddings().weight.float().T
    torch.testing.assert_close(exact.logits, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the hook is gone after the block
        assert model(input_ids=ids).logits.dtype == torch.bfloat16


def test_closings_in_words():
    from rfkit.conversion.model_card import describe_closed

    assert describe_closed({"closed": [21, 5, 20], "closed_heads": {"5": [0, 3]}}) == "21, 5 (heads 0, 3), 20"
    assert describe_closed({"closed": []}) == "none"


def test_read_sharper_sets_every_hybrid_block_and_the_record_and_refuses_other_operators():
    import copy

    from helpers import tiny_model
    from rfkit.models.hybrid import HybridWindowAttention
    from rfkit.models.modeling import to_recurformer
    from rfkit.models.operators import HybridOperator, SinkRecentOperator
    from rfkit.training.state_audit import read_sharper

    original = tiny_model("llama").eval()
    selected = [[0, 1], [2, 3]]
    model = to_recurformer(copy.deepcopy(original), selected, HybridOperator(sink=2, window=4, feature_dim=4, decay_horizon=64.0))
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        assert read_sharper(model, 1.5) == 2  # one block per converted layer
        after = model(ids).logits
    assert [m.sharpness for m in model.modules() if isinstance(m, HybridWindowAttention)] == [1.5, 1.5]
    assert model.config.rf_operator["init_args"] == {**HybridOperator(sink=2, window=4, feature_dim=4, decay_horizon=64.0).init_args(), "sharpness": 1.5}
    assert not torch.allclose(before, after)  # 24 tokens past a 2 + 4 window: the state counts
    with pytest.raises(RFKitError, match="model.operator.sharpness"):
        read_sharper(model, 0.5)
    plain = to_recurformer(copy.deepcopy(original), selected, SinkRecentOperator(sink=2, window=4))
    with pytest.raises(RFKitError, match=r"read sharpness: only rfkit.operators.HybridOperator .* model.operator is rfkit.operators.SinkRecentOperator"):
        read_sharper(plain, 1.5)
