"""The mixers' optional hooks (rfkit.models.mixer): a plugin mixer that implements them is
calibrated by attention transfer and gets a "state off" row in the evaluations, with no change to
either; a mixer that does not is left alone."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import random_ids, tiny_model
from torch import nn

from rfkit.models.hybrid import HybridWindowAttention
from rfkit.models.mixer import ReplacementMixer, ablatable_mixers, ablate_states, calibrate_mixer
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridOperator, ReplacementOperator
from rfkit.training.transfer import TransferConfig, transfer

SELECTED = [[0, 1], [2, 3]]  # one KV group per layer of the tiny GQA llama (4 heads, 2 KV heads)


class PlainMixer(ReplacementMixer):
    """A linear read-out plus a running-sum "state" under a scale: the default hooks."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.out_proj = nn.Linear(d_in, d_out, bias=False)
        self.state_proj = nn.Linear(d_in, d_out, bias=False)
        self.scale = nn.Parameter(torch.full((1,), 0.1))

    def forward(self, x, *state, return_states: bool = False, mask=None):
        running = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
        y = self.out_proj(x) + self.scale * self.state_proj(running)
        return (y, ()) if return_states else y


class HookedMixer(PlainMixer):
    """The same mixer implementing both hooks."""

    has_state_ablation = True

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out)
        self.calibrated_on: list[tuple] = []

    @torch.no_grad()
    def calibrate(self, x):
        self.calibrated_on.append(tuple(x.shape))
        self.scale.fill_(0.5)
        return {"scale": 0.5}

    @contextlib.contextmanager
    def state_ablation(self):
        saved = self.scale.detach().clone()
        try:
            with torch.no_grad():
                self.scale.zero_()
            yield
        finally:
            with torch.no_grad():
                self.scale.copy_(saved)


class BareMixer(nn.Module):
    """A plugin mixer written without the interface (a plain nn.Module, as EMAMixer)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.out_proj = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x, *state, return_states: bool = False, mask=None):
        return (self.out_proj(x), ()) if return_states else self.out_proj(x)


class PluginOperator(ReplacementOperator):
    def __init__(self, mixer: type = HookedMixer):
        self.mixer = mixer

    def build(self, d_in: int, d_out: int, layer_idx: int) -> nn.Module:
        return self.mixer(d_in, d_out)


def converted(mixer: type):
    return to_recurformer(tiny_model("llama"), SELECTED, PluginOperator(mixer))


def mixers(model) -> list[nn.Module]:
    return [layer.self_attn.mixer for layer in model.model.layers]


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_the_defaults_do_nothing():
    mixer = PlainMixer(4, 4)
    assert calibrate_mixer(mixer, torch.randn(1, 3, 4)) is None and mixer.has_state_ablation is False
    assert calibrate_mixer(BareMixer(4, 4), torch.randn(1, 3, 4)) is None
    with mixer.state_ablation():
        assert float(mixer.scale.detach()) == pytest.approx(0.1)


def test_a_plugin_mixer_with_the_hook_is_calibrated_by_transfer():
    model = converted(HookedMixer)
    config = TransferConfig(steps=2, samples=4, batch_size=2)
    report = transfer(model, random_ids(4, 16, seed=3), config, progress=False)
    assert report["calibration"] == {"0": {"scale": 0.5}, "1": {"scale": 0.5}}
    for mixer in mixers(model):
        assert mixer.calibrated_on == [(2, 16, 16)]  # one batch of its own inputs (B, L, d_in)


@pytest.mark.parametrize("mixer", [PlainMixer, BareMixer])
def test_a_mixer_without_the_hook_gets_the_read_out_instead(mixer):
    model = converted(mixer)
    report = transfer(model, random_ids(4, 16, seed=3), TransferConfig(steps=0, samples=4, batch_size=2), progress=False)
    assert "calibration" not in report
    for layer in ("0", "1"):  # the least-squares read-out ran
        assert report["mse_after_readout"][layer] < report["mse_before"][layer]


def test_ablate_states_switches_off_only_the_mixers_that_can():
    ids = random_ids(1, 12)
    model = converted(HookedMixer)
    before = logits(model, ids)
    assert ablatable_mixers(model) == mixers(model)
    with ablate_states(model) as count:
        assert count == 2 and all(float(m.scale.detach()) == 0 for m in mixers(model))
        off = logits(model, ids)
    assert not torch.allclose(off, before)
    torch.testing.assert_close(logits(model, ids), before, atol=0, rtol=0)  # restored exactly
    for mixer in (PlainMixer, BareMixer):
        model = converted(mixer)
        before = logits(model, ids)
        with ablate_states(model) as count:
            assert count == 0
            torch.testing.assert_close(logits(model, ids), before, atol=0, rtol=0)


def test_the_hybrid_closes_its_gates_through_the_interface():
    model = to_recurformer(tiny_model("llama"), SELECTED, HybridOperator(sink=1, window=4, feature_dim=4))
    blocks = mixers(model)
    assert all(isinstance(b, HybridWindowAttention) for b in blocks) and ablatable_mixers(model) == blocks
    for b in blocks:
        with torch.no_grad():
            b.gate.fill_(0.7)
    with ablate_states(model) as count:
        assert count == 2 and all(torch.all(b.gate == 0) for b in blocks)
    assert all(torch.all(b.gate == 0.7) for b in blocks)


@pytest.mark.parametrize("mixer, state_off_row", [(HookedMixer, True), (PlainMixer, False), (BareMixer, False)])
def test_eval_context_adds_the_state_off_row_for_mixers_that_have_one(mixer, state_off_row, monkeypatch, tmp_path):
    from rfkit.evals import context

    spec = SimpleNamespace(original=lambda device: tiny_model("llama"))  # the base, as ModelSpec.original loads it
    args = SimpleNamespace(model=str(tmp_path), model_spec=spec, torch_device=torch.device("cpu"), baseline_operator=None)
    loaded = SimpleNamespace(model=converted(mixer))
    rows = [(name, closed) for name, _, closed, _ in context.models_to_measure(args, loaded, SimpleNamespace(model=str(Path(tmp_path))))]
    expected = [("original", False), ("converted", False)] + ([("converted, state off", True)] if state_off_row else [])
    assert rows == expected
