"""``rfkit.conversion.head_report``: the profile pictures and the first-token contribution table.

Every number the report pass collects is checked against a direct computation from the
tiny model's eager attention weights (``output_attentions``) and its ``v_proj`` outputs.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_ids, tiny_model

from rfkit.conversion.head_report import _INDEX, REPORT_ATTENTION, _summary, collect, pick_heads, write_head_report
from rfkit.conversion.headmap import HeadMap
from rfkit.conversion.policies import ExplicitHeads, RecencyRatioPolicy
from rfkit.conversion.profile import profile_heads
from rfkit.models.layout import AttentionLayout

PNG = b"\x89PNG\r\n\x1a\n"
L = 40


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def ids():
    return random_ids(3, L)


def batches_of(ids):
    return [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]


@pytest.fixture(scope="module")
def head_map(model, ids):
    policy = RecencyRatioPolicy(window=5, alpha=0.3, beta=0.5)
    profile = profile_heads(model, batches_of(ids), progress=False, **policy.profile_settings())
    layout = AttentionLayout.from_config(model.config)
    return HeadMap.build("tiny", layout, profile, policy.select(layout, profile), policy, {})


@pytest.fixture(scope="module")
def reference(model, ids):
    """Eager attention weights (layers of (B, H, L, L)) and values repeated per query head."""
    values = {}
    hooks = [
        layer.self_attn.v_proj.register_forward_hook(lambda m, i, o, k=k: values.__setitem__(k, o.detach()))
        for k, layer in enumerate(model.model.layers)
    ]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    v = {
        k: o.view(o.shape[0], o.shape[1], cfg.num_key_value_heads, d).transpose(1, 2).repeat_interleave(rep, dim=1)
        for k, o in values.items()
    }
    return [a.double() for a in out.attentions], {k: x.double() for k, x in v.items()}


@pytest.mark.slow
def test_report_files_are_valid_pngs_json_and_markdown(model, head_map, ids, tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    paths = write_head_report(model, head_map, batches_of(ids), tmp_path, max_samples=3, progress=False, map_tokens=16, chunk=7)
    assert set(paths) == {"rai_heatmap", "attention_maps", "first_token_contribution_json", "first_token_contribution_md"}
    for key in ("rai_heatmap", "attention_maps"):
        assert paths[key].parent == tmp_path
        assert paths[key].read_bytes()[:8] == PNG
        image = plt.imread(paths[key])
        h, w = image.shape[:2]
        assert image.ndim == 3 and h > 200 and w > h, (key, image.shape)
    h, w = plt.imread(paths["attention_maps"]).shape[:2]
    assert w > 2.5 * h  # three square panels side by side

    doc = json.loads(paths["first_token_contribution_json"].read_text())
    assert doc["samples"] == 3 and doc["seq_len"] == L
    assert set(doc["overall"]) == {"all heads", "replaced heads", "kept heads"}
    assert [row["layer"] for row in doc["per_layer"]] == [0, 1]
    assert len(doc["per_head_mean"]["first_l2"]) == 2 and len(doc["per_head_mean"]["first_l2"][0]) == 4
    everything = doc["overall"]["all heads"]
    assert everything["first_l1"]["n"] == 3 * (L - 1) * 8  # blocks x query positions 1..L-1 x heads
    assert everything["value_first_l2"]["n"] == 3 * 8
    lo, hi = everything["first_l2"]["ci95"]
    assert lo < everything["first_l2"]["mean"] < hi
    assert [p["label"] for p in doc["attention_map_heads"]] == ["highest", "middle", "lowest"]

    md = paths["first_token_contribution_md"].read_text()
    lines = md.splitlines()
    assert f"3 calibration blocks of {L} tokens; {head_map.replaced_heads} of 8 query heads replaced." in lines
    for group in ("all heads", "replaced heads", "kept heads"):
        assert f"## Overall, {group}" in lines
    rows = [line for line in lines if line.startswith("| ")]
    overall = [r for r in rows if r.startswith(("| attention weight", "| value norm", "| contribution"))]
    assert len(overall) == 3 * 7
    assert sum(r.startswith("| contribution L2, other tokens summed") for r in rows) == 3
    per_layer = [r for r in rows if r.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in per_layer] == [0, 1]
    # every table row has as many cells as its header: no stray '|' from norm bars
    assert all(r.count("|") in (5, 10) for r in rows)
    assert "‖a_ij v_j‖_1" in md


def test_picked_heads_are_the_highest_middle_and_lowest_rai(head_map):
    picks = pick_heads(head_map)
    rai = [head_map.rai[layer][h] for _, layer, h in picks]
    flat = sorted(x for row in head_map.rai for x in row)
    assert [label for label, _, _ in picks] == ["highest", "middle", "lowest"]
    assert rai[0] == flat[-1] and rai[2] == flat[0] and rai[1] == flat[len(flat) // 2]
    assert len({(layer, h) for _, layer, h in picks}) == 3


@pytest.mark.parametrize("max_samples", [3, 2])
def test_attention_maps_equal_eager_attention(model, ids, reference, max_samples):
    attentions, _ = reference
    tracked = [(0, 1), (1, 3), (1, 0)]
    collector = collect(model, batches_of(ids), tracked, max_samples=max_samples, map_tokens=16, chunk=7, progress=False)
    assert collector.samples == max_samples
    for (layer, h), summed in zip(tracked, collector.maps):
        expected = attentions[layer][:max_samples, h, :16, :16].mean(0)
        torch.testing.assert_close(summed / collector.samples, expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close((summed / collector.samples).sum(-1), torch.ones(16, dtype=torch.float64))


def test_first_token_contribution_matches_a_direct_computation(model, ids, reference):
    attentions, values = reference
    collector = collect(model, batches_of(ids), [], max_samples=3, chunk=7, progress=False)
    for layer, h in ((0, 2), (1, 1)):
        a = attentions[layer][:, h, 1:, :]  # (B, L-1 queries i >= 1, L keys)
        v = values[layer][:, h]  # (B, L, d)
        others = torch.arange(1, L, dtype=torch.float64)  # query i has i other tokens
        rest = torch.einsum("bij,bjd->bid", a[..., 1:], v[:, 1:])  # sum_{j>=1} a_ij v_j
        direct = {
            "first_l1": a[..., 0] * v[:, :1].abs().sum(-1),
            "first_l2": a[..., 0] * v[:, :1].norm(dim=-1),
            "other_per_token_l1": (a[..., 1:] * v[:, None, 1:].abs().sum(-1)).sum(-1) / others,
            "other_per_token_l2": (a[..., 1:] * v[:, None, 1:].norm(dim=-1)).sum(-1) / others,
            "other_sum_l1": rest.abs().sum(-1),
            "other_sum_l2": rest.norm(dim=-1),
            "weight_first": a[..., 0],
            "weight_other": a[..., 1:].sum(-1) / others,
            "value_first_l2": v[:, 0].norm(dim=-1),
        }
        only = torch.zeros(2, 4, dtype=torch.bool)
        only[layer, h] = True
        for name, x in direct.items():
            got = _summary(collector, name, only)
            assert got["n"] == x.numel(), name
            assert got["mean"] == pytest.approx(x.mean().item(), rel=1e-4, abs=1e-7), name
            if x.numel() > 1:
                sd = x.std().item()
                assert got["sd"] == pytest.approx(sd, rel=1e-3, abs=1e-7), name
                half = 1.96 * sd / x.numel() ** 0.5
                assert got["ci95"][1] == pytest.approx(x.mean().item() + half, rel=1e-3, abs=1e-7), name
        k = _INDEX["first_l1"]
        assert collector.sum[k, layer, h].item() == pytest.approx(direct["first_l1"].sum().item(), rel=1e-4)


def test_report_pass_keeps_the_logits_and_restores_the_attention(model, ids):
    impl = model.config._attn_implementation
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    seen = []
    hook = model.register_forward_hook(lambda m, i, o: seen.append((m.config._attn_implementation, o.logits.detach())))
    try:
        collect(model, [{"input_ids": ids}], [(0, 0)], max_samples=3, map_tokens=16, chunk=5, progress=False)
    finally:
        hook.remove()
    assert len(seen) == 1 and seen[0][0] == REPORT_ATTENTION
    torch.testing.assert_close(seen[0][1], before, atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation == impl
    # restored after a failure too: a later block shorter than the maps is refused mid-pass
    with pytest.raises(ValueError, match="shorter than the 16-token maps"):
        collect(model, [{"input_ids": ids[:1]}, {"input_ids": ids[1:, :10]}], [(0, 0)], max_samples=3, map_tokens=16, progress=False)
    assert model.config._attn_implementation == impl


def test_without_a_profile_only_the_table_is_written(model, ids, tmp_path):
    policy = ExplicitHeads([[0, 1]])
    layout = AttentionLayout.from_config(model.config)
    hm = HeadMap.build("tiny", layout, None, policy.select(layout, None), policy, {})
    paths = write_head_report(model, hm, batches_of(ids), tmp_path, max_samples=2, progress=False)
    assert set(paths) == {"first_token_contribution_json", "first_token_contribution_md"}
    assert not (tmp_path / "rai_heatmap.png").exists()
    doc = json.loads(paths["first_token_contribution_json"].read_text())
    assert doc["samples"] == 2 and doc["attention_map_heads"] == []
    with pytest.raises(ValueError, match="max_samples"):
        write_head_report(model, hm, batches_of(ids), tmp_path, max_samples=0, progress=False)
