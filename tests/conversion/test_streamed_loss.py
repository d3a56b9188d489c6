"""StreamedLossPolicy: the measured loss of streaming one unit equals the converted model's, and the
policy replaces the units whose streaming costs least."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import load_script, random_ids, run_cli, tiny_args, tiny_model
from rfkit.conversion.policies import PolicyError, RecencyRatioPolicy
from rfkit.conversion.streamed_loss import StreamedLossPolicy, disagreement, streamed_losses, streaming_mask
from rfkit.models.layout import AttentionLayout
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import SinkRecentOperator

SINK, RECENT = 2, 5


def test_streaming_mask_by_hand():
    m = streaming_mask(7, sink=1, recent=2).int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 0, 1, 1, 0, 0, 0],
            [1, 0, 0, 1, 1, 0, 0],
            [1, 0, 0, 0, 1, 1, 0],
            [1, 0, 0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(m, expected)


@torch.no_grad()
def _mean_loss(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].double()
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_units_loss_is_the_loss_of_the_model_with_that_unit_alone_sink_recent(family):
    """The probe (masks in one attention function, earlier layers replayed) against the real thing:
    the model converted with SinkRecentOperator on exactly that KV group, scored in float64."""
    model = tiny_model(family).double()
    ids = random_ids(batch=3, length=40)
    layout = AttentionLayout.from_config(model.config)
    units = [(layer, layout.query_heads_of(g)) for layer in range(layout.num_layers) for g in range(layout.num_kv_heads)]
    batches = [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]
    base, losses, tokens = streamed_losses(model, batches, units, SINK, RECENT, progress=False)
    assert tokens == 3 * 39
    assert base == pytest.approx(_mean_loss(model, ids), abs=1e-10)
    for (layer, heads), loss in zip(units, losses):
        selected = [heads if i == layer else [] for i in range(layout.num_layers)]
        converted = to_recurformer(copy.deepcopy(model), selected, SinkRecentOperator(sink=SINK, window=RECENT)).eval()
        assert loss == pytest.approx(_mean_loss(converted, ids), abs=1e-9), (layer, heads)
        assert loss != pytest.approx(base, abs=1e-6)  # streaming a unit changes the loss on 40 tokens
    # the model came back whole: its layers, attention and outputs are as before
    assert base == pytest.approx(_mean_loss(model, ids), abs=1e-10)


def _batches(n=2, length=48):
    ids = random_ids(batch=n, length=length, seed=3)
    return [{"input_ids": ids[i : i + 1]} for i in range(n)]


def test_the_policy_replaces_the_units_whose_streaming_costs_least_and_records_what_it_measured():
    model = tiny_model()
    layout = AttentionLayout.from_config(model.config)
    policy = StreamedLossPolicy(sink=SINK, recent=RECENT, blocks=1, window=4, beta=0.5)
    profile = policy.make_profile(model, _batches(), progress=False)
    measured = profile.meta["measured"]
    assert measured["blocks"] == 1 and measured["tokens"] == 47  # only the first block is measured
    delta = measured["delta"]
    assert len(delta) == layout.num_layers and all(len(row) == layout.num_kv_heads for row in delta)
    assert profile.rr_mean and profile.samples == 2  # the recency profile rides along (all blocks)
    selected = policy.select(layout, profile)
    ranked = sorted((delta[layer][g], (layer, g)) for layer in range(layout.num_layers) for g in range(layout.num_kv_heads))
    cheapest = {unit for _d, unit in ranked[:2]}
    chosen = {(layer, g) for layer, heads in enumerate(selected) for g in range(2) if layout.query_heads_of(g)[0] in heads}
    assert chosen == cheapest
    # measured with the first block only: the same deltas as streamed_losses on it
    units = [(layer, layout.query_heads_of(g)) for layer in range(layout.num_layers) for g in range(layout.num_kv_heads)]
    base, losses, _ = streamed_losses(model, _batches()[:1], units, SINK, RECENT, progress=False)
    assert [round(x - base, 7) for x in losses] == [d for row in delta for d in row]
    # the comparison with the recency ranking names the groups each one alone replaces
    diff = disagreement(layout, profile, 0.5)
    assert diff["replaced"] == 2 and diff["agree"] + len(diff["only_streamed_loss"]) == 2
    assert len(diff["only_streamed_loss"]) == len(diff["only_recency"])
    rr_chosen = RecencyRatioPolicy(window=4, beta=0.5).select(layout, profile)
    assert (diff["agree"] == 2) == (rr_chosen == selected)


def test_a_profile_without_measured_losses_is_refused_in_one_line():
    model = tiny_model()
    profile = RecencyRatioPolicy(window=4).make_profile(model, _batches(), progress=False)
    with pytest.raises(PolicyError, match="StreamedLossPolicy needs a profile with its measured losses"):
        StreamedLossPolicy(window=4).select(AttentionLayout.from_config(model.config), profile)


def test_long_blocks_need_the_recipes_data_section():
    with pytest.raises(PolicyError, match="model.policy.long_source: reading long blocks needs the recipe's data section"):
        StreamedLossPolicy(window=4, long_source="embedded:shakespeare").make_profile(tiny_model(), _batches(), progress=False)


@pytest.mark.parametrize("field,value", [("sink", -1), ("recent", 0), ("blocks", 0), ("long_seq_len", 1)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(PolicyError, match=f"model.policy.{field}: {value}"):
        StreamedLossPolicy(**{field: value})


@pytest.mark.slow
def test_convert_with_the_policy_writes_its_measurements_into_the_head_map(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "converted"
    args = [
        "convert", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path),
        "--model.policy", "rfkit.policies.StreamedLossPolicy",
        "--model.policy.init_args.sink", "2",
        "--model.policy.init_args.recent", "8",
        "--model.policy.init_args.blocks", "2",
        # measured on long blocks of another source's train split (here the tiny corpus, 64 tokens)
        "--model.policy.init_args.long_source", str(tiny_corpus),
        "--model.policy.init_args.long_seq_len", "64",
        "--output", str(out),
    ]  # fmt: skip
    code, _out, err = run_cli(args, capsys)
    assert code == 0, err
    head_map = json.loads((out / "head_map.json").read_text())
    assert head_map["policy"]["class_path"] == "rfkit.policies.StreamedLossPolicy"
    measured = head_map["measured"]
    assert measured["name"] == "streamed_loss" and measured["blocks"] == 2 and measured["recent"] == 8
    assert measured["source"] == str(tiny_corpus) and measured["seq_len"] == 64 and measured["tokens"] == 2 * 63
    assert len(measured["delta"]) == 2 and sum(len(s) for s in head_map["selected"]) == 4


def test_the_disagreement_report_reads_a_head_map_the_policy_made(tmp_path):
    from rfkit.conversion.headmap import HeadMap

    model = tiny_model()
    layout = AttentionLayout.from_config(model.config)
    policy = StreamedLossPolicy(sink=SINK, recent=RECENT, blocks=2, window=4, beta=0.5)
    profile = policy.make_profile(model, _batches(), progress=False)
    path = tmp_path / "head_map.json"
    HeadMap.build("tiny", layout, profile, policy.select(layout, profile), policy, {}).save(path)
    script = load_script("benchmarks/policy_disagreement.py")
    assert script.main([str(path), "--betas", "0.25,0.5"]) == 0
    result = json.loads((tmp_path / "disagreement.json").read_text())
    assert [r["beta"] for r in result["betas"]] == [0.25, 0.5] and "provenance" in result
    by_hand = disagreement(layout, profile, 0.5)  # from the profile: the same as from the saved map
    assert result["betas"][1]["only_recency"] == by_hand["only_recency"]
    # the recency choice never costs less than the measured one, to first order
    assert all(r["extra_loss_of_recency_choice"] >= 0 for r in result["betas"])
    text = (tmp_path / "disagreement.md").read_text()
    assert "| 0.5 | 2 |" in text and "sink 2 + recent 5" in text
