"""The RecurFormer layer against the untouched model, the cache, and save/load."""

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import random_ids, tiny_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache

from rfkit.conversion.convert import save_converted
from rfkit.conversion.headmap import HeadMap
from rfkit.conversion.policies import ExplicitHeads
from rfkit.models.cache import cache_bytes, measure_cache
from rfkit.models.layout import AttentionLayout
from rfkit.models.modeling import PACKED_FORMAT, RecurFormerAttention, to_recurformer
from rfkit.models.operators import MambaOperator

FAMILIES = [("llama", 4, 4), ("llama", 4, 2), ("qwen2", 4, 2), ("mistral", 4, 1)]


def convert(model, selected):
    return to_recurformer(model, selected, MambaOperator(d_state=4, zero_init_output=False))


def zero_heads_reference(model, selected):
    """The original model with the outputs of ``selected`` heads removed (their W_O columns zeroed)."""
    ref = copy.deepcopy(model)
    hd = AttentionLayout.from_config(model.config).head_dim
    with torch.no_grad():
        for layer, heads in enumerate(selected):
            for h in heads:
                ref.model.layers[layer].self_attn.o_proj.weight[:, h * hd : (h + 1) * hd] = 0
    return ref


@pytest.mark.parametrize("family, heads, kv", FAMILIES)
def test_beta_zero_gives_identical_logits(family, heads, kv):
    model = tiny_model(family, heads, kv)
    ids = random_ids()
    before = model(ids).logits
    converted = convert(model, [[], []])
    assert type(converted).__name__ == f"RecurFormer{type(tiny_model(family, heads, kv)).__name__}"
    assert torch.equal(converted(ids).logits, before)


@pytest.mark.parametrize("family, heads, kv", FAMILIES)
@pytest.mark.parametrize("selected", [[[0, 1], []], [[1], [0, 2, 3]], [[0, 1, 2, 3], [3]]])
def test_kept_heads_compute_exactly_what_the_original_did(family, heads, kv, selected):
    """With the mixer's output zeroed, the converted model equals the original with the
    replaced heads' W_O columns zeroed: slicing of Q/K, V routing and the W_O permutation."""
    model = tiny_model(family, heads, kv)
    ids = random_ids()
    reference = zero_heads_reference(model, selected)(ids).logits
    converted = convert(model, selected)
    for layer in converted.model.layers:
        if isinstance(layer.self_attn, RecurFormerAttention):
            torch.nn.init.zeros_(layer.self_attn.mixer.out_proj.weight)
    torch.testing.assert_close(converted(ids).logits, reference, atol=1e-5, rtol=1e-5)


def test_gradients_reach_the_mixer_only_through_replaced_heads():
    model = convert(tiny_model("llama", 4, 2), [[2, 3], []])
    out = model(random_ids()).logits.sum()
    out.backward()
    mixer = model.model.layers[0].self_attn.mixer
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mixer.parameters())


def test_kv_group_selection_frees_exactly_the_selected_kv_heads():
    model = tiny_model("llama", 4, 2)  # head_dim 16
    ids = random_ids(2, 10)
    original = cache_bytes(model(ids, use_cache=True).past_key_values)
    converted = convert(model, [[0, 1], [0, 1, 2, 3]])  # layer 0: group 0; layer 1: both groups
    out = converted(ids, use_cache=True)
    layers = out.past_key_values.layers
    assert layers[0].keys.shape == (2, 1, 10, 16)  # one of two KV heads left
    assert layers[1].keys.shape == (2, 0, 10, 16)  # none left
    measured = cache_bytes(out.past_key_values)
    assert measured["kv"] == original["kv"] // 4  # 1 of 4 (layer, KV head) pairs kept
    d_inner = [16 * 2, 32 * 2]  # expand 2 x (replaced KV heads x head_dim)
    assert measured["state"] == sum(2 * d * (4 + 4) * 4 for d in d_inner)  # conv (d_conv 4) + ssm (d_state 4), fp32


def test_query_head_selection_keeps_the_kv_head_while_any_query_head_uses_it():
    model = convert(tiny_model("llama", 4, 2), [[0], []])  # query head 0 of group 0 replaced
    attn = model.model.layers[0].self_attn
    assert attn.kept_kv_heads == [0, 1] and attn.mixer_kv_heads == [0]
    assert attn._gather  # group 0 keeps 1 query head, group 1 keeps 2
    measured = measure_cache(model, random_ids(1, 8))
    assert measured["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers x KV heads x (K,V) x dim x fp32


@pytest.mark.parametrize("family, heads, kv", FAMILIES)
def test_cached_decoding_matches_one_full_forward(family, heads, kv):
    model = convert(tiny_model(family, heads, kv), [[1, 2], [0, 1, 2, 3]])
    ids = random_ids(2, 20)
    full = model(ids).logits
    cache = DynamicCache()
    pieces = [model(ids[:, :7], past_key_values=cache, use_cache=True).logits]  # prefill 7
    pieces.append(model(ids[:, 7:12], past_key_values=cache, use_cache=True).logits)  # a 5-token chunk
    for t in range(12, 20):  # then one token at a time (the recurrent step)
        pieces.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_save_and_load_restore_identical_logits(tmp_path, family):
    model = tiny_model(family, 4, 2)
    selected = [[0, 1], [2, 3]]
    converted = convert(model, selected)
    layout = AttentionLayout.from_config(converted.config)
    head_map = HeadMap.build("tiny", layout, None, selected, ExplicitHeads(selected), {})
    out = save_converted(converted, head_map, tmp_path / "model")
    assert (out / "model.safetensors").exists() and (out / "head_map.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(loaded) is type(converted)
    ids = random_ids()
    torch.testing.assert_close(loaded(ids).logits, converted(ids).logits, atol=0, rtol=0)
    assert HeadMap.load(out / "head_map.json").selected == selected


PREVIOUS = Path(__file__).resolve().parents[1] / "fixtures" / "previous_release"


@pytest.mark.parametrize("name", ["hybrid_8774ff5", "mamba_qwen2_c8f94e5"])
def test_models_saved_before_the_packed_projection_load_unchanged_and_save_packed(tmp_path, name):
    """Folders saved by earlier releases (separate q/k/v and mq/mk projections; the Qwen2 one with
    biases) load with the logits that release computed, are packed on load, and save packed."""
    folder = PREVIOUS / name
    assert "rf_format_version" not in json.loads((folder / "config.json").read_text())
    reference = torch.load(folder / "reference.pt")
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        torch.testing.assert_close(model(reference["ids"]).logits, reference["logits"], atol=1e-5, rtol=1e-5)
    layers = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(a, RecurFormerAttention) and a.qkv_proj is not None for a in layers)
    assert not [n for n, _ in model.named_parameters() if any(f".{p}." in n for p in ("q_proj", "k_proj", "v_proj", "mq_proj", "mk_proj"))]
    assert model.config.rf_format_version == PACKED_FORMAT
    model.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["rf_format_version"] == PACKED_FORMAT
    with safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as f:
        attention_keys = {k.rsplit(".", 2)[-2] for k in f.keys() if ".self_attn." in k and ".mixer." not in k}
    assert attention_keys == {"qkv_proj", "o_proj"}
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
        torch.testing.assert_close(again(reference["ids"]).logits, reference["logits"], atol=1e-5, rtol=1e-5)


def test_a_converted_layer_makes_one_projection_call_per_forward():
    model = convert(tiny_model("qwen2", 4, 2), [[0, 2], [1]])  # head granularity: both KV heads serve both parts
    calls = []
    for layer in model.model.layers:
        for module in layer.self_attn.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda mod, args, out: calls.append(mod))
    model(random_ids())
    attn = [layer.self_attn for layer in model.model.layers]
    assert [m for m in calls if any(m is a.qkv_proj for a in attn)] == [a.qkv_proj for a in attn]
    assert attn[0].parts == {"q": (0, 2), "mq": (2, 2), "k": (2, 4), "mk": (4, 4), "v": (4, 6), "mv": (6, 8)}


def test_zero_initialised_output_starts_from_the_silenced_heads():
    model = tiny_model("llama", 4, 2)
    selected = [[0, 1], [2, 3]]
    ids = random_ids()
    reference = zero_heads_reference(model, selected)(ids).logits
    converted = to_recurformer(model, selected, MambaOperator(d_state=4))  # zero_init_output defaults on
    torch.testing.assert_close(converted(ids).logits, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family, heads, kv", [("llama", 4, 2), ("qwen2", 4, 2)])
def test_greedy_generate_equals_the_argmax_chain_of_full_forwards(family, heads, kv):
    """generate() with its default cache: kept heads' K/V plus the mixer state ride along."""
    model = convert(tiny_model(family, heads, kv), [[0, 1], [0, 1, 2, 3]])
    ids = random_ids(1, 6)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    seq = ids
    for _ in range(6):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
