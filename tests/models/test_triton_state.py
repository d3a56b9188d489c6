"""The hybrid's state part through the Triton kernels (``state_backend = "triton"``,
rfkit.ops.triton_state), on the CPU under Triton's interpreter (``CPU_INTERPRET``, off for users):
the kernels against a naive decayed linear attention in float64 (output and every gradient, the
decay's included), and the hybrid through them against its PyTorch chunks: prefill chunks that
carry the state, a training forward and backward at a drawn shorter window, GQA and per-head
groups, with and without decay, a converted model's decoding; and where they must not serve
(float64, a feature size the kernels do not take, a CPU without the interpreter, an interpreter
that cannot run them, an unknown backend; the CLI's refusal is in tests/cli/test_bad_inputs.py). And the kernels compiled for the
lent GPUs' architecture, without one."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from helpers import converted_tiny, decode_alike_on_two_backends
from test_fast_paths import block, qkv

from rfkit.errors import RFKitError
from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.operators import HybridOperator
from rfkit.models.window import WindowAttention
from rfkit.ops import triton_state, triton_state_kernels

PER_HEAD = [1, 0, 0, 1]  # query heads whose KV heads are not in grouped order: every head its own group


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """The kernels under Triton's interpreter on the CPU (``CPU_INTERPRET``, off for users), and the
    PyTorch tiles instead of the compiled CPU prefill and training kernels."""
    monkeypatch.setattr(triton_state, "CPU_INTERPRET", True)
    monkeypatch.setattr(WindowAttention, "use_kernel", False)


def rel_err(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def naive(q, k, v, S0, lam):
    """``o_i = gamma^(i+1) q_i S0 + sum_{t <= i} gamma^(i-t) (q_i . k_t) v_t``, as full L x L matrices."""
    G, L = q.shape[1], q.shape[3]
    i = torch.arange(L, dtype=q.dtype)
    lag = i[:, None] - i[None, :]
    decay = torch.exp(lam.view(G, 1, 1) * lag.clamp_min(0)) * (lag >= 0)  # (G, L, L)
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * decay[None, :, None]
    start = torch.exp(lam.view(G, 1, 1) * (i + 1)[:, None])[None, :, None]  # (1, G, 1, L, 1)
    return scores @ v.unsqueeze(2) + start * (q @ S0.unsqueeze(2))


@pytest.mark.parametrize(
    "B,G,R,L,F,D,decay",
    [
        (1, 2, 3, 150, 16, 65, True),  # SmolLM2's group of 3, head_dim 64 + the normaliser, three chunks
        (2, 3, 1, 64, 16, 17, False),  # exactly one chunk, no decay
        (1, 1, 2, 9, 32, 8, True),  # shorter than tl.dot's 16 rows, narrower than a slice of D
    ],
)
def test_the_kernels_match_a_naive_decayed_linear_attention(B, G, R, L, F, D, decay):
    g = torch.Generator().manual_seed(L)
    q, k = torch.rand(B, G, R, L, F, generator=g, dtype=torch.float64), torch.rand(B, G, L, F, generator=g, dtype=torch.float64)
    v, S0 = torch.randn(B, G, L, D, generator=g, dtype=torch.float64), torch.randn(B, G, F, D, generator=g, dtype=torch.float64)
    lam = -0.05 * torch.rand(G, generator=g, dtype=torch.float64) if decay else torch.zeros(G, dtype=torch.float64)
    want_in = [t.clone().requires_grad_() for t in (q, k, v, S0, lam)]
    got_in = [t.float().requires_grad_() for t in (q, k, v, S0, lam)]
    want = naive(*want_in)
    before = triton_state.served
    got = triton_state.decayed_linear_state(*got_in)
    assert triton_state.served == before + 1 and got.dtype == torch.float32
    grad_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want.backward(grad_out)
    got.backward(grad_out.float())
    assert rel_err(got, want) < 1e-6
    for name, a, b in zip(("q", "k", "v", "S0", "log_gamma"), got_in, want_in):
        assert a.grad.dtype == torch.float32 and rel_err(a.grad, b.grad) < 1e-5, name


def _hybrid(kind: str, sink: int, kvq) -> HybridWindowAttention:
    """The blocks of test_fast_paths with 16 features (the kernels' smallest), in float32; the
    decayed one read at sharpness 1 (the sharpness changes the mix, not the state part)."""
    b = block(kind, sink, kvq, features=16).float()
    b.sharpness = 1.0
    return b


def _prefill(b, backend: str, chunks, monkeypatch):
    monkeypatch.setattr(HybridWindowAttention, "state_backend", backend)
    state, outs = (), []
    with torch.no_grad():
        for q, k, v in chunks:
            y, state = b.attend(q, k, v, *state, return_states=True)
            outs.append(y)
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("kind", ["hybrid_open", "hybrid_decay"])
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kvq", [[0, 0, 1, 1], PER_HEAD], ids=["gqa", "per_head"])
def test_prefill_chunks_through_triton_match_the_pytorch_chunks(kind, sink, kvq, monkeypatch):
    """Chunks of 2 (inside the sink), 19 and 70 tokens (two of the kernels' chunks): the same
    outputs and the same state after each, in float32."""
    b = _hybrid(kind, sink, kvq)
    q, k, v = (t.float() for t in qkv(2, 91, kvq, seed=7))
    chunks = [tuple(t[:, :, a:c] for t in (q, k, v)) for a, c in ((0, 2), (2, 21), (21, 91))]
    before = triton_state.served
    y_triton, s_triton = _prefill(b, "triton", chunks, monkeypatch)
    assert triton_state.served - before == 3, "the kernels served every chunk"
    y_torch, s_torch = _prefill(b, "torch", chunks, monkeypatch)
    assert triton_state.served - before == 3
    assert rel_err(y_triton, y_torch) < 1e-5
    for a, c in zip(s_triton, s_torch):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kvq", [[0, 0, 1, 1], PER_HEAD], ids=["gqa", "per_head"])
def test_a_training_pass_through_triton_matches_the_pytorch_chunks(kvq, monkeypatch):
    """Training mode at a drawn window shorter than the block's (the ring's oldest keys folded into
    the starting state, so the state's gradient flows too), with decay: the output and every
    gradient (queries, keys, values, feature maps, gate, scale, horizon) agree."""
    b = _hybrid("hybrid_decay", 2, kvq).train()
    b._batch_window = 3  # of W = 6: the drawn window of this batch
    results = {}
    for backend in ("triton", "torch"):
        monkeypatch.setattr(HybridWindowAttention, "state_backend", backend)
        b.zero_grad(set_to_none=True)
        q, k, v = (t.float().requires_grad_() for t in qkv(2, 80, kvq, seed=3))
        before = triton_state.served
        y = b.attend(q, k, v)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grads = {"q": q.grad, "k": k.grad, "v": v.grad, **{n: p.grad for n, p in b.named_parameters()}}
        results[backend] = (y.detach(), grads, triton_state.served - before)
    (y_t, g_t, calls), (y_p, g_p, none) = results["triton"], results["torch"]
    assert calls == 1 and none == 0
    assert rel_err(y_t, y_p) < 1e-5
    assert all(g is not None for g in g_p.values()) and sorted(g_t) == sorted(g_p)
    for name in g_p:
        assert rel_err(g_t[name], g_p[name]) < 1e-4, name


def test_the_kernels_do_not_serve_where_they_cannot(monkeypatch, caplog):
    """float64 (the kernels are float32), a feature size they do not take (one warning), a CPU
    without the interpreter (one warning, as for users): the PyTorch chunks, the same output."""
    monkeypatch.setattr(HybridWindowAttention, "state_backend", "triton")
    monkeypatch.setattr(triton_state, "_told", set())
    q, k, v = qkv(1, 30, [0, 0, 1, 1])
    before = triton_state.served
    with torch.no_grad():
        block("hybrid_open", 2, features=16).attend(q, k, v)  # float64
        narrow = block("hybrid_open", 2).float()  # 4 features
        with caplog.at_level("WARNING", logger="rfkit.ops.triton_state"):
            narrow.attend(q.float(), k.float(), v.float())
            narrow.attend(q.float(), k.float(), v.float())
            monkeypatch.setattr(triton_state, "CPU_INTERPRET", False)
            wide = _hybrid("hybrid_open", 2, [0, 0, 1, 1])
            y_cpu = wide.attend(q.float(), k.float(), v.float())
    assert triton_state.served == before
    assert [r.getMessage() for r in caplog.records] == [
        "RFKIT_STATE_BACKEND=triton: the kernels take 16, 32, 64 or 128 features, not 4; the hybrid's state part stays on PyTorch",
        "RFKIT_STATE_BACKEND=triton: the Triton kernels serve CUDA devices; the hybrid's state part stays on PyTorch on cpu",
    ]
    monkeypatch.setattr(HybridWindowAttention, "state_backend", "torch")
    with torch.no_grad():
        torch.testing.assert_close(y_cpu, wide.attend(q.float(), k.float(), v.float()), rtol=0, atol=0)


def _probe_that_never_loops(x_ptr, N):
    i = tl.arange(0, 2)
    tl.store(x_ptr + i, tl.load(x_ptr + i))


def _probe_that_fails(x_ptr, N):
    raise TypeError("only 0-dimensional arrays can be converted to Python scalars")  # Triton 3.6 under NumPy 2.5


def test_an_interpreter_that_cannot_run_the_kernels_is_named_and_the_twin_stays_on_pytorch(monkeypatch, caplog):
    """The interpreter here loops to a bound given at run time, as the kernels do: no problem. One that
    cannot (Triton 3.6 under NumPy 2.5, the GPU image's pair, which the rehearsal in the image's versions
    meets) is named with its versions, once, and the CPU twin keeps the PyTorch chunks."""
    monkeypatch.setattr(triton_state, "_PROBED", {})
    assert triton_state.interpreter_problem() is None
    monkeypatch.setattr(triton_state_kernels, "probe", _probe_that_never_loops)
    assert triton_state.interpreter_problem() is None  # asked once per process
    monkeypatch.setattr(triton_state, "_PROBED", {})
    assert triton_state.interpreter_problem().endswith("'s interpreter counted [0.0, 0.0] in a loop to 3")
    monkeypatch.setattr(triton_state, "_PROBED", {})
    monkeypatch.setattr(triton_state_kernels, "probe", _probe_that_fails)
    problem = triton_state.interpreter_problem()
    assert problem.startswith("Triton ") and ", NumPy " in problem
    assert problem.endswith(": InterpreterError: TypeError('only 0-dimensional arrays can be converted to Python scalars')")

    monkeypatch.setattr(HybridWindowAttention, "state_backend", "triton")
    monkeypatch.setattr(triton_state, "_told", set())
    q, k, v = qkv(1, 30, [0, 0, 1, 1])
    wide = _hybrid("hybrid_open", 2, [0, 0, 1, 1])
    before = triton_state.served
    with torch.no_grad(), caplog.at_level("WARNING", logger="rfkit.ops.triton_state"):
        y = wide.attend(q.float(), k.float(), v.float())
        wide.attend(q.float(), k.float(), v.float())
    assert triton_state.served == before
    assert [r.getMessage() for r in caplog.records] == [
        f"RFKIT_STATE_BACKEND=triton: Triton's interpreter cannot run the kernels here ({problem}); "
        "the hybrid's state part stays on PyTorch"
    ]
    monkeypatch.setattr(HybridWindowAttention, "state_backend", "torch")
    with torch.no_grad():
        torch.testing.assert_close(y, wide.attend(q.float(), k.float(), v.float()), rtol=0, atol=0)


def test_an_unknown_state_backend_is_one_line_naming_the_field(monkeypatch):
    monkeypatch.setattr(HybridWindowAttention, "state_backend", "flex")
    b = _hybrid("hybrid_open", 2, [0, 0, 1, 1])
    q, k, v = (t.float() for t in qkv(1, 5, [0, 0, 1, 1]))
    with pytest.raises(RFKitError, match=r"^HybridWindowAttention.state_backend: 'flex' is not allowed; allowed: torch, triton$"):
        b.attend(q, k, v)
    monkeypatch.setattr(HybridWindowAttention, "state_backend", None)
    monkeypatch.setenv(triton_state.ENV, "cuda")
    with pytest.raises(RFKitError, match=r"^RFKIT_STATE_BACKEND: 'cuda' is not allowed; allowed: torch, triton$"):
        b.attend(q, k, v)
    monkeypatch.setenv(triton_state.ENV, "triton")
    assert triton_state.resolve(None) == "triton"
    monkeypatch.delenv(triton_state.ENV)
    assert triton_state.resolve(None) == "torch"


def test_a_converted_model_decodes_and_generates_through_triton_as_through_pytorch(monkeypatch):
    """A converted float32 model whose prefills run the state part through the kernels: cached
    steps after a prefill give the full forward's logits, and greedy ``generate`` on a left-padded
    batch picks PyTorch's tokens with PyTorch's logits."""
    model = converted_tiny(HybridOperator(sink=2, window=5, feature_dim=16, decay_horizon=8.0), torch.float32)
    choose = lambda name: monkeypatch.setattr(HybridWindowAttention, "state_backend", name)  # noqa: E731
    decode_alike_on_two_backends(model, ("triton", "torch"), choose, lambda: triton_state.served,
                                 length=40, prefix=30, new_tokens=8, tol=1e-4)  # fmt: skip


@pytest.mark.parametrize("F,BD", [(16, 32), (16, 64)], ids=["smollm2", "llama2_7b"])
def test_every_kernel_compiles_for_the_lent_gpus(F, BD):
    """The kernels compiled ahead of time, here without a GPU, for the H100 / H200 the GPU check
    runs on (sm_90): Triton's front end, its layouts and ptxas all accept them, so a compile
    error cannot first show on a lent GPU's minutes. Feature width 16 with the slices of D that
    SmolLM2 (64 + 1 columns: 32) and Llama-2-7B (128 + 1: 64) take (``triton_state.block_d``)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rfkit.ops import triton_state_kernels as source

    assert triton_state.block_d(65, 16) == 32 and triton_state.block_d(129, 16) == 64
    constants = {"F": F, "C": triton_state.CHUNK, "BD": BD}
    for name in ("states", "outputs", "grad_q", "grad_states", "grad_kv"):
        params = inspect.signature(getattr(source, name)).parameters
        signature = {p: "constexpr" if p in constants else "*fp32" if p.endswith("_ptr") else "i32" for p in params}
        compiled = triton.compile(
            ASTSource(fn=triton.jit(getattr(source, name)), signature=signature, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
        )
        assert "ld.global" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000, name
