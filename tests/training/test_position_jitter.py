"""``model.position_jitter``: training reads batches at shifted positions, drawn from the seed and
the step; exact attention does not notice, a state on rotated queries and keys does."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import random_ids, tiny_model
from rfkit.conversion.policies import PolicyError
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridOperator
from rfkit.training.distill import training_loss
from rfkit.training.module import RecurFormerModule


def _module(jitter: int, model) -> RecurFormerModule:
    module = RecurFormerModule(position_jitter=jitter)
    module.model = model
    return module


def test_offsets_stay_in_the_context_and_repeat_for_the_same_seed_and_step():
    ids = random_ids(batch=2, length=200)  # the tiny model's context is 256: offsets 0..56
    torch.manual_seed(5)
    module = _module(1000, tiny_model())
    seen = set()
    for _ in range(3):
        batch = module._jittered({"input_ids": ids})
        positions = batch["position_ids"]
        assert positions.shape == ids.shape and torch.equal(positions[0], positions[1])
        assert torch.equal(positions[0], torch.arange(200) + positions[0, 0])
        assert 0 <= int(positions[0, 0]) <= 56
        seen.add(int(positions[0, 0]))
    assert len(seen) == 1  # same seed, same step (0 without a trainer): the same offset
    assert "position_ids" not in _module(0, tiny_model())._jittered({"input_ids": ids})
    assert "position_ids" not in module._jittered({"input_ids": random_ids(batch=1, length=256)})  # no room


@torch.no_grad()
def test_exact_attention_ignores_the_shift_and_an_open_state_does_not():
    model = tiny_model().double()
    ids = random_ids(batch=1, length=96)
    shifted = {"input_ids": ids, "position_ids": torch.arange(100, 196)[None]}
    plain, _ = training_loss(model, {"input_ids": ids})
    moved, _ = training_loss(model, shifted)
    assert float(moved) == pytest.approx(float(plain), abs=2e-6)  # RoPE attention is relative (float32 loss)
    converted = to_recurformer(copy.deepcopy(model), [[0, 1], []], HybridOperator(sink=2, window=8, feature_dim=8))
    for name, param in converted.named_parameters():
        if name.endswith("mixer.gate"):
            param.fill_(1.0)  # open the state: the old tokens are read through phi(q) . phi(k)
    plain, _ = training_loss(converted, {"input_ids": ids})
    moved, _ = training_loss(converted, shifted)
    assert abs(float(moved) - float(plain)) > 1e-4


def test_a_negative_jitter_is_refused_in_one_line():
    with pytest.raises(PolicyError, match=r"^model\.position_jitter: must be an integer >= 0, got -1"):
        RecurFormerModule(position_jitter=-1)


def test_long_only_jitter_shifts_the_long_blocks_and_leaves_the_short_batches():
    """``position_jitter_batches: long``: a batch the interleaved loader marks ``long`` is shifted
    as with ``all``; a short batch keeps positions 0.. (no ``position_ids``)."""
    torch.manual_seed(5)
    module = RecurFormerModule(position_jitter=1000, position_jitter_batches="long")
    module.model = tiny_model()
    ids = random_ids(batch=1, length=200)
    assert "position_ids" not in module._jittered({"input_ids": ids})
    long = module._jittered({"input_ids": ids, "long": True})
    everywhere = _module(1000, module.model)._jittered({"input_ids": ids, "long": True})
    assert torch.equal(long["position_ids"], everywhere["position_ids"])  # the same draw as with "all"
    with pytest.raises(PolicyError, match=r"^model\.position_jitter_batches: 'short' is not allowed; allowed: all, long"):
        RecurFormerModule(position_jitter_batches="short")
