"""The decode step shaped for every device: the steady step (host-known slot, fixed ops) against the
per-row step in float64 and bf16, greedy tokens through every path, the op count of one converted
layer's step, and ``torch.compile(fullgraph=True)`` over the steady step without recompiles."""

from __future__ import annotations

import pytest
import torch
from helpers import decode_alike_on_two_backends, prefill_then_steps, random_ids, tiny_model
from test_fast_paths import HD, KINDS, W, block, qkv

import rfkit.models.window as window_module
from rfkit.experiments.speed import layer_step
from rfkit.models.hybrid_mamba import HybridMambaAttention
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridOperator
from rfkit.models.window import WindowAttention
from rfkit.ops import cpu_kernels


def any_block(kind: str, sink: int, kvq) -> WindowAttention:
    if kind != "hybrid_mamba":
        return block(kind, sink, kvq)
    b = HybridMambaAttention(kvq, HD, window=W, sink=sink, state_dim=4).double().eval()
    with torch.no_grad():
        b.gate.fill_(0.7)
    return b


def run_steps(b, state, steps, known: bool, count: int):
    """Decode ``steps`` one by one from ``state`` after ``count`` tokens, telling the step the
    count (``known``) or not; returns the outputs and the final state."""
    outs = []
    for q, k, v in steps:
        y, *state = b.step_qkv(q, k, v, *state, seen=count if known else None)
        outs.append(y)
        count += 1
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("kvq", [[0, 0, 1, 1], [0, 1, 0, 1]], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kind", KINDS + ["hybrid_mamba"])
def test_the_steady_step_equals_the_per_row_step_in_float64(kind, sink, kvq, monkeypatch):
    b = any_block(kind, sink, kvq)
    q, k, v = qkv(2, 2 * W + 3, kvq, seed=3)
    steps = [qkv(2, 1, kvq, seed=40 + i) for i in range(3 * W)]
    steady = []
    original = WindowAttention._steady_step
    monkeypatch.setattr(WindowAttention, "_steady_step", lambda self, *a: steady.append(1) or original(self, *a))
    with torch.no_grad():
        state = b.attend(q, k, v, return_states=True)[1]
        got, mine = run_steps(b, [t.clone() for t in state], steps, True, q.shape[2])
        assert len(steady) == len(steps)  # every step past sink + window took the steady path
        want, theirs = run_steps(b, [t.clone() for t in state], steps, False, q.shape[2])
        assert len(steady) == len(steps)  # and none without the count
        full = b.attend(*(torch.cat([t, *(s[i] for s in steps)], 2) for i, t in enumerate((q, k, v))))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got, full[:, q.shape[2] :], rtol=1e-10, atol=1e-10)  # = one forward
    for a, c in zip(mine, theirs):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["window", "hybrid_decay"])
def test_the_steady_step_in_bf16_keeps_float32_sums_and_matches_the_per_row_step(kind):
    b = block(kind, 3).float()
    q, k, v = (t.to(torch.bfloat16) for t in qkv(2, 2 * W + 3, seed=5))
    steps = [tuple(t.to(torch.bfloat16) for t in qkv(2, 1, seed=60 + i)) for i in range(2 * W)]
    with torch.no_grad():
        state = b.attend(q, k, v, return_states=True)[1]
        got, mine = run_steps(b, [t.clone() for t in state], steps, True, q.shape[2])
        want, theirs = run_steps(b, [t.clone() for t in state], steps, False, q.shape[2])
    assert got.dtype == torch.bfloat16 and mine[0].dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in mine[3:])  # the hybrid's sums stay float32
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    for a, c in zip(mine, theirs):
        torch.testing.assert_close(a.float(), c.float(), rtol=1e-5, atol=1e-5)


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """A state tensor compared bit for bit: bf16 as its 16-bit words (-0.0 is not 0.0)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.mark.parametrize("kvq", [[0, 0, 1, 1], [0, 1, 0, 1]], ids=["grouped", "ungrouped"])
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("kind", KINDS + ["hybrid_mamba"])
def test_the_bf16_c_step_matches_the_pytorch_bf16_step(kind, sink, kvq, monkeypatch):
    """A bf16 model's step (bf16 activations and window K/V, float32 sums: rfkit.models.precision)
    runs the compiled ``rf_window_step_bf16`` (the hybrid Mamba has no compiled step: its PyTorch
    step, in both runs). From an empty state, a left-padded prefill (per-row counts) and a prefill
    told the count (the PyTorch steady step), over three ring wraps: the PyTorch bf16 step's
    outputs to within one bf16 rounding (both compute in float32 from the same bf16 values), the
    window's K/V bit for bit, the sums to float32 rounding; and the same against the float32
    kernel run on the same values (the K/V then rounded to bf16: bit for bit)."""
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    bf16 = torch.bfloat16
    b = any_block(kind, sink, kvq).float()
    q, k, v = (t.to(bf16) for t in qkv(2, 2 * W + 3, kvq, seed=11))
    mask = torch.ones(2, q.shape[2], dtype=torch.long)
    mask[1, :4] = 0
    steps = [tuple(t.to(bf16) for t in qkv(2, 1, kvq, seed=20 + i)) for i in range(3 * W)]
    entries = []
    compiled = cpu_kernels.window_step_planned
    record = lambda plan, *a: entries.append(plan["entry"]) or compiled(plan, *a)  # noqa: E731
    monkeypatch.setattr(cpu_kernels, "window_step_planned", record)
    within_bf16 = dict(rtol=2**-7, atol=1e-5)  # one bf16 rounding apart at most
    with torch.no_grad():
        for start in ("empty", "padded", "counted"):
            if start == "empty":
                state, count = b.empty_state(2, q.device, bf16), None
            else:
                state = b.attend(q, k, v, return_states=True, mask=mask if start == "padded" else None)[1]
                count = q.shape[2] if start == "counted" else None
            kernel, pytorch = [t.clone() for t in state], [t.clone() for t in state]
            f32 = [t.float() if t.is_floating_point() else t.clone() for t in state]
            for one in steps:
                monkeypatch.setattr(WindowAttention, "use_kernel", True)
                got, *kernel = b.step_qkv(*one, *kernel, seen=count)
                ref, *f32 = b.step_qkv(*(t.float() for t in one), *f32, seen=count)
                monkeypatch.setattr(WindowAttention, "use_kernel", False)
                want, *pytorch = b.step_qkv(*one, *pytorch, seen=count)
                assert got.dtype == bf16
                torch.testing.assert_close(got, want, **within_bf16)
                torch.testing.assert_close(got, ref.to(bf16), **within_bf16)
                count = None if count is None else count + 1
            for mine, theirs, wide in zip(kernel, pytorch, f32):
                assert mine.dtype == theirs.dtype
                if mine.dtype == bf16 or not mine.is_floating_point():  # the window's K/V and the count
                    assert torch.equal(bf16_bits(mine), bf16_bits(theirs)), start
                    assert torch.equal(bf16_bits(mine), bf16_bits(wide.to(mine.dtype))), start
                else:  # the sums: float32 on every path
                    assert mine.dtype == torch.float32
                    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(mine, wide, rtol=1e-5, atol=1e-6)
    assert set(cpu_kernels.WINDOW_STEP_ENTRIES) == set(window_module.KERNEL_DTYPES)  # what the mixers offer it
    if kind == "hybrid_mamba":
        assert not entries
    else:  # every kernel-side step ran compiled code, the bf16 entry for the bf16 state
        assert entries == ["rf_window_step_bf16", "rf_window_step_f32"] * (3 * len(steps))


def test_the_kernels_round_float32_to_bf16_as_torch_does():
    """The bf16 step stores its output with the kernels' own float32 -> bf16 rounding: the words
    of torch's CPU cast (``.to(torch.bfloat16)``) for ties (to even), overflow to infinity,
    subnormals, signed zeros, every NaN (ATen's cast writes 0xFFFF) and random bit patterns."""
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    special = [0x00000000, 0x80000000, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F817FFF, 0x7F7FFFFF,
               0x7F7F8000, 0xFF7F7FFF, 0x7F800000, 0xFF800000, 0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,
               0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF]  # fmt: skip
    words = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in special], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    words = torch.cat([words, torch.randint(-(2**31), 2**31, (100_000,), generator=g, dtype=torch.int32)])
    exponents = torch.randint(-40, 38, (10_000,), generator=g)
    scaled = torch.randn(10_000, generator=g) * 10.0**exponents  # subnormal to huge
    x = torch.cat([words.view(torch.float32), scaled])
    assert int(x.isnan().sum()) > 100  # random bit patterns include NaNs of every payload
    assert torch.equal(cpu_kernels.to_bf16(x).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


#: layer 0 keeps no head (its decode step hands the mixer the packed heads unrotated, with the
#: token's cos / sin), layer 1 keeps two
NO_KEPT_FIRST = ((0, 1, 2, 3), (2, 3))


def converted_hybrid(layers=((0, 1), (2, 3)), dtype=torch.float32):
    """A tiny Llama with the heads ``layers`` replaced by the hybrid, gates open and feature maps
    drawn; in ``dtype``, its new weights float32 (a bf16 model's precision policy)."""
    from rfkit.models.precision import keep_new_weights_float32

    model = tiny_model("llama", 4, 2)
    model = to_recurformer(model, [list(h) for h in layers], HybridOperator(sink=2, window=6, feature_dim=4, decay_horizon=8.0))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.mixer.gate.fill_(1.0)
            layer.self_attn.mixer.feature_map.normal_(std=0.5)
    if dtype != torch.float32:
        model.to(dtype)
        keep_new_weights_float32(model)
    return model.eval()


def greedy(model, ids, new: int = 24):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)


def test_greedy_tokens_are_the_same_through_every_decode_path(monkeypatch):
    """The layer's decode path with the compiled C step, with the PyTorch steady step, with the
    steady step under torch.compile, and the general rank-masked path: the same tokens."""
    model, ids = converted_hybrid(), random_ids(2, 12)
    tokens = {"kernel": greedy(model, ids)}
    monkeypatch.setattr(WindowAttention, "use_kernel", False)
    tokens["pytorch"] = greedy(model, ids)
    for layer in model.model.layers:
        layer.self_attn.mixer.compile_step(backend="eager")
    torch._dynamo.utils.counters.clear()
    tokens["compiled"] = greedy(model, ids)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the compiled step ran
    for layer in model.model.layers:
        layer.self_attn.mixer._compiled_steady = None
    monkeypatch.setattr(WindowAttention, "fast", False)
    tokens["general"] = greedy(model, ids)
    assert tokens["kernel"].shape[1] == 12 + 24
    for name, got in tokens.items():
        assert torch.equal(got, tokens["general"]), name


def test_the_compiled_steady_step_is_one_graph_for_every_step(monkeypatch):
    """fullgraph=True raises on a graph break; the slot is a symbolic integer, so stepping
    through every ring slot compiles once."""
    monkeypatch.setattr(WindowAttention, "use_kernel", False)  # the path of every other device
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    b = block("hybrid_decay", 3).float()
    q, k, v = (t.float() for t in qkv(2, 2 * W + 3, seed=7))
    b.compile_step(backend="aot_eager")
    with torch.no_grad():
        state = b.attend(q, k, v, return_states=True)[1]
        eager, _ = run_steps(b, [t.clone() for t in state], [tuple(t.float() for t in qkv(2, 1, seed=i)) for i in range(2 * W)], False, 0)
        compiled, _ = run_steps(b, [t.clone() for t in state], [tuple(t.float() for t in qkv(2, 1, seed=i)) for i in range(2 * W)], True, q.shape[2])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kernel, dtype",
    [(True, torch.float32), (True, torch.bfloat16), (False, torch.float32)],
    ids=["cpu-kernel", "cpu-kernel-bf16", "device-path"],
)
def test_one_converted_layers_step_is_a_fixed_short_list_of_tensor_calls(kernel, dtype, monkeypatch):
    """The ``--layer-step`` counter: at most 40 torch calls per converted layer on the PyTorch path
    that every device but a CPU in float32 or bf16 runs (the issue's bound; 66 before the rotary
    matrix, the two splits and the step's views), and at most 24 with the compiled C step (was 38),
    for a bf16 model (bf16 base, float32 mixers) too. The token's first converted layer also builds
    the rotary matrix that all of them share: a few calls once per token, not per layer (HF's own
    cos / sin, once per token too, are not counted)."""
    monkeypatch.setattr(WindowAttention, "use_kernel", kernel)
    model = converted_hybrid(dtype=dtype)
    counts = {context: layer_step(model, context, 0, torch.device("cpu"))["torch_calls_per_layer"] for context in (24, 40)}
    assert counts[24] == counts[40]  # the same ops at every step and length
    first, *others = counts[24]
    assert others and all(n <= (24 if kernel else 40) for n in others)
    assert first - others[0] <= 6  # the shared rotary matrix: diag_embed, unsqueeze, addcmul_, 3 attribute reads


def rotating_steps(monkeypatch) -> list:
    """Count the compiled steps that rotated the query and key themselves."""
    rotated = []
    compiled = cpu_kernels.window_step_planned
    monkeypatch.setattr(
        cpu_kernels, "window_step_planned", lambda plan, q, k, v, rotation=None: rotated.append(rotation is not None) or compiled(plan, q, k, v, rotation)
    )
    return rotated


def test_a_layer_without_kept_heads_rotates_inside_the_c_step_as_the_pytorch_step_does(monkeypatch):
    """Layer 0 keeps no head: the compiled step rotates its query and key from the packed heads,
    the PyTorch step (every other device) through the rotary matrix. Cached steps give the full
    forward's logits on both, rows with their own positions (left-padded ``generate``) and rows
    sharing one (no position ids) alike, and greedy tokens agree; the kept-heads layer 1 rotates
    as before."""
    model = converted_hybrid(NO_KEPT_FIRST)
    rotated = rotating_steps(monkeypatch)
    choose = lambda name: monkeypatch.setattr(WindowAttention, "use_kernel", name == "kernel")  # noqa: E731
    decode_alike_on_two_backends(model, ("kernel", "pytorch"), choose, lambda: sum(rotated), length=20, prefix=7, new_tokens=8, tol=2e-5)
    assert rotated.count(True) == rotated.count(False) > 0  # layer 0 rotated in C, layer 1 got rotated heads
    monkeypatch.setattr(WindowAttention, "fast", False)  # the general rank-masked path rotates them too
    full, steps, _ = prefill_then_steps(model, random_ids(2, 20, seed=4), prefix=7)
    torch.testing.assert_close(steps, full, rtol=2e-5, atol=2e-5)


def test_the_bf16_c_step_rotates_to_the_bits_of_the_rotary_matrix(monkeypatch):
    """In a bf16 model the key the compiled step rotates and stores in the window is, bit for bit,
    the bf16 key the PyTorch step stores after the rotary matrix's product (one rounding each),
    and the logits agree within one bf16 rounding."""
    model = converted_hybrid(NO_KEPT_FIRST, torch.bfloat16)
    rotated = rotating_steps(monkeypatch)
    ids = random_ids(2, 20, seed=3)
    runs = {}
    for kernel in (True, False):
        monkeypatch.setattr(WindowAttention, "use_kernel", kernel)
        _, steps, cache = prefill_then_steps(model, ids, prefix=7)
        runs[kernel] = (steps, cache.rfkit_mixer_states[0])
    assert any(rotated)
    (steps_c, state_c), (steps_t, state_t) = runs[True], runs[False]
    for mine, theirs in zip(state_c[:2], state_t[:2]):  # the window's keys and values
        assert mine.dtype == torch.bfloat16
        assert torch.equal(bf16_bits(mine), bf16_bits(theirs))
    torch.testing.assert_close(steps_c.float(), steps_t.float(), rtol=2**-6, atol=2e-2)


def test_a_layer_without_kept_heads_is_a_dozen_tensor_calls_per_step(monkeypatch):
    """With the compiled step, a layer without kept heads is its two projections, one view, one
    split of the packed heads and the step's own calls: at most 12 (14 before, when it rotated
    its heads and split them twice). The token's first such layer also prepares the cos / sin
    rows the others share."""
    monkeypatch.setattr(WindowAttention, "use_kernel", True)
    first, second = layer_step(converted_hybrid(((0, 1, 2, 3), (0, 1, 2, 3))), 24, 0, torch.device("cpu"))["torch_calls_per_layer"]
    assert second <= 12
    assert first - second <= 8  # to, expand, two contiguous and two data_ptr: once per token


def test_the_rotary_matrix_rotates_as_rotate_does_and_is_built_once_per_token():
    from rfkit.models.rotary import rotate, rotation_matrix

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 1, HD, generator=g, dtype=torch.float64)
    angles = torch.randn(2, 1, HD // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # as the model's rotary_emb
    matrix = rotation_matrix(cos, sin)
    torch.testing.assert_close(x @ matrix, rotate(x, cos, sin), rtol=1e-14, atol=1e-14)
    assert rotation_matrix(cos, sin) is matrix  # the next layer of the same token reuses it
    again = rotation_matrix(cos.clone(), sin)  # another token's cos: built anew
    assert again is not matrix and torch.equal(again, matrix)


def test_a_state_with_any_tensor_replaced_gets_a_new_plan():
    """The steady step reads the hybrid's sums through views made once per state: replacing only
    ``S`` (keys unchanged) must not leave the step writing into the old ``S``."""
    b = block("hybrid_decay", 3).double()
    q, k, v = qkv(2, 2 * W + 3, seed=5)
    steps = [qkv(2, 1, seed=60 + i) for i in range(2)]
    with torch.no_grad():
        state = [t.clone() for t in b.attend(q, k, v, return_states=True)[1]]
        want, want_state = run_steps(b, [t.clone() for t in state], steps, True, q.shape[2])
        b.step_qkv(*steps[0], *[t.clone() for t in state], seen=q.shape[2])  # a plan for other tensors
        first, *state = b.step_qkv(*steps[0], *state, seen=q.shape[2])
        state[3] = state[3].clone()  # S alone replaced, e.g. by a caller moving the state
        second, *state = b.step_qkv(*steps[1], *state, seen=q.shape[2] + 1)
    torch.testing.assert_close(torch.cat([first, second], 1), want, rtol=1e-12, atol=1e-12)
    for got, expected in zip(state, want_state):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
