"""The hybrid operator: sink + recent softmax plus a gated linear-attention state. Exact against a
naive per-query loop in float64; equal to the training-free sink + recent operator while its gate
is closed; the same decoding, padding, cache and save/reload paths as every operator."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    assert_runs_equal,
    generate_plain_and_left_padded,
    packed,
    prefill_then_steps,
    random_ids,
    tiny_model,
    train_both_paths,
)

from rfkit.models.cache import cache_bytes, mixer_state_store
from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridOperator, OperatorError, ReplacementOperator, SinkRecentOperator
import rfkit.models.window as window_module
from rfkit.models.window import WindowAttention

KVQ = [0, 0, 1]  # three query heads over two KV heads
HD = 8


def random_qkv(batch=2, length=30, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, len(KVQ), length, HD, generator=g, dtype=dtype)
    k = torch.randn(batch, max(KVQ) + 1, length, HD, generator=g, dtype=dtype)
    v = torch.randn(batch, max(KVQ) + 1, length, HD, generator=g, dtype=dtype)
    return q, k, v


def open_block(sink=2, window=5, feature_dim=4, gate=0.7, log_scale=0.3, horizons=None, sharpness=1.0):
    decay = None if horizons is None else 4.0
    block = HybridWindowAttention(
        KVQ, HD, window=window, sink=sink, feature_dim=feature_dim, decay_horizon=decay, sharpness=sharpness
    )
    block = block.double()
    with torch.no_grad():
        block.gate.copy_(torch.tensor([gate, 0.0, gate * 2]))  # head 1 closed: pure sink + recent
        block.log_scale.fill_(log_scale)
        if horizons is not None:
            block.log_horizon.copy_(torch.tensor(horizons, dtype=torch.float64).log())
    return block


def naive(block: HybridWindowAttention, q, k, v):
    """One query at a time, straight from the formula in rfkit.models.hybrid's docstring."""
    B, Hq, L, hd = q.shape
    s, w = block.sink, block.window
    g = block.gate.clamp_min(0) * block.log_scale.exp()
    # decay: a token that left the window a steps ago weighs exp(-a / H) (H per KV head)
    horizon = None if block.log_horizon is None else block.log_horizon.exp()
    out = torch.zeros_like(q)
    for h, kv in enumerate(block.kv_for_query):
        W = block.feature_map[kv]

        def phi(x):
            p = x @ W
            return torch.cat([p.softmax(-1), (-p).softmax(-1)])

        for b in range(B):
            for r in range(L):
                win = [t for t in range(r + 1) if r - t < w or t < s]
                old = [t for t in range(r + 1) if t not in win]
                scores = torch.stack([q[b, h, r] @ k[b, kv, t] * hd**-0.5 for t in win])
                m = scores.max()
                num = sum(torch.exp(scores[i] - m) * v[b, kv, t] for i, t in enumerate(win))
                den = torch.exp(scores - m).sum()
                for t in old:
                    weight = g[h] * torch.exp(-block.sharpness * m) * (phi(q[b, h, r]) @ phi(k[b, kv, t]))
                    if horizon is not None:  # t left the window when the query of rank t + w came
                        weight = weight * torch.exp(-(r - (t + w)) / horizon[kv])
                    num, den = num + weight * v[b, kv, t], den + weight
                out[b, h, r] = num / den
    return out.transpose(1, 2).reshape(B, L, -1)


@pytest.mark.parametrize("horizons,sharpness", [(None, 1.0), ([2.0, 7.0], 1.0), (None, 1.7), ([2.0, 7.0], 2.5)])
@pytest.mark.parametrize("sink,window", [(0, 1), (2, 5), (4, 3)])
def test_open_gate_matches_the_naive_formula_in_float64(sink, window, horizons, sharpness):
    q, k, v = random_qkv()
    block = open_block(sink=sink, window=window, horizons=horizons, sharpness=sharpness)
    with torch.no_grad():
        torch.testing.assert_close(block(packed(q, k, v)), naive(block, q, k, v), rtol=1e-12, atol=1e-12)


def test_closed_gate_is_the_training_free_sink_recent_block():
    q, k, v = random_qkv(seed=3)
    x = packed(q, k, v)
    hybrid = HybridWindowAttention(KVQ, HD, window=5, sink=2, feature_dim=4).double()
    plain = WindowAttention(KVQ, HD, window=5, sink=2).double()
    assert torch.all(hybrid.gate == 0)  # as built
    with torch.no_grad():
        torch.testing.assert_close(hybrid(x), plain(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("horizons,sharpness", [(None, 1.0), ([3.0, 20.0], 1.0), ([3.0, 20.0], 1.6)])
def test_prefill_chunks_and_steps_equal_one_forward_in_float64(horizons, sharpness):
    q, k, v = random_qkv(length=31, seed=4)
    x = packed(q, k, v)
    block = open_block(horizons=horizons, sharpness=sharpness)
    with torch.no_grad():
        full = block(x)
        out, state = block(x[:, :3], return_states=True)  # shorter than sink + window
        parts = [out]
        out, state = block(x[:, 3:17], *state, return_states=True)
        parts.append(out)
        for t in range(17, 31):
            out, *state = block.step(x[:, t : t + 1], *state)
            parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-12, atol=1e-12)
    assert state[2].tolist() == [31, 31]
    # the state is what state_bytes says (float64 here), whatever the length
    assert sum(t.numel() * t.element_size() for t in state) == block.state_bytes(2, torch.float64)


def test_long_chunks_run_in_sub_chunks_with_the_same_result(monkeypatch):
    """A chunk longer than PREFILL_CHUNK runs as sub-chunks carrying the state (memory linear in
    L): outputs, padding and the final state equal the one-piece forward."""
    import rfkit.models.hybrid

    q, k, v = random_qkv(length=29, seed=8)
    x = packed(q, k, v)
    mask = torch.ones(2, 29, dtype=torch.long)
    mask[1, :6] = 0  # left padding that spans a sub-chunk boundary
    block = open_block()
    with torch.no_grad():
        full, state = block(x, return_states=True, mask=mask)
        monkeypatch.setattr(rfkit.models.hybrid, "PREFILL_CHUNK", 4)
        split, split_state = block(x, return_states=True, mask=mask)
        assert torch.equal(block(x, mask=mask), split)
    torch.testing.assert_close(split, full, rtol=1e-12, atol=1e-12)
    for a, b in zip(split_state, state):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_left_padding_leaves_the_state_of_the_unpadded_prompt():
    q, k, v = random_qkv(batch=1, length=12, seed=5)
    x = packed(q, k, v)
    block = open_block()
    padded = torch.cat([torch.randn(1, 4, x.shape[-1], dtype=x.dtype), x], 1)
    mask = torch.tensor([[0] * 4 + [1] * 12])
    with torch.no_grad():
        out, state = block(x, return_states=True)
        out_p, state_p = block(padded, return_states=True, mask=mask)
    torch.testing.assert_close(out_p[:, 4:], out, rtol=1e-12, atol=1e-12)
    assert torch.all(out_p[:, :4] == 0)
    for a, b in zip(state, state_p):
        torch.testing.assert_close(a, b)


def test_the_state_carries_tokens_that_left_the_window():
    """Change the value of a token far outside the window: only an open gate lets it through."""
    q, k, v = random_qkv(batch=1, length=20, seed=6)
    changed = v.clone()
    changed[:, :, 3] += 5.0  # token 3: past the sink (2) and outside the window of the last query
    closed = HybridWindowAttention(KVQ, HD, window=5, sink=2, feature_dim=4).double()
    opened = open_block()
    with torch.no_grad():
        for block, should_change in ((closed, False), (opened, True)):
            last = block(packed(q, k, v))[:, -1]
            last_changed = block(packed(q, k, changed))[:, -1]
            assert bool((last - last_changed).abs().max() > 1e-6) == should_change


def training_block(kvq, sink, horizons, sharpness=1.0):
    """An open block at window 7 (one head's gate closed at exactly 0: its gradient there must be
    the reference's too), with a horizon per KV head or no decay, at a sharpness."""
    decay = None if horizons is None else 4.0
    block = HybridWindowAttention(kvq, HD, window=7, sink=sink, feature_dim=4, decay_horizon=decay, sharpness=sharpness)
    block = block.double()
    with torch.no_grad():
        block.gate.copy_(torch.tensor([1.0, 0.0, 0.6, 1.3])[: len(kvq)])
        block.log_scale.copy_(torch.tensor([0.3, -0.2, 0.5, 0.1])[: len(kvq)])
        if horizons is not None:
            block.log_horizon.copy_(torch.tensor(horizons, dtype=torch.float64).log())
    return block


def training_qkv(kvq, length, seed):
    g = torch.Generator().manual_seed(seed)
    hkv = max(kvq) + 1
    return tuple(torch.randn(2, h, length, HD, generator=g, dtype=torch.float64) for h in (len(kvq), hkv, hkv))


@pytest.mark.parametrize("horizons,sharpness", [(None, 1.0), ([2.0, 9.0], 1.0), ([2.0, 9.0], 1.8)])
@pytest.mark.parametrize("kvq", [[0, 0, 1, 1], KVQ], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("sink", [0, 2])
@pytest.mark.parametrize("length,drawn", [(45, 7), (45, 3), (5, 7), (5, 2)])
def test_training_runs_tiled_with_the_general_paths_outputs_and_gradients(kvq, sink, horizons, sharpness, length, drawn):
    """A training forward goes through the tiled path at its drawn window (forced here: the full 7
    or shorter, whose gap to 7 the state then reads), across tile boundaries and shorter than the
    window: output, next state and the gradients of q, k, v, the feature map, gate, log-scale and
    horizon equal the rank-masked reference's, at the softmax's scale and at a sharper one."""
    block = training_block(kvq, sink, horizons, sharpness)
    assert block.grouped == (kvq == [0, 0, 1, 1])
    tiled, general = train_both_paths(block, *training_qkv(kvq, length, seed=length + sink), window=drawn)
    assert_runs_equal(tiled, general)
    if length > drawn + sink + 1:  # two tokens leave the window (one to age): every weight has a gradient
        assert all(tiled[f"grad.{name}"].abs().sum() > 0 for name, _ in block.named_parameters())


@pytest.mark.parametrize("horizons", [None, [2.0, 9.0]])
@pytest.mark.parametrize("drawn", [7, 3])
def test_training_carries_the_state_through_pieces_and_left_padding(horizons, drawn, monkeypatch):
    """A carried state in and out (the gradients of S and z too), a chunk longer than
    PREFILL_CHUNK (pieces that carry the state) and left-padded rows: the same training step as
    the reference."""
    block = training_block([0, 0, 1, 1], 2, horizons)
    with torch.no_grad():
        _, state = block.eval().attend(*training_qkv([0, 0, 1, 1], 13, seed=30), return_states=True)
    monkeypatch.setattr(window_module, "PREFILL_CHUNK", 16)
    q, k, v = training_qkv([0, 0, 1, 1], 40, seed=31)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :9] = 0
    for given in (None, mask):
        tiled, general = train_both_paths(block, q, k, v, state, mask=given, window=drawn)
        assert_runs_equal(tiled, general)
        assert tiled["grad.state.3"].abs().sum() > 0 and tiled["grad.state.4"].abs().sum() > 0


def test_the_compiled_kernel_serves_only_forwards_without_gradient_at_the_full_window(monkeypatch):
    """float32 on CPU is the compiled prefill's case, but it has no backward and knows only the
    block's window: a forward whose block weights need a gradient (the queries of a frozen
    model's first trained block need none) or that drew a shorter window runs the PyTorch tiles."""
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    q, k, v = (t.float() for t in training_qkv([0, 0, 1, 1], 40, seed=40))
    block = training_block([0, 0, 1, 1], 2, None).float()
    calls = []
    compiled = cpu_kernels.window_prefill_cpu
    monkeypatch.setattr(cpu_kernels, "window_prefill_cpu", lambda *a: calls.append(1) or compiled(*a))
    with torch.no_grad():
        block.eval().attend(q, k, v)
    assert calls == [1]  # inference without gradient: the kernel
    calls.clear()
    block.train().attend(q, k, v).square().sum().backward()  # no dropout: the full window
    assert not calls and block.feature_map.grad.abs().sum() > 0
    monkeypatch.setattr(block, "train_window", lambda: 3, raising=False)
    with torch.no_grad():
        short = block.attend(q, k, v)
        assert not calls
        monkeypatch.setattr(block, "fast", False, raising=False)
        torch.testing.assert_close(short, block.attend(q, k, v), rtol=1e-5, atol=1e-5)


def test_window_dropout_only_in_training():
    q, k, v = random_qkv(batch=1, length=40, seed=7, dtype=torch.float32)
    x = packed(q, k, v)
    block = HybridWindowAttention(KVQ, HD, window=16, sink=2, feature_dim=4, window_dropout=1.0)
    block._generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        evals = [block.eval()(x) for _ in range(2)]
        trains = [block.train()(x) for _ in range(4)]
    torch.testing.assert_close(evals[0], evals[1])
    assert any((t - evals[0]).abs().max() > 1e-4 for t in trains)  # a shorter window changes the output


@pytest.mark.parametrize("decay", [None, 6.0])
def test_calibrate_opens_the_gate_with_a_finite_scale(decay):
    q, k, v = random_qkv(batch=2, length=24, seed=8, dtype=torch.float32)
    block = HybridWindowAttention(KVQ, HD, window=4, sink=1, feature_dim=4, decay_horizon=decay)
    report = block.calibrate(packed(q, k, v))
    assert torch.all(block.gate == 1)
    assert torch.isfinite(block.log_scale).all() and block.log_scale.abs().sum() > 0
    assert all(0 < share < 1 for share in report["old_share"])


def converted(family="llama", operator=None, selected=([0, 1], [2, 3])):
    model = tiny_model(family)
    block_op = operator or HybridOperator(sink=2, window=5, feature_dim=4)
    model = to_recurformer(model, [list(s) for s in selected], block_op).eval()
    with torch.no_grad():  # open every gate: the tests below must see the state at work
        for layer in model.model.layers:
            mixer = getattr(layer.self_attn, "mixer", None)
            if isinstance(mixer, HybridWindowAttention):  # a stateless layer's block has no gate
                mixer.gate.fill_(0.5)
                mixer.log_scale.fill_(1.0)
    return model


@pytest.mark.parametrize("decay,sharpness", [(None, 1.0), (6.0, 1.0), (6.0, 1.5)])
@pytest.mark.parametrize("granularity", ["kv_group", "query_head"])
def test_converted_model_step_decoding_equals_one_forward(granularity, decay, sharpness):
    selected = ([0, 1], [2, 3]) if granularity == "kv_group" else ([1], [0, 3])
    operator = HybridOperator(sink=2, window=5, feature_dim=4, decay_horizon=decay, sharpness=sharpness)
    model = converted(selected=selected, operator=operator)
    full, steps, cache = prefill_then_steps(model, random_ids(1, 24))
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    states = mixer_state_store(cache)
    assert cache_bytes(cache)["state"] == sum(model.model.layers[i].self_attn.mixer.state_bytes(1) for i in states)


def test_closed_gates_convert_to_the_sink_recent_model():
    model = tiny_model("qwen2")
    ids = random_ids(2, 30)
    hybrid = to_recurformer(copy.deepcopy(model), [[0, 1], [2, 3]], HybridOperator(sink=2, window=5, feature_dim=4)).eval()
    plain = to_recurformer(copy.deepcopy(model), [[0, 1], [2, 3]], SinkRecentOperator(sink=2, window=5)).eval()
    with torch.no_grad():
        torch.testing.assert_close(hybrid(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_stateless_layers_keep_the_sink_and_window_alone():
    """A stateless layer's replaced heads get the training-free block (no weights, no state): the
    model reads as the hybrid with that layer's state switched off, decodes step by step as it
    runs whole, holds less state, and saves and reloads with the setting."""
    full = converted()
    operator = HybridOperator(sink=2, window=5, feature_dim=4, stateless_layers=[1])
    model = converted(operator=operator)
    mixers = [layer.self_attn.mixer for layer in model.model.layers]
    assert isinstance(mixers[0], HybridWindowAttention) and type(mixers[1]) is WindowAttention
    assert next(mixers[1].parameters(), None) is None
    model.load_state_dict(full.state_dict(), strict=False)  # layer 0's state as the full hybrid's
    ids = random_ids(2, 30)
    with torch.no_grad():
        with full.model.layers[1].self_attn.mixer.state_ablation():
            want = full(ids).logits
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        assert (full(ids).logits - want).abs().max() > 1e-4  # layer 1's state did something
    whole, steps, cache = prefill_then_steps(model, random_ids(1, 24))
    torch.testing.assert_close(steps, whole, rtol=1e-4, atol=1e-4)
    _, _, full_cache = prefill_then_steps(full, random_ids(1, 24))
    assert cache_bytes(cache)["state"] < cache_bytes(full_cache)["state"]
    assert operator.to_dict()["init_args"]["stateless_layers"] == [1]
    assert "stateless_layers" not in HybridOperator().init_args()  # absent when empty: old configs read alike
    rebuilt = ReplacementOperator.from_dict(model.config.rf_operator)
    assert rebuilt.stateless_layers == [1]


def test_a_stateless_layer_must_replace_heads_and_transfer_trains_the_others():
    from rfkit.training.transfer import TransferConfig, transfer

    with pytest.raises(OperatorError, match="model.operator.stateless_layers: layer 2 replaces no head.*allowed: 0, 1"):
        to_recurformer(tiny_model("llama"), [[0, 1], [2, 3]], HybridOperator(stateless_layers=[2]))
    with pytest.raises(OperatorError, match="allowed: 1$"):
        to_recurformer(tiny_model("llama"), [[], [2, 3]], HybridOperator(stateless_layers=[0]))
    operator = HybridOperator(sink=1, window=4, feature_dim=4, stateless_layers=[0])
    model = to_recurformer(tiny_model("llama"), [[0, 1], [2, 3]], operator)
    report = transfer(model, random_ids(8, 32, seed=3), TransferConfig(steps=5, lr=1e-2, samples=8, batch_size=4), progress=False)
    assert set(report["calibration"]) == {"1"}  # the stateless layer calibrates and trains nothing
    assert report["mse_after"]["0"] == pytest.approx(report["mse_before"]["0"])


def test_generate_with_left_padding_matches_unpadded_generation():
    model = converted()
    plain, padded = generate_plain_and_left_padded(model, random_ids(1, 12))
    assert padded[0].tolist() == plain[0].tolist()


def test_saved_hybrid_model_reloads_with_its_trained_state(tmp_path):
    from transformers import AutoModelForCausalLM

    model = converted("mistral")
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    operator = ReplacementOperator.from_dict(loaded.config.rf_operator)
    assert isinstance(operator, HybridOperator) and operator.feature_dim == 4
    assert float(loaded.model.layers[0].self_attn.mixer.gate[0]) == 0.5
    ids = random_ids(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_transfer_fits_the_state_and_never_ends_worse_than_it_started():
    from rfkit.training.transfer import TransferConfig, transfer

    model = to_recurformer(tiny_model("llama"), [[0, 1], [2, 3]], HybridOperator(sink=1, window=4, feature_dim=4, window_dropout=0.5))
    blocks = random_ids(8, 32, seed=3)
    report = transfer(model, blocks, TransferConfig(steps=30, lr=1e-2, samples=8, batch_size=4), progress=False)
    assert set(report["calibration"]) == {"0", "1"}
    for layer in ("0", "1"):
        assert report["mse_after"][layer] <= report["mse_before"][layer]
    improved = [layer for layer in ("0", "1") if report["mse_after"][layer] < report["mse_before"][layer]]
    kept = {str(i) for i in report["kept_start"]}
    assert set(improved) | kept == {"0", "1"}
    for i in report["kept_start"]:  # a layer that could not improve is left exactly as built
        assert torch.all(model.model.layers[i].self_attn.mixer.gate == 0)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: HybridOperator(feature_dim=3), "model.operator.feature_dim"),
        (lambda: HybridOperator(feature_dim=0), "model.operator.feature_dim"),
        (lambda: HybridOperator(window_dropout=1.5), "model.operator.window_dropout"),
        (lambda: HybridOperator(window=0), "model.operator.window"),
        (lambda: HybridOperator(decay_horizon=0.5), "model.operator.decay_horizon"),
        (lambda: HybridOperator(decay_horizon=float("inf")), "model.operator.decay_horizon"),
        (lambda: HybridOperator(decay_horizon="long"), "model.operator.decay_horizon"),
        (lambda: HybridOperator(sharpness=0.5), "model.operator.sharpness"),
        (lambda: HybridOperator(sharpness=float("nan")), "model.operator.sharpness"),
        (lambda: HybridOperator(sharpness="sharp"), "model.operator.sharpness"),
        (lambda: HybridOperator(stateless_layers=[-1]), "model.operator.stateless_layers"),
        (lambda: HybridOperator(stateless_layers=[1.5]), "model.operator.stateless_layers"),
        (lambda: HybridOperator(stateless_layers=5), "model.operator.stateless_layers"),
    ],
)
def test_bad_hybrid_settings_name_the_field(make, field):
    with pytest.raises(OperatorError, match=field):
        make()


def test_state_bytes_match_the_sink_recent_operator_it_is_compared_with():
    """sink 4 + window 56 + feature_dim 16 at head_dim 64 holds the K/V of sink 4 + window 64 plus
    64 bytes per KV head: the matched-bytes pair of the comparison."""
    hybrid = HybridOperator(sink=4, window=56, feature_dim=16).make_block([0, 0, 0], 64, None)
    plain = SinkRecentOperator(sink=4, window=64).make_block([0, 0, 0], 64, None)
    assert hybrid.state_bytes(1) - plain.state_bytes(1) == 16 * 4


def test_decay_calibrates_to_a_larger_scale_and_trains_its_horizon():
    """With a decay the old tokens weigh less, so calibration scales them up to the same softmax
    mass; the horizon is a parameter that training moves."""
    q, k, v = random_qkv(batch=2, length=40, seed=12, dtype=torch.float32)
    x = packed(q, k, v)
    plain = HybridWindowAttention(KVQ, HD, window=4, sink=1, feature_dim=4)
    decayed = HybridWindowAttention(KVQ, HD, window=4, sink=1, feature_dim=4, decay_horizon=3.0)
    with torch.no_grad():
        decayed.feature_map.copy_(plain.feature_map)
    plain.calibrate(x)
    decayed.calibrate(x)
    assert torch.all(decayed.log_scale > plain.log_scale)
    decayed.train()
    decayed.window_dropout = 0.0
    decayed(x).pow(2).sum().backward()
    assert decayed.log_horizon.grad is not None and decayed.log_horizon.grad.abs().sum() > 0


def test_decay_is_recorded_only_when_set_so_old_models_read_alike():
    """A model saved before the decay existed has no decay_horizon in its operator record and no
    log_horizon weight; it rebuilds without one. With a decay, the horizon round-trips."""
    assert "decay_horizon" not in HybridOperator().init_args()
    assert HybridWindowAttention(KVQ, HD, window=4).log_horizon is None
    spec = HybridOperator(decay_horizon=256).to_dict()
    again = ReplacementOperator.from_dict(spec)
    assert again.decay_horizon == 256.0
    block = again.make_block(KVQ, HD, None)
    torch.testing.assert_close(block.log_horizon.detach().exp(), torch.full((2,), 256.0))


def test_sharpness_is_recorded_only_when_set_and_rebuilds_the_block():
    """Models saved before the sharpness existed read as sharpness 1 (nothing recorded); a set
    one round-trips through the operator record into the block."""
    assert "sharpness" not in HybridOperator().init_args()
    spec = HybridOperator(sharpness=1.5).to_dict()
    assert spec["init_args"]["sharpness"] == 1.5
    block = ReplacementOperator.from_dict(spec).make_block(KVQ, HD, None)
    assert block.sharpness == 1.5 and "sharpness=1.5" in repr(block)


def test_a_sharper_block_gives_the_window_more_weight_where_its_best_score_is_positive():
    """y = (A + c a) / (Z + c zl) lies between the window's output A / Z and the state's a / zl,
    nearer the window as c falls. With c = g e^{-tau m}, raising tau lowers c where the window's
    best score m is above 0 and raises it where m is below 0: measured against the closed gate
    (the window alone), per query and head."""
    q, k, v = random_qkv(batch=1, length=30, seed=21)
    u = torch.randn(HD, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    k = u + 0.1 * k  # keys near one direction: queries along it (even ranks) score above 0,
    sign = torch.tensor([1.0, -1.0]).repeat(15).view(1, 1, 30, 1)  # against it (odd) below
    q = 2.0 * sign * u + 0.1 * q
    x = packed(q, k, v)
    soft, sharp = open_block(), open_block(sharpness=2.0)
    with torch.no_grad():
        sharp.feature_map.copy_(soft.feature_map)
        window_only = open_block(gate=0.0)
        window_only.feature_map.copy_(soft.feature_map)
        far = [(b(x) - window_only(x)).view(1, 30, len(KVQ), HD).norm(dim=-1) for b in (soft, sharp)]
    scores = (q @ k[:, KVQ].transpose(-1, -2)) * HD**-0.5  # (1, Hq, L, L)
    i, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    win = (j <= i) & ((i - j < soft.window) | (j < soft.sink))
    m = scores.masked_fill(~win, float("-inf")).amax(-1).transpose(1, 2)  # (1, L, Hq)
    has_old = (i - soft.window >= soft.sink).squeeze(-1)[None, :, None].expand_as(m)
    moved = has_old & (soft.gate > 0)[None, None, :].expand_as(m) & (m.abs() > 1e-3)
    above, below = moved & (m > 0), moved & (m < 0)
    assert above.any() and below.any()
    assert torch.all(far[1][above] < far[0][above]) and torch.all(far[1][below] > far[0][below])


def test_sharpen_script_writes_a_copy_that_loads_at_the_new_sharpness(tmp_path, tiny_model_dir, capsys):
    """benchmarks/sharpen.py: the copy's operator record holds the sharpness and its logits are
    those of the same model with its blocks set to it in memory; the folder's own code is written
    again; bad input exits 2 without writing anything."""
    from helpers import load_script
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from rfkit.conversion.convert import save_converted
    from rfkit.conversion.headmap import HeadMap
    from rfkit.models.layout import AttentionLayout
    from rfkit.conversion.policies import ExplicitHeads

    selected = [[0, 1], [2, 3]]
    model = to_recurformer(LlamaForCausalLM.from_pretrained(str(tiny_model_dir)), selected, HybridOperator(sink=2, window=5, feature_dim=4))
    blocks = [m for m in model.modules() if isinstance(m, HybridWindowAttention)]
    with torch.no_grad():
        for block in blocks:
            block.gate.fill_(0.5)
    head_map = HeadMap.build("tiny", AttentionLayout.from_config(model.config), None, selected, ExplicitHeads(selected), {})
    src = save_converted(model.eval(), head_map, tmp_path / "src", AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    sharpen = load_script("benchmarks/sharpen.py")
    assert sharpen.main([str(src), str(tmp_path / "bad"), "--sharpness", "0.9"]) == 2
    assert sharpen.main([str(src), str(src), "--sharpness", "1.5"]) == 2  # DST exists
    assert "model.operator.sharpness" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert sharpen.main([str(src), str(tmp_path / "sharp"), "--sharpness", "1.5"]) == 0
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        for block in blocks:
            block.sharpness = 1.5
        want = model(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharp")).eval()(ids).logits
    assert (want - before).abs().max() > 1e-4  # the sharpness changes the outputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the folder's own code (transformers without rfkit) is written again, so it reads the sharpness
    assert "self.sharpness" in (tmp_path / "sharp" / "rfkit_hybrid.py").read_text()
    # --close-states: the listed layers' gates are 0 in the copy, the rest as they were; its
    # logits are the model's with that layer's state ablated in memory
    assert sharpen.main([str(src), str(tmp_path / "closed"), "--close-states", "1"]) == 0
    with torch.no_grad():
        for block in blocks:
            block.sharpness = 1.0
        with blocks[1].state_ablation():
            want = model(ids).logits
        closed = AutoModelForCausalLM.from_pretrained(str(tmp_path / "closed")).eval()
        got = closed(ids).logits
    gates = [m.gate for m in closed.modules() if m.__class__.__name__ == "HybridWindowAttention"]
    assert gates[0].eq(0.5).all() and gates[1].eq(0).all()
    assert (want - before).abs().max() > 1e-4  # closing one layer's state changes the outputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sharpen.main([str(src), str(tmp_path / "nothing")]) == 2  # neither option: the copy would be the source
    assert sharpen.main([str(src), str(tmp_path / "bad_layer"), "--close-states", "7"]) == 2
    assert "--close-states: layer 7 replaces no head" in capsys.readouterr().err and not (tmp_path / "bad_layer").exists()
    # --close-heads: only the named heads of a listed layer; the layer's other head as it was
    assert sharpen.main([str(src), str(tmp_path / "one_head"), "--close-states", "1,0", "--close-heads", '{"1": [1]}']) == 0
    got = [m.gate for m in AutoModelForCausalLM.from_pretrained(str(tmp_path / "one_head")).modules() if m.__class__.__name__ == "HybridWindowAttention"]
    assert got[0].eq(0).all() and got[1].tolist() == [0.5, 0.0]
    for heads, message in [('{"1": [2]}', "--close-heads: layer 1 has 2 heads with a state (0 to 1)"), ('{"0": [0]}', "--close-heads: layer 0 is not in"), ("[1]", "--close-heads: give JSON")]:
        assert sharpen.main([str(src), str(tmp_path / "bad_heads"), "--close-states", "1", "--close-heads", heads]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "bad_heads").exists()
