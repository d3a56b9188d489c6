"""Window dropout survives activation checkpointing.

The hybrid mixers shorten their window at random in training (window dropout). Activation
checkpointing runs a layer's forward again in backward; a window drawn afresh by each forward
would make the recomputed layer differ from the one whose loss is being differentiated, silently
(a private random stream is not restored by the recompute). ``rfkit fit`` draws the window once
per training batch (:func:`rfkit.models.mixer.draw_for_batch`, from
``RecurFormerModule.on_train_batch_start``), so one step's gradients are the same with and without
checkpointing; drawn per forward they are not.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids, tiny_model

from rfkit.models.mixer import draw_for_batch
from rfkit.models.modeling import to_recurformer
from rfkit.models.operators import HybridMambaOperator, HybridOperator
from rfkit.training.freeze import apply_freeze

OPERATORS = {
    "hybrid": lambda: HybridOperator(sink=2, window=12, feature_dim=4, window_dropout=1.0, decay_horizon=16.0),
    "hybrid_mamba": lambda: HybridMambaOperator(sink=2, window=12, state_dim=4, window_dropout=1.0),
}


def step_gradients(operator: str, checkpointing: bool, per_batch: bool) -> dict[str, torch.Tensor]:
    """The new weights' gradients of one training step of a converted tiny model whose gates are
    open, every forward drawing a shorter window (window_dropout 1)."""
    model = to_recurformer(tiny_model("llama", 4, 2), [[0, 1], [2, 3]], OPERATORS[operator]())
    mixers = [layer.self_attn.mixer for layer in model.model.layers]
    with torch.no_grad():
        for i, mixer in enumerate(mixers):
            mixer.gate.fill_(1.0)
            mixer._generator = torch.Generator().manual_seed(100 + i)  # the same draws in every run
    apply_freeze(model, "pretrained")
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if per_batch:
        draw_for_batch(model)
    ids = random_ids(2, 40, seed=9)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("operator", OPERATORS)
def test_one_steps_gradients_are_the_same_with_and_without_checkpointing(operator):
    plain = step_gradients(operator, checkpointing=False, per_batch=True)
    recomputed = step_gradients(operator, checkpointing=True, per_batch=True)
    assert plain.keys() == recomputed.keys() and any(".mixer." in n for n in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("operator", OPERATORS)
def test_drawn_per_forward_the_recomputed_window_differs(operator):
    """What the per-batch draw prevents: each forward drawing its own window, the checkpointed
    step differentiates a layer run with another window than its forward's. The tiled training
    path's tile spans follow the window, so checkpoint's own metadata check may catch it first;
    otherwise the gradients are wrong."""
    plain = step_gradients(operator, checkpointing=False, per_batch=False)
    try:
        recomputed = step_gradients(operator, checkpointing=True, per_batch=False)
    except torch.utils.checkpoint.CheckpointError as error:
        assert "different metadata" in str(error)
        return
    worst = max(float((recomputed[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in plain.items())
    assert worst > 1e-3
