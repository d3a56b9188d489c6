"""The hybrid variants of the GPU recipes: each parses as ``rfkit fit --config`` parses it, differs
from the Mamba recipe it varies only in the operator and its training, and its operator, freeze
setting, distillation and optimizer train a tiny model of the same family for one step, in float32
and with the recipe's bf16 base. (Every recipe also runs whole through the CLI with its own
settings: tests/test_recipe_dry_runs.py.)"""

from __future__ import annotations

import importlib

import pytest
import torch
import yaml
from helpers import ROOT, parse_recipe, random_ids, tiny_model

from rfkit.config import catalog
from rfkit.models.operators import HybridOperator

# new recipe -> (the recipe it varies, the tiny model family of its base model)
VARIANTS = {
    "llama2_b09_hybrid": ("llama2_b09", "llama"),
    "qwen2_05b_b05_hybrid": ("qwen2_05b_b05", "qwen2"),
    "qwen2_7b_b09_hybrid": ("qwen2_7b_b09", "qwen2"),
}
OPERATOR_ARGS = dict(sink=4, window=56, feature_dim=16, window_dropout=0.5, decay_horizon=128, sharpness=1.0, stateless_layers=None)
# what a hybrid variant may change: the operator and how it trains (and its run directory)
VARIED = (
    "model.operator", "model.transfer", "model.freeze", "model.freeze_schedule", "model.lora",
    "model.optimizer", "model.lr_scheduler", "trainer.default_root_dir",
    "data.init_args.long_source", "data.init_args.long_seq_len", "data.init_args.long_every",
    "data.init_args.long_batch_size",
)  # fmt: skip
# the long blocks of end-to-end training each variant takes (its SmolLM2 counterpart's mix)
LONG_MIX = {"llama2_b09_hybrid": 4096, "qwen2_05b_b05_hybrid": 2048, "qwen2_7b_b09_hybrid": 4096}
# the beta 0.9 variants take what recipes/smollm2_b09.yaml found: heads ranked by measured loss on
# two lengths of the plays (the model's context allowing), the decay horizon at 2,048, and long
# blocks shifted to the model's long positions where its context is longer than them
AT_B09 = {
    "llama2_b09_hybrid": {"long_seq_len": [2048, 4096], "position_jitter": 0},
    "qwen2_7b_b09_hybrid": {"long_seq_len": [2048, 8192], "position_jitter": 28672},
}
AT_B09_VARIED = (
    "model.policy", "model.position_jitter", "model.position_jitter_batches",
    "data.init_args.long_recall", "data.init_args.long_recall_digits",
)  # fmt: skip


@pytest.fixture(scope="module")
def parsed():
    """``parsed(name)``: the recipe's parsed config, each recipe parsed once per module."""
    cache = {}
    with pytest.MonkeyPatch.context() as monkeypatch:

        def get(name):
            if name not in cache:
                cache[name] = parse_recipe(name, monkeypatch)
            return cache[name]

        yield get


def _shared(config, extra=()):
    config = config.clone()
    del config["config"]  # the recipe's own path
    for key in (*VARIED, *extra):
        del config[key]
    return config.as_dict()


@pytest.mark.parametrize("name", VARIANTS)
def test_hybrid_variant_changes_only_the_operator_and_its_training(name, parsed):
    varied, _ = VARIANTS[name]
    config, base = parsed(name), parsed(varied)
    operator = config.model.operator
    assert operator.class_path == "rfkit.operators.HybridOperator"
    b09 = AT_B09.get(name)
    assert operator.init_args.as_dict() == {**OPERATOR_ARGS, **({"decay_horizon": 2048} if b09 else {})}
    extra = AT_B09_VARIED if b09 else ()
    assert _shared(config, extra) == _shared(base, extra)  # model, policy, data, trainer, strategy, precision, callbacks
    policy, base_policy = config.model.policy, base.model.policy
    if b09:
        assert policy.class_path == "rfkit.policies.StreamedLossPolicy"
        args = policy.init_args
        assert args.beta == base_policy.init_args.beta == 0.9 and args.granularity == "kv_group"
        assert (args.sink, args.recent, args.blocks, args.long_source) == (4, 64, [2, 1], "embedded:shakespeare")
        assert args.long_seq_len == b09["long_seq_len"]
        assert config.model.position_jitter == b09["position_jitter"]
        assert config.model.position_jitter_batches == ("long" if b09["position_jitter"] else base.model.position_jitter_batches)
        # and the planted long records of recipes/smollm2_b09.yaml, as it sets them
        smollm2 = yaml.safe_load((ROOT / "recipes" / "smollm2_b09.yaml").read_text())["data"]
        data = config.data.init_args
        assert (data.long_recall, list(data.long_recall_digits)) == (smollm2["long_recall"], smollm2["long_recall_digits"])
        assert data.long_recall == 4 and base.data.init_args.long_recall == 0
    else:
        assert policy == base_policy
    assert config.trainer.default_root_dir == f"runs/{name}"  # never resumes the Mamba run's checkpoints

    model = config.model
    assert model.freeze == "pretrained" and model.freeze_schedule is None and model.lora is None
    transfer = model.transfer
    assert (transfer.space, transfer.lr, transfer.seq_len) == ("output", 0.01, None)
    assert transfer.steps >= 1000 and transfer.samples >= 16
    assert (transfer.long_source, transfer.long_seq_len, transfer.long_batch_size) == ("embedded:shakespeare", 4096, 1)
    assert transfer.long_samples >= 4
    assert model.distill == base.model.distill
    data = config.data.init_args
    long_mix = (data.long_source, data.long_seq_len, data.long_every, data.long_batch_size)
    assert long_mix == ("embedded:shakespeare", LONG_MIX[name], 2, 1)
    assert model.optimizer.class_path == "torch.optim.AdamW" and model.optimizer.init_args.lr == 0.005
    assert model.lr_scheduler.init_args.T_max == config.trainer.max_steps

    from rfkit.training.transfer import TransferConfig

    TransferConfig(**transfer.as_dict())  # the section's own checks (long_source names a known source)

    text = (ROOT / "recipes" / f"{name}.yaml").read_text()
    header = text[: text.index("\nseed_everything")]
    assert f"Varies {varied} " in header and "Why the hybrid" in header
    info = catalog.describe(name)
    assert info["operator"] == "HybridOperator" and "hybrid operator" in info["reproduces"]
    assert info["base_model"] == catalog.describe(varied)["base_model"]


def _recipe_operator(config) -> HybridOperator:
    """The recipe's operator, built from its parsed class path and init_args."""
    module, _, name = config.model.operator.class_path.rpartition(".")
    operator = getattr(importlib.import_module(module), name)(**config.model.operator.init_args.as_dict())
    assert isinstance(operator, HybridOperator)
    return operator


def _converted(name, config, dtype=torch.float32):
    """A tiny random model of the recipe's family (2 layers, width 64; MHA for Llama-2, GQA 4/2
    for Qwen2) with weights in ``dtype`` (as ``model.dtype`` loads them), its recipe's beta of whole
    KV groups replaced with the recipe's operator, then through attention transfer as the pipeline
    runs it (capture, calibration, which opens the gates, and a few steps): no cast by hand."""
    from rfkit.models.modeling import to_recurformer
    from rfkit.training.transfer import TransferConfig, transfer

    _, family = VARIANTS[name]
    kv_heads = 4 if family == "llama" else 2  # Llama-2-7B is MHA, Qwen2 GQA
    model = tiny_model(family, num_heads=4, num_kv_heads=kv_heads).to(dtype)
    policy = config.model.policy.init_args
    assert policy.granularity == "kv_group"
    layers = model.config.num_hidden_layers
    units = [(layer, g) for g in range(kv_heads) for layer in range(layers)]  # every layer gets some
    count = int(policy.beta * len(units) + 0.5)  # the policy's count (round half up) ...
    chosen = units[: min(count, len(units) - 1)]  # ... keeping one group, as beta < 1 does on a real model
    per_kv = 4 // kv_heads
    selected = [[h for (l, g) in chosen if l == layer for h in range(g * per_kv, (g + 1) * per_kv)] for layer in range(layers)]
    model = to_recurformer(model, selected, _recipe_operator(config))
    ids = random_ids(2, 128, seed=5)  # longer than sink + window (60): tokens leave the window
    settings = dict(config.model.transfer.as_dict(), steps=2, samples=2, batch_size=2, long_source=None)
    report = transfer(model, ids, TransferConfig(**settings), progress=False)
    for i in report["layers"]:
        mixer = model.model.layers[i].self_attn.mixer
        assert torch.all(mixer.gate > 0) and mixer.decay_horizon == (2048.0 if name in AT_B09 else 128.0)  # gates open, the recipe's horizon
    return model, report["layers"]


def _train_step(model, config):
    """One step of the recipe's end-to-end training: its freeze setting, its distillation loss
    (CE + KL to the shared teacher) and its optimizer over the parameters that train."""
    from rfkit.training.distill import DistillConfig, training_loss
    from rfkit.training.freeze import apply_freeze
    from rfkit.training.teacher import SharedTeacher

    model.train()
    apply_freeze(model, config.model.freeze)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert named and all(".mixer." in n for n in named)  # only the new weights train
    distill = DistillConfig(**config.model.distill.as_dict())
    teacher = SharedTeacher(model, distill.share_modules)
    module, _, cls = config.model.optimizer.class_path.rpartition(".")
    optimizer = getattr(importlib.import_module(module), cls)(named.values(), **config.model.optimizer.init_args.as_dict())
    ids = random_ids(2, 128, seed=7)
    loss, _parts = training_loss(model, {"input_ids": ids, "labels": ids}, distill, teacher)
    loss.backward()
    before = {n: p.detach().clone() for n, p in named.items()}
    frozen = model.get_input_embeddings().weight.detach().clone()
    optimizer.step()
    assert torch.equal(model.get_input_embeddings().weight, frozen)
    return loss, named, before


@pytest.mark.parametrize("name", VARIANTS)
def test_recipe_operator_trains_a_tiny_model_of_its_family_for_one_step(name, parsed):
    config = parsed(name)
    model, layers = _converted(name, config)
    assert len(layers) == 2  # both layers hold replaced heads
    loss, named, before = _train_step(model, config)
    assert torch.isfinite(loss)
    mixers = [model.model.layers[i].self_attn.mixer for i in layers]
    for mixer in mixers:
        for param in (mixer.log_horizon, mixer.gate, mixer.feature_map):
            assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0
    changed = {n for n, p in named.items() if not torch.equal(p.detach(), before[n])}
    for kind in ("log_horizon", "gate", "feature_map", "log_scale"):
        assert {n for n in named if n.endswith(kind)} <= changed, kind


@pytest.mark.parametrize("name", VARIANTS)
def test_under_the_recipes_bf16_weights_the_new_weights_are_float32_and_a_step_moves_the_horizon(name, parsed):
    """The recipes' bf16 base (model.dtype, bf16-true) with the precision policy: conversion keeps the
    new weights in float32 beside the bf16 base, attention transfer runs on the bf16 model's own
    captures, and one optimizer step moves the decay horizon (log 128, where a bf16 weight's spacing,
    1/32, is far above the step)."""
    config = parsed(name)
    assert config.model.dtype == "bfloat16" and config.trainer.precision == "bf16-true"
    model, _ = _converted(name, config, dtype=torch.bfloat16)
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if ".mixer." in n else torch.bfloat16), n
    loss, named, before = _train_step(model, config)
    assert torch.isfinite(loss)
    horizons = [n for n in named if n.endswith("log_horizon")]
    assert horizons and all(named[n].grad.abs().sum() > 0 for n in horizons)
    moved = [(named[n].detach() - before[n]).abs().max() for n in horizons]
    assert all(0 < float(m) < 0.03 for m in moved), moved  # a real step, smaller than bf16 could hold there
