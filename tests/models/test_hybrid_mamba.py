"""The hybrid Mamba operator: sink + recent softmax plus a gated selective state space over the evicted
tokens. Exact against a per-token recurrence in float64; equal to the training-free sink + recent
operator while its gate is closed; its three paths (general, tiled prefill, decode step) agree;
the same decoding, padding, cache and save/reload paths as every operator."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
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
from rfkit.models.hybrid_mamba import HybridMambaAttention
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridOperator, OperatorError, ReplacementOperator, SinkRecentOperator
import rfkit.models.window as window_module
from rfkit.models.window import WindowAttention
from rfkit.operators import HybridMambaOperator

KVQ = [0, 0, 1]  # three query heads over two KV heads
HD = 8


def random_qkv(batch=2, length=30, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, len(KVQ), length, HD, generator=g, dtype=dtype)
    k = torch.randn(batch, max(KVQ) + 1, length, HD, generator=g, dtype=dtype)
    v = torch.randn(batch, max(KVQ) + 1, length, HD, generator=g, dtype=dtype)
    return q, k, v


def open_block(sink=2, window=5, state_dim=4, kvq=KVQ, seed=0, window_gain=False):
    """A block with every state weight moved off its start (so each one matters), gates open
    (and, with ``window_gain``, the window's gains off 1)."""
    block = HybridMambaAttention(kvq, HD, window=window, sink=sink, state_dim=state_dim, window_gain=window_gain).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.proj.copy_(torch.randn(block.proj.shape, generator=g, dtype=torch.float64) * 0.5)
        block.dt_weight.copy_(torch.randn(block.dt_weight.shape, generator=g, dtype=torch.float64) * 0.3)
        block.dt_bias.copy_(torch.tensor([-1.0, 0.5])[: block.num_kv_heads])
        block.A_log.copy_(torch.randn(block.A_log.shape, generator=g, dtype=torch.float64) * 0.5)
        gates = torch.tensor([0.7, 0.0, 1.4, -0.5])[: block.num_heads]  # head 1 closed: pure sink + recent
        block.gate.copy_(gates)
        if window_gain:
            block.window_gain.copy_(torch.tensor([1.3, 0.6, -0.4, 0.9])[: block.num_heads])
    return block


def naive(block: HybridMambaAttention, q, k, v, window_of=None):
    """One query at a time, straight from the formulas in rfkit.models.hybrid_mamba's docstring: the
    window's softmax, and the recurrence run token by token over ranks sink .. r - window.
    ``window_of(r)``: the window of query ``r`` (default: the block's)."""
    B, Hq, L, hd = q.shape
    s = block.sink
    window_of = window_of or (lambda r: block.window)
    out = torch.zeros_like(q)
    for h, kv in enumerate(block.kv_for_query):
        P, w, b = block.proj[kv], block.dt_weight[kv], block.dt_bias[kv]
        A = -torch.exp(block.A_log[kv])
        for bi in range(B):
            for r in range(L):
                win = [t for t in range(r + 1) if r - t < window_of(r) or t < s]
                scores = torch.stack([q[bi, h, r] @ k[bi, kv, t] * hd**-0.5 for t in win])
                y = sum(p * v[bi, kv, t] for p, t in zip(scores.softmax(0), win))
                state = torch.zeros(block.state_dim, hd, dtype=q.dtype)
                for t in range(s, r - window_of(r) + 1):
                    dt = F.softplus(k[bi, kv, t] @ w + b)
                    x_t, B_t = v[bi, kv, t], P.T @ k[bi, kv, t]
                    state = torch.exp(dt * A)[:, None] * state + dt * B_t[:, None] * x_t[None, :]
                gain = 1.0 if block.window_gain is None else block.window_gain[h]
                out[bi, h, r] = gain * y + block.gate[h] * hd**-0.5 * ((P.T @ q[bi, h, r]) @ state)
    return out.transpose(1, 2).reshape(B, L, -1)


def general(block, x, *state, window=None, return_states=False, mask=None):
    """The rank-masked path that training runs, at a fixed window (no dropout)."""
    q, k, v = block._split(x)
    return block._general(q, k, v, state, mask, block.window if window is None else window, return_states)


@pytest.mark.parametrize("sink,window", [(0, 1), (2, 5), (4, 3)])
def test_open_gate_matches_the_per_token_recurrence_in_float64(sink, window):
    q, k, v = random_qkv()
    block = open_block(sink=sink, window=window).eval()
    expected = naive(block, q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(block(packed(q, k, v)), expected, rtol=1e-12, atol=1e-12)  # tiled prefill
        torch.testing.assert_close(general(block, packed(q, k, v)), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kvq", [KVQ, [1, 0, 1]], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("sink,window", [(0, 1), (2, 5)])
def test_a_learned_window_gain_matches_the_recurrence_on_every_path(kvq, sink, window):
    """``window_gain``: each query head's window output times its own gain (Mamba's skip ``D`` at
    sink 0, window 1), the same on the tiled prefill, the rank-masked path, and decode steps."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, n, 26, HD, generator=g, dtype=torch.float64) for n in (3, 2, 2))
    x = packed(q, k, v)
    block = open_block(sink=sink, window=window, kvq=kvq, window_gain=True).eval()
    expected = naive(block, q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(general(block, x), expected, rtol=1e-12, atol=1e-12)
        out, state = block(x[:, :9], return_states=True)
        steps = [out]
        for t in range(9, 26):
            out, *state = block.step(x[:, t : t + 1], *state)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=1e-12, atol=1e-12)
    assert block.window_gain.requires_grad and "window_gain=True" in repr(block)


def test_a_learned_window_gain_trains_tiled_as_on_the_general_path():
    block = open_block(sink=0, window=1, kvq=[0, 0, 1, 1], window_gain=True)
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, n, 40, HD, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    tiled, general_run = train_both_paths(block, q, k, v, window=1)
    assert_runs_equal(tiled, general_run)
    assert tiled["grad.window_gain"].abs().sum() > 0


def test_ungrouped_query_heads_match_the_recurrence():
    """Query heads not in equal runs per KV head (query_head selection): every head its own group."""
    kvq = [1, 0, 1]
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, n, 26, HD, generator=g, dtype=torch.float64) for n in (3, 2, 2))
    block = open_block(kvq=kvq).eval()
    assert not block.grouped
    with torch.no_grad():
        full = block(packed(q, k, v))
        torch.testing.assert_close(full, naive(block, q, k, v), rtol=1e-12, atol=1e-12)
        out, state = block(packed(q, k, v)[:, :9], return_states=True)
        steps = [out]
        for t in range(9, 26):
            out, *state = block.step(packed(q, k, v)[:, t : t + 1], *state)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-12, atol=1e-12)


def test_a_shorter_training_window_reads_the_state_further_on():
    """Window dropout's shorter window: the window shrinks and each query reads the state after the
    rank r - window' (what the window no longer holds), also from a carried state."""
    q, k, v = random_qkv(length=34, seed=2)
    x = packed(q, k, v)
    block = open_block(sink=2, window=7)
    with torch.no_grad():
        out, state = block.eval()(x[:, :12], return_states=True)
        short = general(block, x[:, 12:], *state, window=3)
    expected = naive(block, q, k, v, window_of=lambda r: 7 if r < 12 else 3)
    torch.testing.assert_close(torch.cat([out, short], 1), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_closed_gate_is_the_training_free_sink_recent_block_on_every_path(dtype, tol):
    q, k, v = random_qkv(length=31, seed=3, dtype=dtype)
    x = packed(q, k, v)
    block = HybridMambaAttention(KVQ, HD, window=5, sink=2, state_dim=4).to(dtype)
    plain = WindowAttention(KVQ, HD, window=5, sink=2).to(dtype)
    assert torch.all(block.gate == 0)  # as built
    mask = torch.ones(2, 31, dtype=torch.long)
    mask[1, 5:8] = 0  # a hole: the general path
    with torch.no_grad():
        expected = plain(x)
        torch.testing.assert_close(block.eval()(x), expected, rtol=0, atol=tol)  # tiled prefill
        torch.testing.assert_close(block.train()(x), expected, rtol=0, atol=tol)  # training, no dropout
        torch.testing.assert_close(block.eval()(x, mask=mask), plain(x, mask=mask), rtol=0, atol=tol)
        out, state = block.eval()(x[:, :9], return_states=True)
        steps = [out]
        for t in range(9, 31):
            out, *state = block.step(x[:, t : t + 1], *state)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=0, atol=tol)  # decode step


def test_prefill_chunks_and_steps_equal_one_forward_in_float64():
    q, k, v = random_qkv(length=31, seed=4)
    x = packed(q, k, v)
    block = open_block().eval()
    with torch.no_grad():
        full, full_state = block(x, return_states=True)
        out, state = block(x[:, :3], return_states=True)  # shorter than sink + window
        parts = [out]
        out, state = block(x[:, 3:17], *state, return_states=True)
        parts.append(out)
        two, two_state = block(x[:, 17:], *state, return_states=True)  # two prefill chunks == one
        for t in range(17, 31):
            out, *state = block.step(x[:, t : t + 1], *state)
            parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(parts[:2] + [two], 1), full, rtol=1e-12, atol=1e-12)
    for a, b, c in zip(state, two_state, full_state):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12)
    assert state[2].tolist() == [31, 31]
    # the state is what state_bytes says (float64 here), whatever the length
    assert sum(t.numel() * t.element_size() for t in state) == block.state_bytes(2, torch.float64)


def test_decoding_from_an_empty_state_equals_one_forward():
    q, k, v = random_qkv(batch=1, length=20, seed=10)
    x = packed(q, k, v)
    block = open_block(sink=1, window=4).eval()
    with torch.no_grad():
        full = block(x)
        state, steps = block.empty_state(1, x.device, x.dtype), []
        for t in range(20):
            out, *state = block.step(x[:, t : t + 1], *state)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-12, atol=1e-12)


def test_general_path_equals_the_eval_path_with_its_state():
    """The rank-masked path (``fast = False``): outputs and carried state equal the tiled
    prefill's."""
    q, k, v = random_qkv(length=40, seed=5)
    x = packed(q, k, v)
    block = open_block(sink=2, window=6)
    with torch.no_grad():
        out_e, state_e = block.eval()(x[:, :23], return_states=True)
        out_e2, state_e2 = block(x[:, 23:], *state_e, return_states=True)
        block.fast = False
        out_g, state_g = block(x[:, :23], return_states=True)
        out_g2, state_g2 = block(x[:, 23:], *state_g, return_states=True)
    for a, b in ((out_g, out_e), (out_g2, out_e2), *zip(state_g, state_e), *zip(state_g2, state_e2)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_padding_leaves_the_state_and_outputs_of_the_real_tokens():
    """Left padding (tiled rows) and a hole (general path): real tokens' outputs and the state are
    those of the sequence without the pads."""
    q, k, v = random_qkv(batch=1, length=16, seed=6)
    x = packed(q, k, v)
    block = open_block().eval()
    filler = torch.randn(1, 4, x.shape[-1], dtype=x.dtype)
    with torch.no_grad():
        out, state = block(x, return_states=True)
        left = torch.cat([filler, x], 1)
        out_l, state_l = block(left, return_states=True, mask=torch.tensor([[0] * 4 + [1] * 16]))
        holed = torch.cat([x[:, :7], filler, x[:, 7:]], 1)
        out_h, state_h = block(holed, return_states=True, mask=torch.tensor([[1] * 7 + [0] * 4 + [1] * 9]))
    torch.testing.assert_close(out_l[:, 4:], out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([out_h[:, :7], out_h[:, 11:]], 1), out, rtol=1e-12, atol=1e-12)
    assert torch.all(out_l[:, :4] == 0) and torch.all(out_h[:, 7:11] == 0)
    for a, b, c in zip(state, state_l, state_h):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(c, a, rtol=1e-12, atol=1e-12)


def test_long_chunks_run_in_sub_chunks_with_the_same_result(monkeypatch):
    import rfkit.models.hybrid

    q, k, v = random_qkv(length=29, seed=8)
    x = packed(q, k, v)
    mask = torch.ones(2, 29, dtype=torch.long)
    mask[1, :6] = 0
    block = open_block()
    with torch.no_grad():
        full, state = general(block, x, return_states=True, mask=mask)
        monkeypatch.setattr(rfkit.models.hybrid, "PREFILL_CHUNK", 4)
        split, split_state = general(block, x, return_states=True, mask=mask)
    torch.testing.assert_close(split, full, rtol=1e-12, atol=1e-12)
    for a, b in zip(split_state, state):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_state_carries_tokens_that_left_the_window():
    q, k, v = random_qkv(batch=1, length=20, seed=6)
    changed = v.clone()
    changed[:, :, 9] += 5.0  # token 9: past the sink (2) and outside the window of the last query
    closed = HybridMambaAttention(KVQ, HD, window=5, sink=2, state_dim=4).double().eval()
    opened = open_block().eval()
    with torch.no_grad():
        for block, should_change in ((closed, False), (opened, True)):
            last = block(packed(q, k, v))[:, -1]
            last_changed = block(packed(q, k, changed))[:, -1]
            assert bool((last - last_changed).abs().max() > 1e-6) == should_change


def test_gradients_reach_every_state_weight():
    q, k, v = random_qkv(batch=2, length=24, seed=7, dtype=torch.float32)
    block = open_block().float().train()
    block(packed(q, k, v)).square().sum().backward()
    for name in ("proj", "dt_weight", "dt_bias", "A_log", "gate"):
        grad = getattr(block, name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


@pytest.mark.parametrize("kvq", [[0, 0, 1, 1], KVQ], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("sink", [0, 2])
@pytest.mark.parametrize("length,drawn", [(45, 7), (45, 3), (5, 7), (5, 2)])
def test_training_runs_tiled_with_the_general_paths_outputs_and_gradients(kvq, sink, length, drawn):
    """A training forward goes through the tiled path at its drawn window (forced here: the full 7
    or shorter, whose queries read the state further on), across tile boundaries and shorter than
    the window: output, next state and the gradients of q, k, v, P, w, b, A_log and the gates
    equal the rank-masked reference's."""
    block = open_block(sink=sink, window=7, kvq=kvq)
    assert block.grouped == (kvq == [0, 0, 1, 1])
    g = torch.Generator().manual_seed(length + sink)
    q, k, v = (torch.randn(2, n, length, HD, generator=g, dtype=torch.float64) for n in (len(kvq), 2, 2))
    tiled, general = train_both_paths(block, q, k, v, window=drawn)
    assert_runs_equal(tiled, general)
    if length > drawn + sink + 1:  # two tokens leave the window (one to age): every weight has a gradient
        assert all(tiled[f"grad.{name}"].abs().sum() > 0 for name, _ in block.named_parameters())


@pytest.mark.parametrize("drawn", [7, 3])
def test_training_carries_the_state_through_pieces_and_left_padding(drawn, monkeypatch):
    """A carried state in and out (the gradient of h too), a chunk longer than PREFILL_CHUNK
    (pieces that carry the state) and left-padded rows: the same training step as the
    reference."""
    block = open_block(sink=2, window=7, kvq=[0, 0, 1, 1])
    g = torch.Generator().manual_seed(30)
    before = (torch.randn(2, n, 13, HD, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    with torch.no_grad():
        _, state = block.eval().attend(*before, return_states=True)
    monkeypatch.setattr(window_module, "PREFILL_CHUNK", 16)
    q, k, v = (torch.randn(2, n, 40, HD, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :9] = 0
    for given in (None, mask):
        tiled, general = train_both_paths(block, q, k, v, state, mask=given, window=drawn)
        assert_runs_equal(tiled, general)
        assert tiled["grad.state.3"].abs().sum() > 0


def test_window_dropout_only_in_training():
    q, k, v = random_qkv(batch=1, length=40, seed=7, dtype=torch.float32)
    x = packed(q, k, v)
    block = HybridMambaAttention(KVQ, HD, window=16, sink=2, state_dim=4, window_dropout=1.0)
    block._generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        evals = [block.eval()(x) for _ in range(2)]
        trains = [block.train()(x) for _ in range(4)]
    torch.testing.assert_close(evals[0], evals[1])
    assert any((t - evals[0]).abs().max() > 1e-4 for t in trains)  # a shorter window changes the output


def test_state_ablation_closes_the_gate_and_restores_it():
    q, k, v = random_qkv(seed=11)
    x = packed(q, k, v)
    block = open_block().eval()
    plain = WindowAttention(KVQ, HD, window=5, sink=2).double()
    gate = block.gate.detach().clone()
    assert block.has_state_ablation
    with torch.no_grad():
        before = block(x)
        with block.state_ablation():
            torch.testing.assert_close(block(x), plain(x), rtol=1e-12, atol=1e-12)
        assert torch.equal(block.gate, gate) and torch.equal(block(x), before)


def test_calibrate_sets_the_key_directions_and_fits_the_gates():
    g = torch.Generator().manual_seed(8)
    k = torch.randn(2, 2, 48, HD, generator=g) * torch.tensor([3.0, 2.0, 1.0, 0.5, 0.2, 0.1, 0.1, 0.1])
    q = k[:, [0, 0, 1]] + 0.1 * torch.randn(2, 3, 48, HD, generator=g)
    v = torch.randn(2, 2, 48, HD, generator=g)
    block = HybridMambaAttention(KVQ, HD, window=4, sink=1, state_dim=3)
    report = block.calibrate(packed(q, k, v))
    for h in range(2):  # orthonormal columns spanning the keys' three principal directions
        keys = k[:, h].reshape(-1, HD).double()
        top = torch.linalg.eigh(keys.T @ keys).eigenvectors[:, -3:]
        P = block.proj[h].detach().double()
        torch.testing.assert_close(P.T @ P, torch.eye(3, dtype=torch.float64), atol=1e-5, rtol=0)
        torch.testing.assert_close(P @ P.T, top @ top.T, atol=1e-5, rtol=0)
        assert (P[:3].abs().sum(0) > 0.9).all()  # the widest axes
    assert all(0.9 < share <= 1 for share in report["key_energy"])
    assert torch.isfinite(block.gate).all() and torch.all(block.gate != 0)
    assert report["gate"] == pytest.approx(block.gate.tolist())
    assert all(0 < share <= 1 for share in report["explained"])


def test_calibrate_fits_the_window_gain_with_the_gates():
    """With ``window_gain`` the gain and the gate of each head are one least-squares fit of the
    full attention: at sink 0, window 1 (the current token's value alone, which full attention
    weighs far below 1) the gains leave 1, and the fit is at least as close as the gate alone."""
    g = torch.Generator().manual_seed(8)
    k = torch.randn(2, 2, 48, HD, generator=g)
    q = k[:, [0, 0, 1]] + 0.1 * torch.randn(2, 3, 48, HD, generator=g)
    v = torch.randn(2, 2, 48, HD, generator=g)
    x = packed(q, k, v)
    fixed = HybridMambaAttention(KVQ, HD, window=1, sink=0, state_dim=3)
    learned = HybridMambaAttention(KVQ, HD, window=1, sink=0, state_dim=3, window_gain=True)
    report_fixed, report = fixed.calibrate(x), learned.calibrate(x)
    assert "window_gain" not in report_fixed and report["window_gain"] == pytest.approx(learned.window_gain.tolist())
    assert all(abs(a - 1) > 0.1 for a in report["window_gain"])
    assert all(b >= a - 1e-9 for a, b in zip(report_fixed["explained"], report["explained"]))
    assert all(0 < share <= 1 for share in report["explained"])
    # the reported share is what the block now computes: 1 - |full - y|^2 / |full - window|^2
    with torch.no_grad():
        qf, kf, vf = (t.double() for t in (q, k, v))
        full = F.scaled_dot_product_attention(qf, kf[:, [0, 0, 1]], vf[:, [0, 0, 1]], is_causal=True)
        y = learned.double().eval()(x.double()).view(2, 48, 3, HD).transpose(1, 2)
        window_only = vf[:, [0, 0, 1]]
        share = 1 - ((full - y) ** 2).sum((0, 2, 3)) / ((full - window_only) ** 2).sum((0, 2, 3))
    assert share.tolist() == pytest.approx(report["explained"], rel=1e-4, abs=1e-6)


def converted(family="llama", operator=None, selected=([0, 1], [2, 3])):
    model = tiny_model(family)
    block_op = operator or HybridMambaOperator(sink=2, window=5, state_dim=4)
    model = to_recurformer(model, [list(s) for s in selected], block_op).eval()
    with torch.no_grad():  # open every gate: the tests below must see the state at work
        for layer in model.model.layers:
            mixer = getattr(layer.self_attn, "mixer", None)
            if mixer is not None:
                mixer.gate.fill_(0.5)
                mixer.dt_bias.fill_(-1.0)
    return model


@pytest.mark.parametrize("granularity", ["kv_group", "query_head"])
def test_converted_model_step_decoding_equals_one_forward(granularity):
    selected = ([0, 1], [2, 3]) if granularity == "kv_group" else ([1], [0, 3])
    model = converted(selected=selected)
    full, steps, cache = prefill_then_steps(model, random_ids(1, 24))
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    states = mixer_state_store(cache)
    assert cache_bytes(cache)["state"] == sum(model.model.layers[i].self_attn.mixer.state_bytes(1) for i in states)


def test_closed_gates_convert_to_the_sink_recent_model():
    model = tiny_model("qwen2")
    ids = random_ids(2, 30)
    operator = HybridMambaOperator(sink=2, window=5, state_dim=4)
    ours = to_recurformer(copy.deepcopy(model), [[0, 1], [2, 3]], operator).eval()
    plain = to_recurformer(copy.deepcopy(model), [[0, 1], [2, 3]], SinkRecentOperator(sink=2, window=5)).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_generate_with_left_padding_matches_unpadded_generation():
    model = converted()
    plain, padded = generate_plain_and_left_padded(model, random_ids(1, 12))
    assert padded[0].tolist() == plain[0].tolist()


def test_saved_model_reloads_with_its_trained_state(tmp_path):
    from transformers import AutoModelForCausalLM

    model = converted("mistral")
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rf_operator["class_path"] == "rfkit.operators.HybridMambaOperator"
    operator = ReplacementOperator.from_dict(loaded.config.rf_operator)
    assert isinstance(operator, HybridMambaOperator) and operator.state_dim == 4
    mixer = loaded.model.layers[0].self_attn.mixer
    assert float(mixer.gate.detach()[0]) == 0.5
    torch.testing.assert_close(mixer.proj, model.model.layers[0].self_attn.mixer.proj, rtol=0, atol=0)
    ids = random_ids(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_transfer_calibrates_and_never_ends_worse_than_it_started():
    from rfkit.training.transfer import TransferConfig, transfer

    operator = HybridMambaOperator(sink=1, window=4, state_dim=4, window_dropout=0.5)
    model = to_recurformer(tiny_model("llama"), [[0, 1], [2, 3]], operator)
    config = TransferConfig(steps=10, lr=1e-2, samples=8, batch_size=4)
    report = transfer(model, random_ids(8, 32, seed=3), config, progress=False)
    assert set(report["calibration"]) == {"0", "1"}
    for layer in ("0", "1"):
        assert report["mse_after"][layer] <= report["mse_before"][layer]
    for i in report["kept_start"]:  # a layer that could not improve is left exactly as built
        assert torch.all(model.model.layers[i].self_attn.mixer.gate == 0)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: HybridMambaOperator(state_dim=0), "model.operator.state_dim"),
        (lambda: HybridMambaOperator(state_dim=2.5), "model.operator.state_dim"),
        (lambda: HybridMambaOperator(window_dropout=1.5), "model.operator.window_dropout"),
        (lambda: HybridMambaOperator(window=0), "model.operator.window"),
        (lambda: HybridMambaOperator(sink=-1), "model.operator.sink"),
        (lambda: HybridMambaOperator(state_dim=16).make_block([0], 8, None), "model.operator.state_dim"),
    ],
)
def test_bad_settings_name_the_field_in_one_line(make, field):
    with pytest.raises(OperatorError, match=field) as raised:
        make()
    assert "\n" not in str(raised.value)


def test_state_bytes_match_the_sink_recent_operator_it_is_compared_with():
    """sink 4 + window 56 + state_dim 16 at head_dim 64 holds exactly the K/V of sink 4 + window 64
    (the hybrid's linear-attention state holds 64 bytes more per KV head)."""
    ours = HybridMambaOperator().make_block([0, 0, 0], 64, None)
    plain = SinkRecentOperator(sink=4, window=64).make_block([0, 0, 0], 64, None)
    hybrid = HybridOperator().make_block([0, 0, 0], 64, None)
    assert ours.state_bytes(1) == plain.state_bytes(1) and hybrid.state_bytes(1) - ours.state_bytes(1) == 16 * 4
    state = ours.empty_state(3, torch.device("cpu"), torch.float32)
    assert sum(t.numel() * t.element_size() for t in state) == ours.state_bytes(3)


def test_the_public_path_and_short_name_build_it():
    from rfkit.conversion.registry import operator

    spec = HybridMambaOperator(state_dim=8).to_dict()
    assert spec == {
        "class_path": "rfkit.operators.HybridMambaOperator",
        "init_args": {"sink": 4, "window": 56, "state_dim": 8, "window_dropout": 0.5},
    }
    assert ReplacementOperator.from_dict(spec).init_args() == spec["init_args"]
    built = operator("hybrid_mamba(window=24, state_dim=8)")
    assert isinstance(built, HybridMambaOperator) and (built.window, built.state_dim) == (24, 8)


@pytest.mark.slow
def test_the_recipe_fits_on_the_tiny_model_and_the_model_reloads(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    """recipes/smollm2_hybrid_mamba_b05.yaml's code paths (calibration, transfer, distillation,
    summary, save) on the tiny model and corpus."""
    import json

    from helpers import ROOT, run_cli, tiny_args
    from transformers import AutoModelForCausalLM

    recipe = str(ROOT / "recipes" / "smollm2_hybrid_mamba_b05.yaml")
    code, out, err = run_cli(["fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path, recipe=recipe)], capsys)
    assert code == 0, err
    summary_path = next(tmp_path.rglob("summary.json"))
    summary = json.loads(summary_path.read_text())
    assert summary["replaced_heads"] == 4 and summary["ppl_converted"] is not None
    model = AutoModelForCausalLM.from_pretrained(str(summary_path.parent / "model"))
    assert model.config.rf_operator["class_path"] == "rfkit.operators.HybridMambaOperator"
    assert any(isinstance(m, HybridMambaAttention) for m in model.modules())


def test_window_gain_is_an_operator_setting_saved_only_when_on():
    assert "window_gain" not in HybridMambaOperator().init_args()
    operator = HybridMambaOperator(sink=0, window=1, state_dim=4, window_gain=True)
    assert operator.init_args()["window_gain"] is True
    assert ReplacementOperator.from_dict(operator.to_dict()).window_gain is True
    assert operator.make_block([0, 0, 1], HD, None).window_gain is not None
    assert HybridMambaOperator(state_dim=4).make_block([0, 0, 1], HD, None).window_gain is None
    with pytest.raises(OperatorError, match="model.operator.window_gain: 'yes' is not allowed; must be true or false"):
        HybridMambaOperator(window_gain="yes")


@pytest.mark.parametrize("sink,window,state_dim", [(0, 1, 38), (4, 8, 16)])
def test_the_mamba_from_attention_settings_hold_the_papers_mamba_bytes(sink, window, state_dim):
    """docs/mamba_recipe.md compares the S6 state started from attention with the paper's Mamba
    block (d_state 16, expand 2, d_conv 4) at the same cache: per replaced KV head of width 64 in
    float32, both settings hold the paper's block's bytes, plus the window's 8-byte token count."""
    from rfkit.operators import MambaOperator

    paper = MambaOperator().build(64, 3 * 64, 0).state_bytes(1, torch.float32)
    ours = HybridMambaAttention([0, 0, 0], 64, window=window, sink=sink, state_dim=state_dim)
    assert paper == 64 * 2 * (16 + 4) * 4 == 10_240
    assert ours.state_bytes(1, torch.float32) == paper + 8
