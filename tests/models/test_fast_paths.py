"""The window mixers' inference paths (one-token step over a ring buffer, tiled prefill) against
the general rank-masked path and a naive masked attention with the recurrence written out, in
float64: across tile, window and prefill-piece boundaries, with left padding, for the hybrid with
its gate open and closed, with a state decay, and without a sink."""

from __future__ import annotations

import pytest
import torch
from helpers import converted_tiny, left_padded_ids, random_ids, tiny_model

import rfkit.models.window as window_module
from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridOperator, SinkRecentOperator
from rfkit.models.window import WindowAttention

KVQ = [0, 0, 1, 1]  # grouped GQA: two query heads per KV head
HD, W = 8, 7


def block(kind: str, sink: int, kvq=KVQ, features: int = 4) -> WindowAttention:
    if kind == "window":
        return WindowAttention(kvq, HD, window=W, sink=sink).double().eval()
    decay = 3.0 if kind == "hybrid_decay" else None
    sharp = 1.5 if kind == "hybrid_decay" else 1.0  # the decayed block is a sharper one too
    b = HybridWindowAttention(kvq, HD, window=W, sink=sink, feature_dim=features, decay_horizon=decay, sharpness=sharp)
    b = b.double().eval()
    if kind in ("hybrid_open", "hybrid_decay"):
        with torch.no_grad():
            b.gate.copy_(torch.linspace(0.3, 1.2, len(kvq), dtype=torch.float64))
            b.gate[1] = 0.0  # one closed head beside open ones
            b.log_scale.copy_(torch.linspace(-0.4, 0.6, len(kvq), dtype=torch.float64))
            if decay is not None:  # a different horizon per KV head: 2 and 9 tokens
                b.log_horizon.copy_(torch.log(torch.tensor([2.0, 9.0][: b.num_kv_heads], dtype=torch.float64)))
    return b


def qkv(B: int, L: int, kvq=KVQ, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hkv = max(kvq) + 1
    make = lambda h: torch.randn(B, h, L, HD, generator=g, dtype=torch.float64)  # noqa: E731
    return make(len(kvq)), make(hkv), make(hkv)


def masked_reference(b: WindowAttention, q, k, v) -> torch.Tensor:
    """Full L x L matrices: softmax over sink + window, and for the hybrid the old tokens'
    ``g e^{-tau m} phi(q).phi(k)`` under the same normaliser (the module docstring's formula)."""
    L = q.shape[2]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    causal = j <= i
    win = causal & ((i - j < b.window) | (j < b.sink))
    old = causal & ~win
    idx = torch.tensor(b.kv_for_query)
    kq, vq = k.index_select(1, idx), v.index_select(1, idx)
    scores = (q @ kq.transpose(-1, -2)) * b.scaling
    m = scores.masked_fill(~win, float("-inf")).amax(-1, keepdim=True)
    p = torch.exp(scores - m).masked_fill(~win, 0)
    num, den = p @ vq, p.sum(-1, keepdim=True)
    if isinstance(b, HybridWindowAttention):
        maps = b.feature_map.index_select(0, idx)[None]  # (1, Hq, hd, f/2)

        def phi(x):
            proj = x @ maps
            return torch.cat([proj.softmax(-1), (-proj).softmax(-1)], -1)

        lin = (phi(q) @ phi(kq).transpose(-1, -2)).masked_fill(~old, 0)
        if b.log_horizon is not None:  # a token that left the window a steps ago weighs gamma^a
            gamma = torch.exp(-1 / b.log_horizon.detach().exp()).index_select(0, idx)
            lin = lin * gamma[None, :, None, None] ** (i - b.window - j).clamp_min(0)
        c = b.old_weight().detach()[None, :, None, None] * torch.exp(-b.sharpness * m.clamp_min(-60.0))
        num, den = num + c * (lin @ vq), den + c * lin.sum(-1, keepdim=True)
    y = num / den
    return y.transpose(1, 2).reshape(q.shape[0], L, -1)


KINDS = ["window", "hybrid_open", "hybrid_closed", "hybrid_decay"]
# the kernel has its own code for 16 features (the default) and general code (4 here); plain
# window attention has no feature map
KIND_FEATURES = [("window", 0)] + [(kind, f) for kind in KINDS[1:] for f in (4, 16)]
LENGTHS = [W - 1, W, W + 1, 2 * W + 3, 1025]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_tiled_prefill_and_steps_match_the_masked_reference(kind, sink, length, monkeypatch):
    b = block(kind, sink)
    q, k, v = qkv(2, length, seed=length + sink)
    want = masked_reference(b, q, k, v)
    with torch.no_grad():
        full, state = b.attend(q, k, v, return_states=True)
        torch.testing.assert_close(full, want, rtol=1e-10, atol=1e-10)
        # the general path leaves the same state
        _, general_state = b._general(q, k, v, (), None, b.window, True)
        for got, expected in zip(state, general_state):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        # many small pieces and tiles, carrying the state, give the one-piece result
        monkeypatch.setattr(window_module, "PREFILL_CHUNK", 5)
        monkeypatch.setattr(window_module, "TILE", 3)
        import rfkit.models.hybrid

        monkeypatch.setattr(rfkit.models.hybrid, "TILE", 3)
        pieces, piece_state = b.attend(q, k, v, return_states=True)
        torch.testing.assert_close(pieces, full, rtol=1e-10, atol=1e-10)
        for got, expected in zip(piece_state, state):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        monkeypatch.undo()
        # a prefill, then one token at a time (the last 40 at most)
        cut = max(0, length - 40) if length > 40 else length // 2
        if cut:
            out, st = b.attend(*(t[:, :, :cut] for t in (q, k, v)), return_states=True)
            outs = [out]
        else:
            st, outs = b.empty_state(2, q.device, q.dtype), []
        for t in range(cut, length):
            out, *st = b.step_qkv(*(x[:, :, t : t + 1] for x in (q, k, v)), *st)
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
        for got, expected in zip(st, state):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_rows_match_the_unpadded_prompt_then_decode_together(kind):
    """Row 1 is left padded by 5: its outputs and state are those of its real tokens alone, and
    the batch then decodes in step with per-row counts (not the steady-state fast case)."""
    b = block(kind, sink=2)
    q, k, v = qkv(2, 2 * W + 3, seed=9)
    mask = torch.ones(2, q.shape[2], dtype=torch.long)
    mask[1, :5] = 0
    tail = qkv(2, 2 * W, seed=10)
    with torch.no_grad():
        out, state = b.attend(q, k, v, return_states=True, mask=mask)
        for row, pad in ((0, 0), (1, 5)):
            alone, alone_state = b.attend(*(t[row : row + 1, :, pad:] for t in (q, k, v)), return_states=True)
            torch.testing.assert_close(out[row : row + 1, pad:], alone, rtol=1e-10, atol=1e-10)
            for got, expected in zip(state, alone_state):
                torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-10, atol=1e-10)
        assert torch.all(out[1, :5] == 0)
        assert state[2].tolist() == [2 * W + 3, 2 * W - 2]
        general_state = b._general(q, k, v, (), mask, b.window, True)[1]
        st = [t.clone() for t in state]
        for t in range(tail[0].shape[2]):
            one = [x[:, :, t : t + 1] for x in tail]
            got, *st = b.step_qkv(*one, *st)
            want, general_state = b._general(*one, general_state, None, b.window, True)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for got, expected in zip(st, general_state):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["hybrid_open", "hybrid_decay"])
def test_uneven_query_groups_take_the_same_paths(kind):
    """Query heads not evenly grouped over KV heads (kv_for_query [0, 0, 1]): keys are gathered per
    query head, with the same results."""
    kvq = [0, 0, 1]
    b = block(kind, sink=2, kvq=kvq)
    q, k, v = qkv(1, 40, kvq=kvq, seed=3)
    with torch.no_grad():
        full, state = b.attend(q, k, v, return_states=True)
        torch.testing.assert_close(full, masked_reference(b, q, k, v), rtol=1e-10, atol=1e-10)
        out, *state = b.step_qkv(*qkv(1, 1, kvq=kvq, seed=4), *state)
        q2, k2, v2 = (torch.cat([a, c], 2) for a, c in zip((q, k, v), qkv(1, 1, kvq=kvq, seed=4)))
        torch.testing.assert_close(out, masked_reference(b, q2, k2, v2)[:, -1:], rtol=1e-10, atol=1e-10)


def test_the_step_writes_its_state_in_place():
    """A decode step allocates no new state: the same tensors come back, updated."""
    b = block("hybrid_open", sink=2)
    q, k, v = qkv(1, 3 * W, seed=5)
    with torch.no_grad():
        _, state = b.attend(q, k, v, return_states=True)
        pointers = [t.data_ptr() for t in state]
        _, *after = b.step_qkv(*qkv(1, 1, seed=6), *state)
    assert [t.data_ptr() for t in after] == pointers
    assert after[2].tolist() == [3 * W + 1]


@pytest.mark.parametrize("operator", [HybridOperator(sink=2, window=5, feature_dim=4), SinkRecentOperator(sink=2, window=5)])
def test_generate_is_identical_through_the_general_path(operator, monkeypatch):
    """Greedy tokens of ``generate`` (left-padded batch) equal those of the general path."""
    model = converted_tiny(operator)
    ids, mask = left_padded_ids()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    fast = model.generate(ids, **kwargs)
    logits_fast = model(ids, attention_mask=mask).logits
    monkeypatch.setattr(WindowAttention, "fast", False)
    general = model.generate(ids, **kwargs)
    logits_general = model(ids, attention_mask=mask).logits
    assert torch.equal(fast, general)
    torch.testing.assert_close(logits_fast[mask.bool()], logits_general[mask.bool()], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kind, features", KIND_FEATURES)
def test_compiled_step_matches_the_pytorch_step(kind, features, sink, monkeypatch):
    """float32 on CPU decodes through rfkit/ops/kernels/window_cpu.c: the same outputs and state
    as the PyTorch step, from an empty state (sink and ring filling up) and from a left-padded
    prefill (rows at different counts), for 3 W tokens."""
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    b = block(kind, sink, features=features).float()
    q, k, v = (t.float() for t in qkv(2, 2 * W + 3, seed=11))
    mask = torch.ones(2, q.shape[2], dtype=torch.long)
    mask[1, :4] = 0
    steps = [tuple(t.float() for t in qkv(2, 1, seed=20 + i)) for i in range(3 * W)]
    calls = []
    compiled = cpu_kernels.window_step_planned
    monkeypatch.setattr(cpu_kernels, "window_step_planned", lambda *a: calls.append(1) or compiled(*a))
    with torch.no_grad():
        for start in ("empty", "padded"):
            if start == "empty":
                state = b.empty_state(2, q.device, torch.float32)
            else:
                state = b.attend(q, k, v, return_states=True, mask=mask)[1]
            mine, theirs = [t.clone() for t in state], [t.clone() for t in state]
            for one in steps:
                monkeypatch.setattr(WindowAttention, "use_kernel", True)
                got, *mine = b.step_qkv(*one, *mine)
                monkeypatch.setattr(WindowAttention, "use_kernel", False)
                want, *theirs = b.step_qkv(*one, *theirs)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for a, c in zip(mine, theirs):
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * len(steps)  # every kernel-side step ran the compiled code


def kernel_block(kind: str, head_dim: int, sink: int, features: int) -> WindowAttention:
    """A window or hybrid block for the compiled-kernel tests; ``hybrid_open`` and ``hybrid_decay``
    with their gates open (and a decay horizon and a sharpness of 1.5 for the latter)."""
    if kind == "window":
        return WindowAttention(KVQ, head_dim, window=W, sink=sink).eval()
    decay = 5.0 if kind == "hybrid_decay" else None
    sharp = 1.5 if kind == "hybrid_decay" else 1.0
    b = HybridWindowAttention(KVQ, head_dim, window=W, sink=sink, feature_dim=features, decay_horizon=decay, sharpness=sharp)
    b = b.eval()
    if kind in ("hybrid_open", "hybrid_decay"):
        with torch.no_grad():
            b.gate.copy_(torch.tensor([0.5, 0.0, 1.0, 0.8]))
            b.log_scale.copy_(torch.tensor([0.2, -0.3, 0.0, 0.4]))
    return b


@pytest.mark.parametrize("head_dim", [HD, 10, 64, 128])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kind, features", KIND_FEATURES)
def test_compiled_prefill_matches_the_pytorch_prefill(kind, features, sink, length, head_dim, monkeypatch):
    """float32 prefill on CPU runs through the compiled kernel (head widths 64 and 128 have their
    own code, and so does the feature map of 16 features; width 10 is not a multiple of its 4
    accumulators): the same outputs and state as the PyTorch tiled prefill, in one piece,
    continued from a state, and left padded."""
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    b = kernel_block(kind, head_dim, sink, features)
    g = torch.Generator().manual_seed(length)
    q = torch.randn(2, len(KVQ), length, head_dim, generator=g)
    k, v = (torch.randn(2, 2, length, head_dim, generator=g) for _ in range(2))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, : length // 3] = 0
    cut = length // 2
    calls = []
    compiled = cpu_kernels.window_prefill_cpu
    monkeypatch.setattr(cpu_kernels, "window_prefill_cpu", lambda *a: calls.append(1) or compiled(*a))

    def run():
        whole = b.attend(q, k, v, return_states=True)
        first = b.attend(*(t[:, :, :cut] for t in (q, k, v)), return_states=True) if cut else (None, ())
        rest = b.attend(*(t[:, :, cut:] for t in (q, k, v)), *first[1], return_states=True)
        padded = b.attend(q, k, v, return_states=True, mask=mask)
        return [whole[0], rest[0], padded[0], *whole[1], *rest[1], *padded[1]]

    with torch.no_grad():
        monkeypatch.setattr(WindowAttention, "use_kernel", False)
        want = run()
        assert not calls
        monkeypatch.setattr(WindowAttention, "use_kernel", True)
        got = run()
    assert calls  # the compiled prefill ran
    for a, c in zip(got, want):  # float32 sums over up to 1,025 tokens in another order
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kind, features", KIND_FEATURES)
def test_compiled_prefill_of_bf16_activations_matches_the_pytorch_bf16_prefill(kind, features, sink, monkeypatch):
    """A bf16 model's prefill (bf16 activations and window K/V, float32 sums) runs the compiled
    kernel in the mixer's float32 compute dtype (the chunk and the state converted once per call,
    the K/V rounded back to bf16 as the PyTorch path rounds them): whole, continued from a state
    and left padded, the PyTorch bf16 prefill's outputs to within one bf16 rounding, the window's
    K/V bit for bit, the sums to float32 rounding."""
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    b = kernel_block(kind, HD, sink, features)
    g = torch.Generator().manual_seed(sink)
    length, cut = 150, 70
    q = torch.randn(2, len(KVQ), length, HD, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, length, HD, generator=g, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, : length // 3] = 0
    calls = []
    compiled = cpu_kernels.window_prefill_cpu
    monkeypatch.setattr(cpu_kernels, "window_prefill_cpu", lambda *a: calls.append(1) or compiled(*a))

    def run():
        whole = b.attend(q, k, v, return_states=True)
        first = b.attend(*(t[:, :, :cut] for t in (q, k, v)), return_states=True)
        rest = b.attend(*(t[:, :, cut:] for t in (q, k, v)), *first[1], return_states=True)
        padded = b.attend(q, k, v, return_states=True, mask=mask)
        return [whole[0], rest[0], padded[0]], [*whole[1], *rest[1], *padded[1]]

    with torch.no_grad():
        monkeypatch.setattr(WindowAttention, "use_kernel", False)
        want, want_states = run()
        assert not calls
        monkeypatch.setattr(WindowAttention, "use_kernel", True)
        got, got_states = run()
    assert len(calls) == 5  # whole, first, rest and the padded batch's two rows: all compiled
    for a, c in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, c, rtol=2**-7, atol=1e-4)  # one bf16 rounding of float32 sums in another order
    for a, c in zip(got_states, want_states):
        assert a.dtype == c.dtype
        if a.dtype == torch.bfloat16 or not a.is_floating_point():  # the window's K/V and the count
            bits = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # noqa: E731
            assert torch.equal(bits(a), bits(c))
        else:
            assert a.dtype == torch.float32  # the sums
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_prefill_jobs_split_rows_or_cut_the_chunk_into_pieces_of_equal_cost():
    from rfkit.ops.cpu_kernels import MIN_PIECE_TOKENS, prefill_jobs

    assert prefill_jobs(4, 2048, 2, 10.0, 1.0) == [(0, 2, 0, 2048), (2, 4, 0, 2048)]  # rows split evenly
    three = prefill_jobs(3, 2048, 2, 10.0, 1.0)  # rows 2 + 1 would leave a thread idle a third of the time
    assert [j[:2] for j in three] == [(0, 3), (0, 3)] and three[0][3] > 1024
    assert prefill_jobs(1, 2 * MIN_PIECE_TOKENS - 1, 2, 10.0, 1.0) == [(0, 1, 0, 2 * MIN_PIECE_TOKENS - 1)]  # too short
    assert prefill_jobs(1, 2048, 2, 10.0, 0.0) == [(0, 1, 0, 1024), (0, 1, 1024, 2048)]  # nothing to fold: halves
    for rows, threads, fold in [(1, 2, 1.0), (1, 4, 2.5), (2, 3, 1.0), (1, 16, 1.0)]:
        jobs = prefill_jobs(rows, 4096, threads, 10.0, fold)
        assert [j[:2] for j in jobs] == [(0, rows)] * len(jobs) and len(jobs) == min(threads, 4096 // MIN_PIECE_TOKENS)
        assert jobs[0][2] == 0 and jobs[-1][3] == 4096 and all(a[3] == b[2] for a, b in zip(jobs, jobs[1:]))
        cost = [i0 * fold + (i1 - i0) * 10.0 for _, _, i0, i1 in jobs]  # a piece folds what comes before it
        assert max(cost) - min(cost) <= 2 * 10.0 + fold, cost  # equal up to rounding a boundary


@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "python-threads"])
@pytest.mark.parametrize("threads", [3, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_prefill_cut_into_pieces_matches_the_pytorch_prefill(kind, threads, openmp, monkeypatch):
    features = 16 if threads == 4 else 4  # the default's feature map and the general one
    """With fewer rows (batch x KV heads) than threads, the compiled prefill cuts the chunk into
    pieces, each folding the tokens before it into a copy of the state: the same outputs and
    state as the PyTorch prefill, from an empty state and continued from one; with the jobs on
    OpenMP threads (this machine's build) and on Python threads (a build without OpenMP)."""
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    if openmp and not cpu_kernels.openmp():
        pytest.fail("the CPU kernels were built without OpenMP on a machine whose compiler has it")
    monkeypatch.setitem(cpu_kernels._state, "openmp", openmp)
    if kind == "window":
        b = WindowAttention(KVQ, HD, window=W, sink=3).eval()
    else:
        decayed = kind == "hybrid_decay"
        b = HybridWindowAttention(
            KVQ, HD, window=W, sink=3, feature_dim=features, decay_horizon=5.0 if decayed else None, sharpness=1.5 if decayed else 1.0
        ).eval()
        if kind != "hybrid_closed":
            with torch.no_grad():
                b.gate.copy_(torch.tensor([0.5, 0.0, 1.0, 0.8]))
    g = torch.Generator().manual_seed(threads)
    length, cut = 700, 300
    q = torch.randn(1, len(KVQ), length, HD, generator=g)
    k, v = (torch.randn(1, 2, length, HD, generator=g) for _ in range(2))
    jobs = []
    real_jobs = cpu_kernels.prefill_jobs
    monkeypatch.setattr(cpu_kernels, "prefill_jobs", lambda *a: jobs.append(real_jobs(*a)) or jobs[-1])

    def run():
        whole = b.attend(q, k, v, return_states=True)
        first = b.attend(*(t[:, :, :cut] for t in (q, k, v)), return_states=True)
        rest = b.attend(*(t[:, :, cut:] for t in (q, k, v)), *first[1], return_states=True)
        return [whole[0], rest[0], *whole[1], *rest[1]]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            monkeypatch.setattr(WindowAttention, "use_kernel", False)
            want = run()
            monkeypatch.setattr(WindowAttention, "use_kernel", True)
            got = run()
    finally:
        torch.set_num_threads(before)
    assert [len(j) for j in jobs] == [min(threads, n // cpu_kernels.MIN_PIECE_TOKENS) for n in (length, cut, length - cut)]
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def test_uneven_kept_groups_attend_per_run_of_equal_groups_without_copying_the_cache(monkeypatch):
    """Head-level selection leaves KV heads with different numbers of kept query heads: attention
    runs once per run of equal group sizes on slices of the cache (no index_select per query
    head), and the converted model with a window longer than the input is still the original."""
    from rfkit.models.layout import group_runs
    from rfkit.models.modeling import RecurFormerAttention

    assert group_runs([3, 3, 1, 2, 2]) == [((0, 6), (0, 2), 3), ((6, 7), (2, 3), 1), ((7, 11), (3, 5), 2)]
    original = tiny_model("llama", num_heads=4, num_kv_heads=2)
    import copy

    model = to_recurformer(copy.deepcopy(original), [[1], [0, 3]], SinkRecentOperator(sink=0, window=64)).eval()
    layer = model.model.layers[0].self_attn
    assert isinstance(layer, RecurFormerAttention) and layer._group_runs == [((0, 1), (0, 1), 1), ((1, 3), (1, 2), 2)]
    copies = []
    real_index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda t, *a: copies.append(t.shape) or real_index_select(t, *a))
    ids = random_ids(2, 24)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)
        out = model(ids[:, :20], use_cache=True)
        step = model(ids[:, 20:21], past_key_values=out.past_key_values, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], original(ids[:, :21]).logits[:, -1], rtol=1e-4, atol=1e-4)
    assert not [shape for shape in copies if len(shape) == 4 and shape[2] >= 20]  # no cache-sized gather


class _Unread(torch.Tensor):
    """A tensor whose value must not reach the host: reading it is what a device sync would be."""

    def _read(self, *args):
        raise AssertionError("the row counts were read on the host")

    __bool__ = __int__ = __index__ = __float__ = item = tolist = _read


@pytest.mark.parametrize("kind", ["window", "hybrid_open"])
def test_a_forward_from_a_fresh_state_never_reads_the_row_counts(kind, monkeypatch):
    """Every training forward (and a first prefill) starts from a fresh state, whose rows have seen
    nothing: the tiled path takes that as known instead of reading the counts back from the device
    (a sync per layer per forward on a GPU). A state that has seen tokens is read, as it must be."""
    b = block(kind, sink=2)
    empty = type(b).empty_state

    def unread_counts(self, *args):
        state = empty(self, *args)
        return (*state[:2], state[2].as_subclass(_Unread), *state[3:])

    monkeypatch.setattr(type(b), "empty_state", unread_counts)
    monkeypatch.setattr(WindowAttention, "use_kernel", False)  # the tiles a GPU runs
    q, k, v = qkv(2, 40)
    y, state = b.attend(q, k, v, return_states=True)
    torch.testing.assert_close(y, masked_reference(b, q, k, v), rtol=1e-9, atol=1e-9)
    with pytest.raises(AssertionError, match="read on the host"):
        b.attend(q, k, v, *state)  # a state that has seen tokens: its counts decide the path
