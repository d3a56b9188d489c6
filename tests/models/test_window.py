"""Sliding-window and sink + recent operators: exact against masked full attention, the same
cache accounting and decoding paths as the Mamba operator."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_runs_equal, packed, random_ids, tiny_model, train_both_paths

from rfkit.models.cache import cache_bytes, mixer_state_store
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import (
    MambaOperator,
    OperatorError,
    ReplacementOperator,
    SinkRecentOperator,
    SlidingWindowOperator,
)
import rfkit.models.window as window_module
from rfkit.models.window import WindowAttention

ALL = [[0, 1, 2, 3], [0, 1, 2, 3]]


def reference(q, k, v, kv_for_query, sink, window):
    """Naive masked attention over full (B, H, L, hd) tensors: query i sees key j <= i when
    i - j < window or j < sink."""
    L = q.shape[2]
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    allowed = (j <= i) & ((i - j < window) | (j < sink))
    idx = torch.tensor(kv_for_query)
    k, v = k.index_select(1, idx), v.index_select(1, idx)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("sink,window", [(0, 1), (0, 5), (2, 3), (4, 16), (0, 64)])
def test_window_attention_matches_masked_attention(sink, window):
    torch.manual_seed(0)
    kvq = [0, 0, 1, 1, 1]
    q, k, v = torch.randn(2, 5, 20, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    block = WindowAttention(kvq, 8, window=window, sink=sink)
    out = block(packed(q, k, v))
    want = reference(q, k, v, kvq, sink, window).transpose(1, 2).reshape(2, 20, -1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sink,window", [(0, 4), (3, 5)])
def test_chunks_and_steps_equal_one_forward(sink, window):
    torch.manual_seed(1)
    kvq = [0, 1]
    q, k, v = torch.randn(1, 2, 17, 8), torch.randn(1, 2, 17, 8), torch.randn(1, 2, 17, 8)
    x = packed(q, k, v)
    block = WindowAttention(kvq, 8, window=window, sink=sink)
    full = block(x)
    out, state = block(x[:, :2], return_states=True)  # a prefill shorter than the sink + window
    parts = [out]
    out, state = block(x[:, 2:9], *state, return_states=True)
    parts.append(out)
    for t in range(9, 17):
        out, *state = block.step(x[:, t : t + 1], *state)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert state[-1].tolist() == [17]
    assert sum(t.numel() * t.element_size() for t in state) == block.state_bytes(1)


def test_left_padding_leaves_the_state_of_the_unpadded_prompt():
    torch.manual_seed(2)
    block = WindowAttention([0, 0], 8, window=3, sink=2)
    x = packed(torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8))
    out, state = block(x, return_states=True)
    padded = torch.cat([torch.randn(1, 4, x.shape[-1]), x], 1)
    mask = torch.tensor([[0] * 4 + [1] * 6])
    out_p, state_p = block(padded, return_states=True, mask=mask)
    torch.testing.assert_close(out_p[:, 4:], out)
    assert torch.all(out_p[:, :4] == 0)
    for a, b in zip(state, state_p):
        torch.testing.assert_close(a, b)


def train_qkv(kvq, length, seed, batch=2):
    g = torch.Generator().manual_seed(seed)
    hkv = max(kvq) + 1
    return tuple(torch.randn(batch, h, length, 8, generator=g, dtype=torch.float64) for h in (len(kvq), hkv, hkv))


@pytest.mark.parametrize("kvq", [[0, 0, 1, 1], [1, 0, 1]], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("length,drawn", [(45, 7), (45, 2), (5, 7), (5, 3)])
def test_training_runs_tiled_with_the_general_paths_outputs_and_gradients(kvq, sink, length, drawn):
    """A training forward goes through the tiled path at the window it drew (here forced, the full
    7 or shorter), across tile boundaries (45 is not a multiple of TILE) and shorter than the
    window: output, next state and every gradient equal the rank-masked reference's."""
    block = WindowAttention(kvq, 8, window=7, sink=sink).double()
    assert block.grouped == (kvq == [0, 0, 1, 1])
    tiled, general = train_both_paths(block, *train_qkv(kvq, length, seed=length + sink), window=drawn)
    assert_runs_equal(tiled, general)


@pytest.mark.parametrize("drawn", [7, 4])
def test_training_carries_the_state_through_pieces_and_left_padding(drawn, monkeypatch):
    """A carried state in and out (its gradient too), a chunk longer than PREFILL_CHUNK (pieces
    that carry the state), and left-padded rows (each row tiled on its own): the same training
    step as the reference."""
    kvq = [0, 0, 1, 1]
    block = WindowAttention(kvq, 8, window=7, sink=2).double()
    with torch.no_grad():
        _, state = block.eval().attend(*train_qkv(kvq, 11, seed=20), return_states=True)
    monkeypatch.setattr(window_module, "PREFILL_CHUNK", 16)
    q, k, v = train_qkv(kvq, 40, seed=21)
    assert_runs_equal(*train_both_paths(block, q, k, v, state, window=drawn))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :9] = 0
    assert_runs_equal(*train_both_paths(block, q, k, v, state, mask=mask, window=drawn))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("operator", [SlidingWindowOperator(window=64), SinkRecentOperator(sink=4, window=60)])
def test_a_window_longer_than_the_input_is_the_original_model(family, operator):
    model = tiny_model(family)
    ids = random_ids(2, 24)
    with torch.no_grad():
        want = model(ids).logits
        converted = to_recurformer(copy.deepcopy(model), ALL, operator)
        got = converted(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("granularity", ["kv_group", "query_head"])
def test_step_by_step_decoding_equals_one_forward(granularity):
    model = tiny_model("llama")
    selected = [[0, 1], [2, 3]] if granularity == "kv_group" else [[1], [0, 3]]  # query_head: uneven groups
    converted = to_recurformer(model, selected, SinkRecentOperator(sink=2, window=5)).eval()
    ids = random_ids(1, 20)
    with torch.no_grad():
        full = converted(ids).logits
        out = converted(ids[:, :6], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(6, 20):
            out = converted(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    held = cache_bytes(cache)
    # the window layers' state: 2 x (sink + window) tokens of their KV heads, plus a counter
    states = mixer_state_store(cache)
    assert held["state"] == sum(converted.model.layers[i].self_attn.mixer.state_bytes(1) for i in states)


def test_window_state_does_not_grow_and_matches_the_mamba_state_at_sink4_window16():
    model = tiny_model("llama")
    window = to_recurformer(copy.deepcopy(model), [[0, 1], [2, 3]], SinkRecentOperator(sink=4, window=16)).eval()
    mamba = to_recurformer(copy.deepcopy(model), [[0, 1], [2, 3]], MambaOperator()).eval()
    held = []
    for length in (8, 40):
        with torch.no_grad():
            held.append(cache_bytes(window(random_ids(1, length), use_cache=True).past_key_values))
    assert held[0]["state"] == held[1]["state"]  # constant in the sequence length
    assert held[1]["kv"] == 5 * held[0]["kv"]  # kept heads still grow per token
    w_bytes = sum(window.model.layers[i].self_attn.mixer.state_bytes(1) for i in range(2))
    m_bytes = sum(mamba.model.layers[i].self_attn.mixer.state_bytes(1) for i in range(2))
    assert w_bytes - 8 * 2 == m_bytes  # the same K/V bytes as the Mamba state, plus one counter per layer


def test_generate_with_left_padding_matches_unpadded_generation():
    model = tiny_model("llama")
    converted = to_recurformer(model, [[0, 1], [2, 3]], SlidingWindowOperator(window=4)).eval()
    ids = random_ids(1, 10)
    pad = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        plain = converted.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        padded = converted.generate(
            torch.cat([pad, ids], 1),
            attention_mask=torch.cat([torch.zeros_like(pad), torch.ones_like(ids)], 1),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    assert padded[0, 3:].tolist() == plain[0].tolist()


def test_saved_window_model_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen2")
    converted = to_recurformer(model, [[0, 1], []], SinkRecentOperator(sink=1, window=3)).eval()
    converted.save_pretrained(tmp_path, safe_serialization=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(ReplacementOperator.from_dict(loaded.config.rf_operator), SinkRecentOperator)
    ids = random_ids(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, converted(ids).logits)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: SlidingWindowOperator(window=0), "model.operator.window"),
        (lambda: SinkRecentOperator(sink=-1), "model.operator.sink"),
        (lambda: SinkRecentOperator(window="8"), "model.operator.window"),
    ],
)
def test_bad_window_settings_name_the_field(make, field):
    with pytest.raises(OperatorError, match=field):
        make()


@pytest.mark.slow
def test_recipes_name_window_operators_and_comparison_policies(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    from helpers import run_cli, tiny_args
    from transformers import AutoModelForCausalLM

    args = [
        *tiny_args(tiny_model_dir, tiny_corpus, tmp_path),
        "--model.operator", "rfkit.models.operators.SinkRecentOperator",
        "--model.operator.sink", "2", "--model.operator.window", "6",
        "--model.policy", "rfkit.conversion.policies.LayerwisePolicy", "--model.policy.beta", "0.5",
    ]  # fmt: skip
    # training-free operator + freeze: pretrained leaves nothing to train: one clear line, before loading
    code, out, err = run_cli(["fit", *args], capsys)
    assert code == 2
    assert "Loading weights" not in err
    assert err.strip().splitlines()[-1] == (
        "rfkit: error: model.freeze: SinkRecentOperator has no weights to train, so freeze 'pretrained' "
        "leaves nothing; use rfkit convert (training-free), or freeze: none (or lora with a lora section) to fine-tune"
    )
    code, out, err = run_cli(["convert", *args, "--output", str(tmp_path / "conv")], capsys)
    assert code == 0, err
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "conv"))
    assert loaded.config.rf_selected == [[], [0, 1, 2, 3]]
    assert loaded.config.rf_operator["init_args"] == {"sink": 2, "window": 6}
