"""The compiled steady decode step on the device (``compile_decode_steps``: ``torch.compile(fullgraph=True,
dynamic=True)`` over every window mixer's step) against the eager step, in float32 and with a bf16
base. On CUDA it compiles with Inductor (Triton code); on the CPU twin with ``aot_eager``, which
traces the same single graph (fullgraph: a graph break raises) through AOTAutograd without
generating code: Inductor's C++ build took about 30 s there, over the twin's budget."""

from __future__ import annotations

import warnings

import pytest
import torch
from cuda_models import DTYPES, TOLERANCE, converted, rel_err
from helpers import prefill_then_steps, random_ids

from rfkit.models.window import WindowAttention, compile_decode_steps

pytestmark = pytest.mark.cuda


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_compiled_steady_step_decodes_as_the_eager_step(dtype, device, monkeypatch):
    """A hybrid model with the state decay (the step with the most ops: fold the evicted key,
    age the sums, read window and state under one normaliser) decodes 12 steady steps through
    the compiled step, one graph for every ring slot and both layers, giving the eager logits."""
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    model = converted("hybrid", dtype).to(device)
    ids = random_ids(2, 20, seed=6).to(device)
    _, eager, _ = prefill_then_steps(model, ids, 8)  # 8 >= sink + window: every step is steady
    compiled_calls = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        assert compile_decode_steps(model, backend=backend) == 2
        for layer in model.model.layers:  # count the calls that reach the compiled step
            mixer = layer.self_attn.mixer
            step = mixer._compiled_steady
            mixer._compiled_steady = lambda *a, step=step: compiled_calls.append(1) or step(*a)
        monkeypatch.setattr(WindowAttention, "_steady_step", lambda *a: pytest.fail("the eager steady step ran"))
        _, compiled, _ = prefill_then_steps(model, ids, 8)
    finally:
        for layer in model.model.layers:
            layer.self_attn.mixer._compiled_steady = None
    assert len(compiled_calls) == 2 * 12
    assert not torch._dynamo.utils.counters["graph_break"]
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # not one per slot
    assert compiled.dtype == dtype and bool(torch.isfinite(compiled).all())
    assert rel_err(compiled, eager) < (1e-5 if dtype == torch.float32 else TOLERANCE[dtype] / 3)


@pytest.mark.slow
def test_reduce_overhead_decodes_as_the_eager_step(device, monkeypatch):
    """docs/generation.md's GPU recipe, ``compile_decode_steps(model, mode="reduce-overhead")``:
    Inductor with CUDA graph trees. The steady step writes into the cache's tensors (the ring
    slot, the count, the hybrid's sums), which CUDA graph trees may decline to capture (then the
    compiled kernels run without a graph); captured or not, decoding must give the eager logits.
    How many captures Inductor declined is reported as a warning line in the GPU check's log,
    which docs/generation.md is then to state. The CPU twin asserts what the CPU does instead:
    the mode reaches ``torch.compile`` for every mixer and the step it returns serves every
    steady step (the CPU has no CUDA graphs, and Inductor's C++ build is over the twin's budget)."""
    model = converted("hybrid", torch.float32).to(device)
    ids = random_ids(2, 20, seed=6).to(device)
    _, eager, _ = prefill_then_steps(model, ids, 8)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    asked = []
    if device.type == "cpu":
        monkeypatch.setattr(torch, "compile", lambda fn, **options: asked.append(options) or fn)
    calls = []
    try:
        assert compile_decode_steps(model, mode="reduce-overhead") == 2
        for layer in model.model.layers:
            mixer = layer.self_attn.mixer
            step = mixer._compiled_steady
            mixer._compiled_steady = lambda *a, step=step: calls.append(1) or step(*a)
        _, compiled, _ = prefill_then_steps(model, ids, 8)
    finally:
        for layer in model.model.layers:
            layer.self_attn.mixer._compiled_steady = None
    assert len(calls) == 2 * 12
    assert rel_err(compiled, eager) < 1e-5
    if device.type == "cpu":
        assert asked == [{"fullgraph": True, "dynamic": True, "mode": "reduce-overhead"}] * 2
    else:
        skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        warnings.warn(f"reduce-overhead decode step: Inductor declined CUDA graphs {skips} time(s)", stacklevel=1)
