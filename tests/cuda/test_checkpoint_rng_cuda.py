"""The random streams a checkpoint saves (``rfkit.training.checkpointing.random_states``) hold the
CUDA generator where CUDA is in use, survive the checkpoint's ``weights_only`` round trip, and
restore the same draws on the device; on the CPU twin there is no CUDA generator to save."""

from __future__ import annotations

import random

import pytest
import torch
from cuda_models import converted

from rfkit.training.checkpointing import RNG_KEY, AtomicCheckpointIO, random_states, restore_random_states

pytestmark = pytest.mark.cuda


def draws(device, mixers) -> dict:
    return {
        "device": torch.rand(6, device=device).tolist(),
        "cpu": torch.rand(6).tolist(),
        "python": [random.random() for _ in range(3)],
        "windows": [[m._draw_window() for _ in range(8)] for m in mixers],  # the hybrid's own stream
    }


def test_saved_random_states_hold_the_cuda_generator_and_restore_the_device_draws(device, tmp_path):
    model = converted("hybrid").to(device)
    mixers = [layer.self_attn.mixer for layer in model.model.layers]
    torch.manual_seed(7)  # seeds every CUDA generator too
    for mixer in mixers:
        mixer.window_dropout = 0.5
        mixer.dropout_generator()  # made on a fit's first training forward
    torch.rand(1, device=device)  # CUDA initialised, as a fit on the GPU has it
    io = AtomicCheckpointIO()
    io.save_checkpoint({RNG_KEY: random_states(model)}, tmp_path / "rng.ckpt")
    states = io.load_checkpoint(tmp_path / "rng.ckpt")[RNG_KEY]  # weights_only=True
    assert ("cuda" in states) == (device.type == "cuda")
    if device.type == "cuda":
        assert len(states["cuda"]) == torch.cuda.device_count()
        assert all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in states["cuda"])
    assert sorted(states["modules"]) == [f"model.layers.{i}.self_attn.mixer" for i in (0, 1)]
    first = draws(device, mixers)
    assert draws(device, mixers) != first  # the streams move on
    restore_random_states(model, states)
    assert draws(device, mixers) == first  # ... and come back
    if device.type == "cuda":  # without the CUDA part, the device draws would not
        restore_random_states(model, {k: v for k, v in states.items() if k != "cuda"})
        again = draws(device, mixers)
        assert again["device"] != first["device"] and again["cpu"] == first["cpu"]
