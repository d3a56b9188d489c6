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
from rfkit.conversion.streamed_loss import (
    StreamedLossPolicy,
    combine_lengths,
    disagreement,
    measured_cost,
    measured_delta,
    streamed_losses,
    streaming_mask,
)
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
    base, losses, tokens, *_ = streamed_losses(model, batches, units, SINK, RECENT, progress=False)
    assert tokens == 3 * 39
    assert base == pytest.approx(_mean_loss(model, ids), abs=1e-10)
    for (layer, heads), loss in zip(units, losses):
        selected = [heads if i == layer else [] for i in range(layout.num_layers)]
        converted = to_recurformer(copy.deepcopy(model), selected, SinkRecentOperator(sink=SINK, window=RECENT)).eval()
        assert loss == pytest.approx(_mean_loss(converted, ids), abs=1e-9), (layer, heads)
        assert loss != pytest.approx(base, abs=1e-6)  # streaming a unit changes the loss on 40 tokens
    # the model came back whole: its layers, attention and outputs are as before
    assert base == pytest.approx(_mean_loss(model, ids), abs=1e-10)


def _answer_mean(model, ids, answers):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].double()
    each = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return float(each[answers[:, 1:].reshape(-1)].mean())


@torch.no_grad()
def test_answer_losses_are_the_marked_tokens_loss_with_that_unit_streamed():
    """Where a batch marks answer tokens, each unit's loss on them alone is measured too: the
    same number as the converted model's mean cross-entropy on those positions."""
    model = tiny_model().double()
    ids = random_ids(batch=2, length=40)
    answers = torch.zeros(ids.shape, dtype=torch.bool)
    answers[0, 30:33], answers[1, 20], answers[1, 0] = True, True, True  # token 0 is never predicted
    layout = AttentionLayout.from_config(model.config)
    units = [(layer, layout.query_heads_of(g)) for layer in range(layout.num_layers) for g in range(layout.num_kv_heads)]
    got = streamed_losses(model, [{"input_ids": ids, "answer_mask": answers}], units, SINK, RECENT, progress=False)
    assert got.answers == 4 and got.tokens == 2 * 39
    assert got.answer_base == pytest.approx(_answer_mean(model, ids, answers), abs=1e-10)
    for (layer, heads), answer in zip(units, got.answer_losses):
        selected = [heads if i == layer else [] for i in range(layout.num_layers)]
        converted = to_recurformer(copy.deepcopy(model), selected, SinkRecentOperator(sink=SINK, window=RECENT)).eval()
        assert answer == pytest.approx(_answer_mean(converted, ids, answers), abs=1e-9), (layer, heads)
    plain = streamed_losses(model, [{"input_ids": ids}], units, SINK, RECENT, progress=False)
    assert plain.answers == 0 and plain.answer_losses == [0.0] * len(units) and plain.losses == got.losses


def test_the_recall_weight_decides_between_text_and_answer_costs():
    """Ranking reads text increase + recall_weight x answer increase: weight 0 ranks by the text,
    a large weight by the answers; the measurement itself is the same (read at selection time)."""
    model = tiny_model()
    layout = AttentionLayout.from_config(model.config)
    profile = StreamedLossPolicy(sink=SINK, recent=RECENT, blocks=1, window=4).make_profile(model, _batches(), progress=False)
    text = profile.meta["measured"]["delta"]
    # answers cost the opposite order of the text: the unit cheapest on text is the dearest on answers
    order = sorted((text[layer][g], layer, g) for layer in range(layout.num_layers) for g in range(layout.num_kv_heads))
    recall = [[0.0] * layout.num_kv_heads for _ in range(layout.num_layers)]
    for rank, (_d, layer, g) in enumerate(order):
        recall[layer][g] = float(len(order) - rank)
    profile.meta["measured"]["recall"] = {"records": 1, "gap": 4, "answers": 3, "baseline_loss": 1.0, "delta": recall}

    def replaced(weight):
        chosen = StreamedLossPolicy(window=4, beta=0.5, recall=1, recall_weight=weight).select(layout, profile)
        return {(layer, g) for layer, heads in enumerate(chosen) for g in range(layout.num_kv_heads) if layout.query_heads_of(g)[0] in heads}

    by_text = {(layer, g) for _d, layer, g in order[:2]}
    by_answers = {(layer, g) for _d, layer, g in order[2:]}
    assert replaced(0.0) == by_text and replaced(1000.0) == by_answers
    costs = measured_cost(profile, 0.5)
    assert costs[order[0][1]][order[0][2]] == pytest.approx(order[0][0] + 0.5 * len(order))
    assert measured_cost(profile, 0.5) != measured_delta(profile)


def test_records_need_room_in_the_measured_blocks():
    from rfkit.data.recall import RecallPlanter

    class Data:  # the recipe's data section as the policy reads it: its planter
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def recall_planter(self, count, gap, field):
            return RecallPlanter(self.tokenizer, count, gap, 0, field=field)

    from transformers import AutoTokenizer

    from rfkit.hub import EMBEDDED_MODEL, resolve_model

    data = Data(AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL)))
    policy = StreamedLossPolicy(sink=SINK, recent=RECENT, blocks=2, window=4, recall=1, recall_gap=40)
    with pytest.raises(PolicyError, match=r"^model\.policy\.recall: no record fits a measured block of 48 tokens with recall_gap 40"):
        policy.make_profile(tiny_model(), _batches(), progress=False, datamodule=data)
    with pytest.raises(PolicyError, match=r"^model\.policy\.recall: planting records needs the recipe's data section"):
        policy.make_profile(tiny_model(), _batches(), progress=False)


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
    base, losses, *_ = streamed_losses(model, _batches()[:1], units, SINK, RECENT, progress=False)
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


@pytest.mark.parametrize(
    "field,value", [("sink", -1), ("recent", 0), ("blocks", 0), ("long_seq_len", 1), ("recall", -1), ("recall_gap", -2), ("recall_weight", -1)]
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(PolicyError, match=f"model.policy.{field}: {value}"):
        StreamedLossPolicy(**{field: value})


@pytest.mark.parametrize(
    "settings,field",
    [({"long_seq_len": [64, 128]}, "long_seq_len"), ({"long_seq_len": [64, 64], "long_source": "x"}, "long_seq_len"),
     ({"long_seq_len": [64, 128], "blocks": [1, 2, 3], "long_source": "x"}, "blocks"),
     ({"long_seq_len": [64, 1], "long_source": "x"}, "long_seq_len"), ({"long_seq_len": [], "long_source": "x"}, "long_seq_len"),
     ({"long_seq_len": [64, 128], "blocks": [1, 0], "long_source": "x"}, "blocks")],
)  # fmt: skip
def test_bad_length_lists_name_the_field(settings, field):
    with pytest.raises(PolicyError, match=f"model.policy.{field}: "):
        StreamedLossPolicy(**settings)


def _measured(seq_len: int, delta: list[list[float]], recall: list[list[float]] | None = None) -> dict:
    extra = {"recall": {"delta": recall}} if recall else {}
    return {"name": "streamed_loss", "granularity": "kv_group", "sink": 4, "recent": 64, "source": "s",
            "seq_len": seq_len, "blocks": 1, "tokens": seq_len - 1, "delta": delta, **extra}  # fmt: skip


def test_lengths_are_ranked_by_their_increases_over_each_lengths_mean():
    # at 8k the increases run 10x larger: without scaling, 8k alone would decide
    short = _measured(2048, [[0.01, 0.03], [0.02, 0.02]])  # mean 0.02
    long = _measured(8192, [[0.4, 0.1], [0.1, 0.2]])  # mean 0.2
    combined = combine_lengths([short, long])
    assert combined["delta"] == [[0.5 + 2.0, 1.5 + 0.5], [1.0 + 0.5, 1.0 + 1.0]]
    assert combined["seq_len"] == [2048, 8192] and combined["tokens"] == 2047 + 8191
    assert combined["by_length"]["8192"] is long
    # the ranking reads the combination; planted records enter at the weight read at selection
    policy = StreamedLossPolicy(long_source="s", long_seq_len=[2048, 8192], blocks=1, beta=0.5)
    assert policy.lengths() == [(2048, 1), (8192, 1)] and policy.at_length(8192, 1).profile_settings()["long_seq_len"] == 8192
    with_recall = combine_lengths([_measured(2048, [[0.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]), long], 0.5)
    assert measured_cost(with_recall, 0.5) == combine_lengths(list(with_recall["by_length"].values()), 0.5)["delta"]
    assert measured_cost(with_recall, 0.0) == combine_lengths(list(with_recall["by_length"].values()), 0.0)["delta"]
    assert measured_cost(with_recall, 0.0) != measured_cost(with_recall, 0.5)


def _convert_on_long_blocks(tiny_model_dir, tiny_corpus, tmp_path, capsys, *extra: str) -> dict:
    """``rfkit convert`` with StreamedLossPolicy measured on 2 long blocks of the tiny corpus
    (its train split, 64 tokens each), plus ``extra``; returns the head map."""
    out = tmp_path / "converted"
    args = [
        "convert", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path),
        "--model.policy", "rfkit.policies.StreamedLossPolicy",
        "--model.policy.init_args.sink", "2",
        "--model.policy.init_args.recent", "8",
        "--model.policy.init_args.blocks", "2",
        "--model.policy.init_args.long_source", str(tiny_corpus),
        "--model.policy.init_args.long_seq_len", "64",
        *extra,
        "--output", str(out),
    ]  # fmt: skip
    code, _out, err = run_cli(args, capsys)
    assert code == 0, err
    return json.loads((out / "head_map.json").read_text())


@pytest.mark.slow
def test_convert_with_the_policy_writes_its_measurements_into_the_head_map(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    head_map = _convert_on_long_blocks(tiny_model_dir, tiny_corpus, tmp_path, capsys)
    assert head_map["policy"]["class_path"] == "rfkit.policies.StreamedLossPolicy"
    measured = head_map["measured"]
    assert measured["name"] == "streamed_loss" and measured["blocks"] == 2 and measured["recent"] == 8
    assert measured["source"] == str(tiny_corpus) and measured["seq_len"] == 64 and measured["tokens"] == 2 * 63
    assert len(measured["delta"]) == 2 and sum(len(s) for s in head_map["selected"]) == 4


@pytest.mark.slow
def test_planted_records_are_measured_and_recorded_in_the_head_map(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    head_map = _convert_on_long_blocks(
        tiny_model_dir, tiny_corpus, tmp_path, capsys,
        "--model.policy.init_args.recall", "1",
        "--model.policy.init_args.recall_gap", "8",
        "--model.policy.init_args.recall_weight", "0.5",
    )  # fmt: skip
    assert head_map["policy"]["recall"] == 1 and head_map["policy"]["recall_weight"] == 0.5
    recall = head_map["measured"]["recall"]
    assert recall["records"] == 1 and recall["gap"] == 8 and 0 < recall["answers"] <= 2 * 8
    assert len(recall["delta"]) == 2 and all(len(row) == 2 for row in recall["delta"])
    # the 2 groups replaced are the 2 cheapest by text + 0.5 x answers
    cost = {(layer, g): d + 0.5 * r for layer, (row, rrow) in enumerate(zip(head_map["measured"]["delta"], recall["delta"])) for g, (d, r) in enumerate(zip(row, rrow))}
    kept_cost = sorted(cost.values())
    chosen = {(layer, g) for layer, heads in enumerate(head_map["selected"]) for g in range(2) if 2 * g in heads}
    assert sorted(cost[u] for u in chosen) == kept_cost[:2]


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


@pytest.mark.slow
def test_several_lengths_are_measured_one_by_one_and_reuse_a_one_length_measurement(tiny_model_dir, tiny_corpus, tmp_path, capsys, caplog):
    import logging

    single = _convert_on_long_blocks(tiny_model_dir, tiny_corpus, tmp_path / "one", capsys, "--model.policy.init_args.blocks", "1")
    with caplog.at_level(logging.INFO, logger="rfkit.conversion.convert"):
        both = _convert_on_long_blocks(
            tiny_model_dir, tiny_corpus, tmp_path / "two", capsys,
            "--model.policy.init_args.long_seq_len", "[32, 64]", "--model.policy.init_args.blocks", "[2, 1]",
        )  # fmt: skip
    assert sum("reusing head profile" in r.getMessage() for r in caplog.records) == 1  # the 64-token part
    measured = both["measured"]
    assert measured["seq_len"] == [32, 64] and measured["blocks"] == [2, 1] and measured["tokens"] == 2 * 31 + 63
    assert measured["by_length"]["64"]["delta"] == single["measured"]["delta"]
    assert measured["delta"] == combine_lengths(list(measured["by_length"].values()))["delta"]
    assert both["policy"]["long_seq_len"] == [32, 64]
