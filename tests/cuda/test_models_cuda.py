"""Converted models on the device, every operator kind, in float32 and with a bf16 base: the full
forward and a prefill followed by cached one-token steps against a float64 CPU reference of the
same weights, the recurrent states' dtype and device under bf16, and greedy ``generate`` against
one full forward on the device."""

from __future__ import annotations

import pytest
import torch
from cuda_models import DTYPES, OPERATORS, TOLERANCE, assert_greedy, converted, loud_original, reference, rel_err
from helpers import prefill_then_steps, random_ids

from rfkit.models.cache import mixer_state_store
from rfkit.models.window import WindowAttention

pytestmark = pytest.mark.cuda

PREFIX, LENGTH = 4, 24  # the first steps fill the window (per-row step), the rest are steady


def on_device(kind: str, dtype: torch.dtype, device: torch.device):
    """The float64 CPU reference of a converted model, and the model itself moved to ``device``."""
    model = converted(kind, dtype)
    return reference(model), model.to(device)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", OPERATORS)
def test_forward_and_cached_steps_match_the_float64_reference(kind, dtype, device, monkeypatch):
    """On the device, with its weights where the precision policy puts them: one full forward, and
    a 4-token prefill followed by 20 cached steps (the per-row step while the window fills, then
    the steady step, the one every device but a CPU in float32 runs), give the float64 CPU
    reference's logits within the dtype's tolerance, finite, with the mixers' states on the device."""
    ref, model = on_device(kind, dtype, device)
    for name, param in model.named_parameters():  # the precision policy, on the device
        assert param.device.type == device.type, name
        assert param.dtype == (torch.float32 if ".mixer." in name else dtype), name
    steady = []
    original = WindowAttention._steady_step
    monkeypatch.setattr(WindowAttention, "_steady_step", lambda self, *a: steady.append(1) or original(self, *a))
    ids = random_ids(2, LENGTH, seed=3)
    with torch.no_grad():
        want = ref(ids).logits
    full, steps, cache = prefill_then_steps(model, ids.to(device), PREFIX)
    assert full.device.type == device.type and full.dtype == dtype and steps.dtype == dtype
    assert bool(torch.isfinite(full).all()) and bool(torch.isfinite(steps).all())
    errors = {"full": rel_err(full, want), "steps": rel_err(steps, want)}
    assert max(errors.values()) < TOLERANCE[dtype], errors
    mixer = model.model.layers[0].self_attn.mixer
    if isinstance(mixer, WindowAttention):  # the decode path every device but a CPU in float32 takes
        assert len(steady) == 2 * (LENGTH - max(PREFIX, mixer.sink + mixer.window))
    else:
        assert not steady
    for states in mixer_state_store(cache).values():
        assert all(t.device.type == device.type for t in states)


@pytest.mark.parametrize("kind", OPERATORS)
def test_the_replaced_heads_move_the_logits_far_beyond_the_tolerance(kind):
    """The comparisons above can fail: the converted model's logits differ from the original's
    (all heads kept) by far more than the float32 tolerance, so an error in a mixer's path shows."""
    ids = random_ids(2, LENGTH, seed=3)
    with torch.no_grad():
        original = loud_original().double()(ids).logits
        want = reference(converted(kind))(ids).logits
    assert rel_err(original, want) > 30 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("kind", OPERATORS)
def test_recurrent_states_stay_float32_under_a_bf16_base(kind, device):
    """After a bf16 prefill and steps on the device, every recurrent sum in the cache is float32
    (the Mamba block's conv inputs and SSM state, the hybrid's S and z, the hybrid Mamba's h) and
    the window's K/V are bf16, as the kept heads' cache is."""
    model = converted(kind, torch.bfloat16).to(device)
    _, _, cache = prefill_then_steps(model, random_ids(2, 12, seed=5).to(device), 8)
    stores = mixer_state_store(cache)
    assert sorted(stores) == [0, 1]
    for states in stores.values():
        kinds = [t.dtype for t in states if t.is_floating_point()]
        if kind == "mamba":
            assert kinds == [torch.float32, torch.float32]  # conv inputs (float32 weights), SSM state
        else:
            assert kinds[:2] == [torch.bfloat16] * 2 and set(kinds[2:]) <= {torch.float32}
            assert len(kinds) == {"hybrid": 4, "hybrid_mamba": 3}.get(kind, 2)
        assert all(t.device.type == device.type for t in states)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", OPERATORS)
def test_greedy_generate_picks_what_one_full_forward_picks(kind, dtype, device):
    """``generate`` on the device (a prefill, then cached steps past the windows) continues two
    prompts with the tokens one full forward over the result picks on the same device: its step
    logits are the full forward's within the dtype's tolerance, and its tokens their argmax
    (cuda_models.assert_greedy: in bf16 a near-tie within its rounding may go either way)."""
    model = converted(kind, dtype).to(device)
    prompt, new = 10, 14
    ids = random_ids(2, prompt, seed=4).to(device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        tokens = out.sequences
        assert tokens.shape == (2, prompt + new) and tokens.device.type == device.type
        full = model(tokens).logits[:, prompt - 1 : -1]
    steps = torch.stack(out.logits, 1)
    assert bool(torch.isfinite(full).all()) and bool(torch.isfinite(steps).all())
    assert_greedy(full, steps, tokens[:, prompt:], TOLERANCE[dtype], clear=0.9 if dtype == torch.float32 else 0.5)
