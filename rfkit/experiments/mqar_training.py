"""The model side of ``rfkit eval mqar``: its settings, the random-init Llama, head selection and
conversion, and the training and evaluation loops (the command is :mod:`rfkit.experiments.mqar`).

**Head selection on a random-init model.** A random model has no recency-aware heads to profile,
so the all-attention model is first trained for ``train.warmup_steps``; then its heads are
profiled on MQAR batches (:func:`rfkit.conversion.profile.profile_heads`: window ``select.window``, default
``profile_length // 10``, ``select.alpha`` 0.5, first token excluded) once, and for every beta
:class:`rfkit.conversion.policies.RecencyRatioPolicy` picks the top-beta heads from that same profile. A copy
of the warmed-up model is converted through :func:`rfkit.conversion.convert.convert` (MambaOperator), given a
fresh AdamW and trained on to ``train.steps`` steps in all, on the same batches in the same order
for every beta (the learning-rate schedule continues where the warm-up stopped). Beta 0 converts
nothing: it is the warmed-up model itself, trained on identically.

**Granularity.** ``select.granularity: kv_group`` (default) replaces whole KV groups, the only
choice that frees KV cache under GQA; beta is still reported as the fraction of *query* heads
replaced, as in the paper. With 2 layers x 4 KV groups (8 query heads, 4 KV heads) the betas
0, 0.25, 0.5, 0.75, 1 replace 0, 4, 8, 12, 16 of the 16 query heads either way.
``query_head`` replaces single query heads.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from rfkit.experiments.mqar_task import mqar_accuracy

log = logging.getLogger(__name__)

MODEL_NAME = "mqar-random-init-llama"


@dataclass
class ModelSettings:
    """The random-init Llama and the Mamba blocks that replace heads.

    Args:
        d_model: Hidden size.
        layers: Decoder layers.
        heads: Query heads per layer.
        kv_heads: KV heads per layer (GQA when fewer than heads).
        intermediate_size: MLP width; default 4 * d_model.
        vocab_size: Vocabulary (id 0 reserved, keys and values split the rest in halves).
        rope_theta: RoPE base.
        d_state: Mamba state size.
        d_conv: Mamba convolution width.
        expand: Mamba inner width multiplier.
    """

    d_model: int = 512
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    intermediate_size: int | None = None
    vocab_size: int = 8192
    rope_theta: float = 10000.0
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2


@dataclass
class DataSettings:
    """Training mixture of MQAR lengths; evaluation sets follow ``eval_lengths``.

    Args:
        train_lengths: Training sequence lengths; each step draws one of them at random.
        train_kv_pairs: Key-value pairs per training length (one per entry of train_lengths).
        train_examples: Training examples generated per training length (sampled with replacement).
        eval_kv_pairs: Key-value pairs per evaluation length (one per entry of eval_lengths).
        eval_examples: Test examples per evaluation length (a fixed seeded set).
        power_a: Zoology's power-law parameter for query placement, in (0, 1].
    """

    train_lengths: list[int] = field(default_factory=lambda: [128, 256, 512, 1024])
    train_kv_pairs: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    train_examples: int = 20000
    eval_kv_pairs: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    eval_examples: int = 1000
    power_a: float = 0.01


@dataclass
class TrainSettings:
    """Optimisation.

    Args:
        steps: Total optimiser steps per beta, warm-up included.
        warmup_steps: All-attention steps before the heads are profiled and replaced (shared by every beta).
        lr: Peak learning rate of AdamW.
        lr_warmup_steps: Linear learning-rate ramp at the start.
        schedule: Decay after the ramp: cosine or linear to min_lr_ratio * lr, or constant.
        min_lr_ratio: Final learning rate as a fraction of lr.
        weight_decay: AdamW weight decay (matrices only; not norms, biases, A_log, D).
        batch_size: Sequences per training step.
        eval_batch_size: Sequences per evaluation forward.
        grad_clip: Gradient-norm clip (0 turns it off).
        loss_window: Steps at the end whose mean loss is reported per beta.
    """

    steps: int = 4000
    warmup_steps: int = 1000
    lr: float = 1e-3
    lr_warmup_steps: int = 100
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    batch_size: int = 64
    eval_batch_size: int = 64
    grad_clip: float = 1.0
    loss_window: int = 50


@dataclass
class SelectSettings:
    """Head selection from the warmed-up model's recency profile (RecencyRatioPolicy).

    Args:
        granularity: kv_group (whole KV groups, frees cache under GQA) or query_head.
        scope: global (rank across layers) or per_layer.
        window: RR window k in tokens; default profile_length // 10.
        alpha: RR threshold for RA-I, in [0, 1].
        exclude_first_token: Leave token 0 out of the RR sums.
        profile_length: MQAR length of the profiling batches; one of data.train_lengths (default the longest).
        profile_examples: Profiling sequences.
    """

    granularity: str = "kv_group"
    scope: str = "global"
    window: int | None = None
    alpha: float = 0.5
    exclude_first_token: bool = True
    profile_length: int | None = None
    profile_examples: int = 64


# ---------------------------------------------------------------------------------------- model
def build_model(settings: ModelSettings, max_length: int, seed: int):
    """A random-init ``LlamaForCausalLM`` (RoPE, GQA as configured), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=settings.vocab_size,
        hidden_size=settings.d_model,
        intermediate_size=settings.intermediate_size or 4 * settings.d_model,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads,
        max_position_embeddings=max_length,
        rope_theta=settings.rope_theta,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def mamba_operator(settings: ModelSettings):
    from rfkit.models.operators import MambaOperator

    return MambaOperator(d_state=settings.d_state, d_conv=settings.d_conv, expand=settings.expand)


def profile_model(model, batches: list[dict], select: SelectSettings, window: int, progress: bool = False):
    """RR / RA-I profile of every head of ``model`` on ``batches`` (dicts with ``input_ids``)."""
    from rfkit.conversion.profile import profile_heads

    return profile_heads(
        model, batches, window=window, alpha=select.alpha, exclude_first_token=select.exclude_first_token, progress=progress
    )


def head_map_for(model, profile, beta: float, select: SelectSettings, window: int, data: dict | None = None):
    """The :class:`rfkit.conversion.headmap.HeadMap` that RecencyRatioPolicy at ``beta`` picks from ``profile``."""
    from rfkit.conversion.headmap import HeadMap
    from rfkit.conversion.policies import RecencyRatioPolicy
    from rfkit.models.layout import AttentionLayout

    policy = RecencyRatioPolicy(
        window=window, alpha=select.alpha, beta=beta, exclude_first_token=select.exclude_first_token,
        granularity=select.granularity, scope=select.scope,
    )  # fmt: skip
    layout = AttentionLayout.from_config(model.config)
    return HeadMap.build(MODEL_NAME, layout, profile, policy.select(layout, profile), policy, data or {})


def convert_for_beta(model, head_map, settings: ModelSettings):
    """A converted deep copy of ``model`` with ``head_map``'s heads replaced by Mamba; when the map
    replaces nothing (beta 0), ``model`` itself, untouched."""
    from rfkit.conversion.convert import convert

    if head_map.replaced_heads == 0:
        return model
    return convert(copy.deepcopy(model), head_map, mamba_operator(settings))


# ---------------------------------------------------------------------------------------- training
def lr_at(step: int, t: TrainSettings) -> float:
    """Learning rate of optimiser step ``step`` (0-based) over the whole budget ``t.steps``."""
    if t.lr_warmup_steps and step < t.lr_warmup_steps:
        return t.lr * (step + 1) / t.lr_warmup_steps
    if t.schedule == "constant":
        return t.lr
    span = max(1, t.steps - t.lr_warmup_steps)
    frac = min(1.0, max(0.0, (step - t.lr_warmup_steps) / span))
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if t.schedule == "cosine" else 1.0 - frac
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * shape)


def make_optimizer(model, t: TrainSettings):
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.98), eps=1e-8)


class BatchPlan:
    """Which training examples every step uses: a fixed function of the seed, shared by every beta."""

    def __init__(self, pools: list[tuple[torch.Tensor, torch.Tensor]], steps: int, batch_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.pools = pools
        self.which = torch.randint(0, len(pools), (steps,), generator=g).tolist()
        self.rows = [torch.randint(0, pools[w][0].shape[0], (batch_size,), generator=g) for w in self.which]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = self.pools[self.which[step]]
        rows = self.rows[step]
        return inputs[rows], labels[rows]


def train_range(model, plan: BatchPlan, start: int, stop: int, t: TrainSettings, device, desc: str, progress: bool):
    """Train ``model`` on the plan's steps ``start .. stop - 1`` with a fresh AdamW; returns the losses."""
    from rfkit.training.losses import summed_nll

    model.to(device).train()
    optimizer = make_optimizer(model, t)
    losses = []
    started = time.perf_counter()
    bar = tqdm(range(start, stop), desc=desc, disable=not progress, unit="step", leave=False)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        inputs, labels = (x.to(device) for x in plan.batch(step))
        logits = model(input_ids=inputs, use_cache=False).logits
        nll, count = summed_nll(logits, inputs, labels)
        loss = nll / max(count, 1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    log.info("%s: %d steps in %.1f s, last loss %.3f", desc, stop - start, time.perf_counter() - started, losses[-1] if losses else float("nan"))
    return losses


@torch.no_grad()
def evaluate(model, test_sets: dict[int, tuple[torch.Tensor, torch.Tensor]], batch_size: int, device) -> dict[int, float]:
    """Accuracy per length on the fixed test sets."""
    model.to(device).eval()
    out = {}
    for length, (inputs, labels) in test_sets.items():
        correct = total = 0
        for start in range(0, inputs.shape[0], batch_size):
            ids = inputs[start : start + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            c, n = mqar_accuracy(logits, labels[start : start + batch_size].to(device))
            correct, total = correct + c, total + n
        out[length] = correct / max(total, 1)
    return out
