"""The precision policy (rfkit.models.precision): a bf16 base with float32 new weights and float32
recurrent states, on every path of every built-in mixer."""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids, tiny_model

from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridMambaOperator, HybridOperator, MambaOperator, SinkRecentOperator
from rfkit.models.precision import keep_new_weights_float32, new_weight_modules

OPERATORS = {
    "mamba": lambda: MambaOperator(d_state=4, zero_init_output=False),
    "sink_recent": lambda: SinkRecentOperator(sink=2, window=6),
    "hybrid": lambda: HybridOperator(sink=2, window=6, feature_dim=4, decay_horizon=16.0),
    "hybrid_mamba": lambda: HybridMambaOperator(sink=2, window=6, state_dim=4),
}


def converted(operator: str, dtype=torch.bfloat16):
    """A tiny GQA Llama loaded in ``dtype`` (as model.dtype loads it), one KV group per layer
    replaced, the hybrids' gates open."""
    model = to_recurformer(tiny_model("llama", 4, 2).to(dtype), [[0, 1], [2, 3]], OPERATORS[operator]())
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.self_attn.mixer, "gate"):
                layer.self_attn.mixer.gate.fill_(1.0)
    return model.eval()


@pytest.mark.parametrize("operator", OPERATORS)
def test_conversion_keeps_the_base_bf16_and_the_new_weights_float32(operator):
    model = converted(operator)
    for name, param in model.named_parameters():
        assert param.dtype == (torch.float32 if ".mixer." in name else torch.bfloat16), name
    model.to(torch.bfloat16)  # a later cast of the whole model (as Lightning's bf16-true does) ...
    assert keep_new_weights_float32(model) == sum(1 for n, _ in model.named_parameters() if ".mixer." in n)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".mixer." in n)  # ... undone
    float64 = converted(operator, torch.float64)  # the numerical tests' float64 stays float64 everywhere
    assert all(p.dtype == torch.float64 for p in float64.parameters())


@pytest.mark.parametrize("operator", OPERATORS)
def test_bf16_decoding_equals_the_bf16_full_forward_and_keeps_float32_states(operator):
    """Step-by-step cached decoding of the bf16 model gives the logits of its full forward (to bf16
    precision, against a float32 model's difference), and every recurrent sum in the cache is float32
    while the window's K/V are bf16."""
    model = converted(operator)
    ids = random_ids(2, 30, seed=3)  # tokens leave the 6 + 2 window
    with torch.no_grad():
        full = model(ids).logits.float()
        out = model(ids[:, :9], use_cache=True)
        cache, steps = out.past_key_values, [out.logits.float()]
        for t in range(9, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits.float())
        reference = converted(operator, torch.float32)(ids).logits
    assert out.logits.dtype == torch.bfloat16
    gap = float((torch.cat(steps, 1) - full).abs().max())
    assert gap <= 0.05 and float((full - reference).abs().max()) <= 0.1, gap
    from rfkit.models.cache import mixer_state_store

    for states in mixer_state_store(cache).values():
        kinds = [str(t.dtype) for t in states if t.is_floating_point()]
        if operator == "mamba":
            assert kinds == ["torch.float32", "torch.float32"]  # conv inputs (float32 weights), SSM state
        else:  # window K/V in the activations' dtype, the sums float32
            assert kinds[:2] == ["torch.bfloat16"] * 2 and set(kinds[2:]) <= {"torch.float32"}


#: the compiled CPU kernels a bf16 model's mixers run, per operator (the hybrid Mamba has none)
KERNELS = {
    "mamba": {"selective_scan_cpu", "mamba_step_cpu"},
    "sink_recent": {"window_prefill_cpu", "rf_window_step_bf16"},
    "hybrid": {"window_prefill_cpu", "rf_window_step_bf16"},
    "hybrid_mamba": set(),
}


@pytest.mark.parametrize("operator", OPERATORS)
def test_a_bf16_model_decodes_through_the_compiled_cpu_kernels_with_the_pytorch_paths_tokens(operator, monkeypatch):
    """On CPU a bf16 model's mixers run the compiled kernels: the Mamba block's scan and step (its
    float32 weights and states), the window mixers' prefill (in their float32 compute dtype) and
    their step over the bf16 window (``rf_window_step_bf16``), every step of every layer. Greedy
    tokens (the ring wraps several times) equal those of the PyTorch paths."""
    import rfkit.models.mamba as mamba_module
    from rfkit.models.mamba import MambaBlock
    from rfkit.models.window import WindowAttention
    from rfkit.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernel did not build: {cpu_kernels.unavailable_reason()}")
    calls = []

    def counted(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))

    counted(mamba_module, "selective_scan_cpu")
    counted(mamba_module, "mamba_step_cpu")
    counted(cpu_kernels, "window_prefill_cpu")
    step = cpu_kernels.window_step_planned
    record = lambda plan, *a: calls.append(plan["entry"]) or step(plan, *a)  # noqa: E731
    monkeypatch.setattr(cpu_kernels, "window_step_planned", record)
    model = converted(operator)
    ids = random_ids(2, 12, seed=5)
    new = 12  # past the 12-token prompt, the window of 2 + 6 wraps once more
    greedy = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.no_grad():
        compiled = model.generate(ids, **greedy)
        assert set(calls) == KERNELS[operator]
        if KERNELS[operator]:  # every decode step of both layers
            assert len([c for c in calls if c in ("mamba_step_cpu", "rf_window_step_bf16")]) == 2 * (new - 1)
        calls.clear()
        monkeypatch.setattr(WindowAttention, "use_kernel", False)
        for block in model.modules():
            if isinstance(block, MambaBlock):
                monkeypatch.setattr(block, "use_fast_path", "never")
        pytorch = model.generate(ids, **greedy)
    assert not calls
    assert compiled.shape[1] == ids.shape[1] + new
    assert torch.equal(compiled, pytorch)


def test_the_hybrid_sums_keep_growing_beyond_what_bf16_can_add():
    """z sums phi(k) of every evicted token (entries near 1 / feature_dim): in bf16 it would stop
    growing once its spacing passes the increment (about 64 for increments near 0.1). Fed bf16
    activations, the state is float32 on the prefill and the step path and matches a float32 run."""
    torch.manual_seed(0)
    mixer = HybridWindowAttention([0, 0], head_dim=8, window=4, sink=0, feature_dim=16).eval()
    q, k, v = torch.randn(1, 2, 3000, 8), torch.randn(1, 1, 3000, 8), torch.randn(1, 1, 3000, 8)
    with torch.no_grad():
        _, ref = mixer.attend(q, k, v, return_states=True)
        _, half = mixer.attend(*(t.bfloat16() for t in (q, k, v)), return_states=True)
        z = half[4].clone()  # the steps below update the state in place
        state = tuple(half)
        for t in range(20):  # the step path: the sums keep accumulating in place, in float32
            one = (x[:, :, t : t + 1].bfloat16() for x in (q, k, v))
            state = tuple(mixer.step_qkv(*one, *state)[1:])
    assert ref[4].dtype == z.dtype == state[4].dtype == torch.float32
    assert float(ref[4].max()) > 300  # far past the point where a bf16 sum stalls
    torch.testing.assert_close(z, ref[4], rtol=2e-2, atol=0)  # only the inputs' bf16 rounding
    # every step folds one evicted key, whose phi sums to 2 (two softmaxes): all of it is added
    assert float(state[4].sum() - z.sum()) == pytest.approx(20 * 2, abs=1e-2)


def test_new_weight_modules_are_each_mixer_and_each_adapter_layer():
    from rfkit.models.lora import LoraSettings, apply_lora

    model = converted("hybrid")
    apply_lora(model, LoraSettings(r=2, target_modules=["q_proj", "o_proj"]))
    found = {name for name, module in model.named_modules() if any(module is m for m in new_weight_modules(model))}
    assert found == {f"model.layers.{i}.self_attn.mixer" for i in (0, 1)} | {
        f"model.layers.{i}.self_attn.{proj}.lora_{ab}.default" for i in (0, 1) for proj in ("qkv_proj", "o_proj") for ab in "AB"
    }  # "q_proj" names the converted layers' packed projection
    held = {id(p) for m in new_weight_modules(model) for p in m.parameters()}
    new = {id(p) for n, p in model.named_parameters() if ".mixer." in n or ".lora_" in n}
    assert held == new  # every new weight, and nothing else
