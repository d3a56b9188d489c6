"""MQAR ablation (paper Fig. 4): accuracy of random-init models as a fraction beta of heads becomes Mamba.

    rfkit eval mqar --config recipes/mqar_smoke.yaml [--output_dir DIR] [--train.steps 50] ...

Multi-query associative recall (MQAR, Zoology style): a sequence opens with key-value pairs
``k1 v1 k2 v2 ...``, then queries the keys again later on; the model must answer each queried
key with its value. A small random-init Llama learns it with attention (induction heads); the
paper shows accuracy collapses when too many heads become Mamba blocks: some attention must stay.

**Data** (:func:`make_mqar`). Token 0 is reserved (never generated; free for padding). Keys are
drawn from ``[1, 1 + K)`` and values from ``[1 + K, vocab_size)`` with ``K = (vocab_size - 1) // 2``,
both without replacement inside an example. The query region after the ``2 * num_kv_pairs``
prefix tokens is cut into ``(input_seq_len - 2 * num_kv_pairs) // 2`` two-token slots; every
queried key takes one slot, chosen without replacement with Zoology's power law
``p(slot i) ~ power_a * i ** (power_a - 1)`` (i = 1, 2, ...: early slots, i.e. short gaps, more
likely). Every other position holds a noise token drawn from the *value* half (so a key never
appears outside its pair and its query, which would plant a false association in a small
vocabulary). Labels are -100 everywhere except at each answer.

**Alignment** (self-consistent, next-token): a queried key sits at ``inputs[t]``, its value at
``inputs[t + 1]`` and ``labels[t + 1] = value``. The logits at ``t`` predict ``labels[t + 1]``,
exactly as :func:`rfkit.training.module.summed_nll` shifts them, and the value in the input keeps the
sequence an ordinary token stream. (Zoology instead puts noise after the key and does not shift
its labels.) Accuracy (:func:`mqar_accuracy`) is the fraction of labelled positions whose argmax
prediction from the previous position equals the value.

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

**Outputs** (in ``output_dir``, written atomically):

* ``results.json``: ``accuracy`` = ``{beta: {length: accuracy}}`` with keys as strings
  (``"0.25"``, ``"128"``), beta -> eval length -> fraction of queries answered correctly;
  ``lengths``; ``replaced_heads`` = ``{beta: {"replaced", "total", "selected"}}``; ``head_maps`` =
  the full :class:`rfkit.conversion.headmap.HeadMap` per beta; ``train_loss`` = ``{beta: mean loss of the
  last train.loss_window steps}``; ``warmup_loss``; ``train_seconds`` (warm-up and per beta);
  ``settings`` (the resolved config); ``device``; ``wall_s``.
* ``mqar.png``: accuracy against sequence length, one line per beta.
* ``mqar.md``: the Markdown table (rows beta, columns length) that is also printed.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rfkit.evals.common import EvalError

log = logging.getLogger(__name__)

MODEL_NAME = "mqar-random-init-llama"
RESERVED_IDS = 1  # token 0: never generated


class MQARError(EvalError):
    """Bad MQAR input; one line for the user, naming the field."""


# ---------------------------------------------------------------------------------------- data
def vocab_split(vocab_size: int) -> tuple[range, range]:
    """(key ids, value ids) of a vocabulary: two disjoint halves above the reserved id 0."""
    k = (vocab_size - RESERVED_IDS) // 2
    return range(RESERVED_IDS, RESERVED_IDS + k), range(RESERVED_IDS + k, vocab_size)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MQARError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


def check_mqar_settings(
    input_seq_len: int, num_kv_pairs: int, vocab_size: int, num_queries: int | None = None, prefix: str = ""
) -> int:
    """Raise :class:`MQARError` unless the settings make a valid MQAR task; returns the query count."""
    _check_int(f"{prefix}input_seq_len", input_seq_len, 1)
    _check_int(f"{prefix}num_kv_pairs", num_kv_pairs, 1)
    _check_int(f"{prefix}vocab_size", vocab_size, 1)
    queries = num_kv_pairs if num_queries is None else _check_int(f"{prefix}num_queries", num_queries, 1)
    if queries > num_kv_pairs:
        raise MQARError(f"{prefix}num_queries: {queries} exceeds num_kv_pairs {num_kv_pairs} (each key is queried at most once)")
    keys, values = vocab_split(vocab_size)
    if len(keys) < num_kv_pairs or len(values) < num_kv_pairs:
        raise MQARError(
            f"{prefix}vocab_size: {vocab_size} is too small for {num_kv_pairs} distinct keys and values; "
            f"needs at least {2 * num_kv_pairs + RESERVED_IDS}"
        )
    slots = (input_seq_len - 2 * num_kv_pairs) // 2
    if slots < queries:
        need = 2 * num_kv_pairs + 2 * queries
        raise MQARError(
            f"{prefix}input_seq_len: {input_seq_len} cannot hold {num_kv_pairs} key-value pairs and {queries} "
            f"queries; needs at least 2*num_kv_pairs + 2*queries = {need}"
        )
    return queries


def make_mqar(
    num_examples: int,
    input_seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    power_a: float = 0.01,
    seed: int = 0,
    num_queries: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zoology-style MQAR examples: ``(inputs, labels)``, both ``(num_examples, input_seq_len)`` long.

    ``inputs = k1 v1 ... kP vP | query region``; in the query region each queried key is followed
    by its value, at two-token slots drawn (without replacement) with probability proportional to
    ``power_a * i ** (power_a - 1)`` for slot i = 1, 2, ...; the other positions are noise from the
    value half of the vocabulary. ``labels`` is -100 except ``labels[t + 1] = value`` where
    ``inputs[t]`` is a queried key (next-token alignment, see the module docstring).
    ``num_queries`` (default ``num_kv_pairs``) keys are queried, each once. Deterministic in ``seed``.
    """
    _check_int("num_examples", num_examples, 1)
    queries = check_mqar_settings(input_seq_len, num_kv_pairs, vocab_size, num_queries)
    if not isinstance(power_a, (int, float)) or isinstance(power_a, bool) or not 0.0 < float(power_a) <= 1.0:
        raise MQARError(f"power_a: must lie in (0, 1], got {power_a!r}")
    g = torch.Generator().manual_seed(int(seed))
    key_ids, value_ids = vocab_split(vocab_size)
    n, p = num_examples, num_kv_pairs
    keys = torch.rand(n, len(key_ids), generator=g).argsort(dim=1)[:, :p] + key_ids.start  # (n, p) distinct
    values = torch.rand(n, len(value_ids), generator=g).argsort(dim=1)[:, :p] + value_ids.start  # (n, p)
    slots = (input_seq_len - 2 * p) // 2
    ranks = torch.arange(1, slots + 1, dtype=torch.float64)
    weights = (float(power_a) * ranks ** (float(power_a) - 1.0)).expand(n, slots)
    gaps = torch.multinomial(weights, queries, replacement=False, generator=g)  # (n, q) slot per query
    asked = torch.rand(n, p, generator=g).argsort(dim=1)[:, :queries]  # (n, q) which pairs are queried
    inputs = torch.randint(value_ids.start, value_ids.stop, (n, input_seq_len), generator=g)  # noise
    inputs[:, 0 : 2 * p : 2] = keys
    inputs[:, 1 : 2 * p : 2] = values
    key_pos = 2 * p + 2 * gaps  # (n, q)
    asked_keys, asked_values = keys.gather(1, asked), values.gather(1, asked)
    inputs.scatter_(1, key_pos, asked_keys)
    inputs.scatter_(1, key_pos + 1, asked_values)
    labels = torch.full_like(inputs, -100)
    labels.scatter_(1, key_pos + 1, asked_values)
    return inputs, labels


@torch.no_grad()
def mqar_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """``(correct, total)`` over labelled positions: ``argmax logits[:, t]`` against ``labels[:, t + 1]``."""
    targets = labels[:, 1:]
    mask = targets != -100
    predicted = logits[:, :-1].argmax(dim=-1)
    return int((predicted[mask] == targets[mask]).sum()), int(mask.sum())


# ---------------------------------------------------------------------------------------- config
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


def _parser():
    from jsonargparse import ActionConfigFile, ArgumentParser

    from rfkit.config.parse_errors import tidy_parse_error

    class Parser(ArgumentParser):
        def error(self, message, ex=None):  # one line, exit 2 through the eval dispatcher
            raise MQARError(tidy_parse_error(message)) from ex

    parser = Parser(prog="rfkit eval mqar", description=__doc__.strip().splitlines()[0], exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="MQAR recipe YAML")
    parser.add_argument("--model", type=ModelSettings, default=ModelSettings())
    parser.add_argument("--data", type=DataSettings, default=DataSettings())
    parser.add_argument("--train", type=TrainSettings, default=TrainSettings())
    parser.add_argument("--select", type=SelectSettings, default=SelectSettings())
    parser.add_argument("--betas", type=list[float], default=[0.0, 0.25, 0.5, 0.75, 1.0], help="fractions of heads replaced")
    parser.add_argument("--eval_lengths", type=list[int], default=[128, 256, 512, 1024], help="test sequence lengths")
    parser.add_argument("--seed", type=int, default=0, help="seed of model init, data and batch order")
    parser.add_argument("--output_dir", type=str | None, default=None, help="output directory (default runs/mqar)")
    parser.add_argument("--threads", type=int | None, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", type=str | None, default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--progress", type=bool, default=True, help="tqdm progress bars")
    return parser


@dataclass
class MQARConfig:
    model: ModelSettings
    data: DataSettings
    train: TrainSettings
    select: SelectSettings
    betas: list[float]
    eval_lengths: list[int]
    seed: int = 0
    output_dir: str | None = None
    threads: int | None = None
    device: str | None = None
    progress: bool = True


def parse_config(argv: list[str]) -> MQARConfig:
    """Parse ``argv`` (``--config FILE`` plus dotted overrides) and validate; :class:`MQARError` on bad input."""
    if "--config" in argv:
        from rfkit.config.catalog import resolve_config

        argv = list(argv)
        i = argv.index("--config")
        if i + 1 < len(argv) and not Path(argv[i + 1]).exists():
            # a catalogue name (mqar_smoke) is its packaged recipe; anything else names the nearest
            argv[i + 1] = resolve_config(argv[i + 1])
    parser = _parser()
    ns = parser.parse_args(argv)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    init = instantiate(ns)
    cfg = MQARConfig(
        model=init.model, data=init.data, train=init.train, select=init.select, betas=list(init.betas),
        eval_lengths=list(init.eval_lengths), seed=init.seed, output_dir=init.output_dir, threads=init.threads,
        device=init.device, progress=init.progress,
    )  # fmt: skip
    validate(cfg)
    return cfg


def _positive(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MQARError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def _lengths(name: str, values: list[int]) -> None:
    if not values:
        raise MQARError(f"{name}: give at least one length")
    for v in values:
        _positive(name, v, 2)
    if len(set(values)) != len(values):
        raise MQARError(f"{name}: lengths must be distinct, got {values}")


def validate(cfg: MQARConfig) -> None:
    """Every check that needs no model: ranges, list lengths, task feasibility, device."""
    m, d, t, s = cfg.model, cfg.data, cfg.train, cfg.select
    if not cfg.betas:
        raise MQARError("betas: give at least one fraction in [0, 1]")
    for b in cfg.betas:
        if not 0.0 <= b <= 1.0:
            raise MQARError(f"betas: {b} is outside [0, 1]; beta is the fraction of heads replaced")
    if len(set(cfg.betas)) != len(cfg.betas):
        raise MQARError(f"betas: values must be distinct, got {cfg.betas}")
    for name in ("d_model", "layers", "heads", "kv_heads", "vocab_size", "d_state", "d_conv", "expand"):
        _positive(f"model.{name}", getattr(m, name))
    if m.intermediate_size is not None:
        _positive("model.intermediate_size", m.intermediate_size)
    if m.d_model % m.heads:
        raise MQARError(f"model.heads: d_model {m.d_model} is not divisible by heads {m.heads}")
    if m.heads % m.kv_heads:
        raise MQARError(f"model.kv_heads: heads {m.heads} is not a multiple of kv_heads {m.kv_heads}")
    if not m.rope_theta > 0:
        raise MQARError(f"model.rope_theta: must be > 0, got {m.rope_theta}")
    _lengths("eval_lengths", cfg.eval_lengths)
    _lengths("data.train_lengths", d.train_lengths)
    all_pairs = [p for p in d.train_kv_pairs + d.eval_kv_pairs if isinstance(p, int) and p >= 1]
    if all_pairs and min(len(r) for r in vocab_split(m.vocab_size)) < max(all_pairs):
        raise MQARError(
            f"model.vocab_size: {m.vocab_size} is too small for {max(all_pairs)} distinct keys and values; "
            f"needs at least {2 * max(all_pairs) + RESERVED_IDS}"
        )
    for lengths, pairs, lname, pname in (
        (d.train_lengths, d.train_kv_pairs, "data.train_lengths", "data.train_kv_pairs"),
        (cfg.eval_lengths, d.eval_kv_pairs, "eval_lengths", "data.eval_kv_pairs"),
    ):
        if len(pairs) != len(lengths):
            raise MQARError(f"{pname}: give one count per entry of {lname} ({len(lengths)}), got {len(pairs)}")
        for length, p in zip(lengths, pairs):
            _positive(pname, p)
            try:
                check_mqar_settings(length, p, m.vocab_size)
            except MQARError as err:
                raise MQARError(f"{pname}: length {length} with {p} pairs: {err}") from None
    _positive("data.train_examples", d.train_examples)
    _positive("data.eval_examples", d.eval_examples)
    if not 0.0 < d.power_a <= 1.0:
        raise MQARError(f"data.power_a: must lie in (0, 1], got {d.power_a}")
    _positive("train.steps", t.steps)
    _positive("train.warmup_steps", t.warmup_steps, 0)
    if t.warmup_steps >= t.steps:
        raise MQARError(f"train.warmup_steps: {t.warmup_steps} must be below train.steps {t.steps} (training continues after conversion)")
    if not t.lr > 0:
        raise MQARError(f"train.lr: must be > 0, got {t.lr}")
    _positive("train.lr_warmup_steps", t.lr_warmup_steps, 0)
    if t.schedule not in ("cosine", "linear", "constant"):
        raise MQARError(f"train.schedule: {t.schedule!r} is not allowed; allowed: cosine, linear, constant")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise MQARError(f"train.min_lr_ratio: must lie in [0, 1], got {t.min_lr_ratio}")
    if t.weight_decay < 0:
        raise MQARError(f"train.weight_decay: must be >= 0, got {t.weight_decay}")
    if t.grad_clip < 0:
        raise MQARError(f"train.grad_clip: must be >= 0, got {t.grad_clip}")
    for name in ("batch_size", "eval_batch_size", "loss_window"):
        _positive(f"train.{name}", getattr(t, name))
    if s.granularity not in ("kv_group", "query_head"):
        raise MQARError(f"select.granularity: {s.granularity!r} is not allowed; allowed: kv_group, query_head")
    if s.scope not in ("global", "per_layer"):
        raise MQARError(f"select.scope: {s.scope!r} is not allowed; allowed: global, per_layer")
    if not 0.0 <= s.alpha <= 1.0:
        raise MQARError(f"select.alpha: must lie in [0, 1], got {s.alpha}")
    if s.window is not None:
        _positive("select.window", s.window)
    if s.profile_length is not None and s.profile_length not in d.train_lengths:
        raise MQARError(f"select.profile_length: {s.profile_length} is not one of data.train_lengths {d.train_lengths}")
    _positive("select.profile_examples", s.profile_examples)
    if cfg.threads is not None:
        _positive("threads", cfg.threads)
    if cfg.device not in (None, "cpu", "cuda") and not str(cfg.device).startswith("cuda:"):
        raise MQARError(f"device: {cfg.device!r} is not allowed; allowed: cpu, cuda, cuda:N")
    if cfg.device and cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise MQARError("device: cuda was asked for but no CUDA device is available")
    if cfg.output_dir is not None and Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
        raise MQARError(f"output_dir: '{cfg.output_dir}' exists and is not a directory")


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
    from rfkit.conversion.operators import MambaOperator

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
    from rfkit.models.layout import AttentionLayout
    from rfkit.conversion.policies import RecencyRatioPolicy

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
    from rfkit.training.module import summed_nll

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


# ---------------------------------------------------------------------------------------- run
def beta_key(beta: float) -> str:
    return str(float(beta))


def markdown_table(accuracy: dict[str, dict[str, float]], lengths: list[int]) -> str:
    head = "| beta | " + " | ".join(str(n) for n in lengths) + " |"
    rule = "|---|" + "---|" * len(lengths)
    rows = [f"| {b} | " + " | ".join(f"{acc[str(n)]:.3f}" for n in lengths) + " |" for b, acc in accuracy.items()]
    return "\n".join([head, rule, *rows])


def run(cfg: MQARConfig) -> dict:
    """The whole ablation: data, warm-up, profile, per-beta conversion and training, evaluation, outputs."""
    from rfkit.conversion.headmap import atomic_write_json, atomic_write_text
    from rfkit.experiments.plots import line_plot

    started = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out_dir = Path(cfg.output_dir or "runs/mqar")
    m, d, t, s = cfg.model, cfg.data, cfg.train, cfg.select
    betas = sorted(float(b) for b in cfg.betas)

    # data: seeded pools per training length, fixed test sets per eval length, profiling batches
    pools = [
        make_mqar(d.train_examples, n, p, m.vocab_size, d.power_a, seed=cfg.seed * 1000 + 1 + i)
        for i, (n, p) in enumerate(zip(d.train_lengths, d.train_kv_pairs))
    ]
    test_sets = {
        n: make_mqar(d.eval_examples, n, p, m.vocab_size, d.power_a, seed=cfg.seed * 1000 + 500 + i)
        for i, (n, p) in enumerate(zip(cfg.eval_lengths, d.eval_kv_pairs))
    }
    profile_length = s.profile_length or max(d.train_lengths)
    profile_pairs = d.train_kv_pairs[d.train_lengths.index(profile_length)]
    window = s.window or max(1, profile_length // 10)
    profile_inputs, _ = make_mqar(s.profile_examples, profile_length, profile_pairs, m.vocab_size, d.power_a, seed=cfg.seed * 1000 + 999)
    profile_batches = [{"input_ids": profile_inputs[i : i + t.eval_batch_size]} for i in range(0, s.profile_examples, t.eval_batch_size)]
    plan = BatchPlan(pools, t.steps, t.batch_size, seed=cfg.seed * 1000 + 777)

    # warm-up with every head attending, then one profile for every beta
    model = build_model(m, max(max(d.train_lengths), max(cfg.eval_lengths)), cfg.seed)
    warm_started = time.perf_counter()
    warm_losses = train_range(model, plan, 0, t.warmup_steps, t, device, "warm-up (attention)", cfg.progress)
    warm_seconds = time.perf_counter() - warm_started
    profile = profile_model(model, profile_batches, s, window, progress=False)
    data_info = {"task": "mqar", "length": profile_length, "num_kv_pairs": profile_pairs, "examples": s.profile_examples}
    warm_state = copy.deepcopy(model.state_dict())

    accuracy, replaced, head_maps, final_loss, train_seconds = {}, {}, {}, {}, {}
    for beta in betas:
        model.load_state_dict(warm_state)
        head_map = head_map_for(model, profile, beta, s, window, data_info)
        torch.manual_seed(cfg.seed + 1)  # Mamba init: the same for every beta that converts
        converted = convert_for_beta(model, head_map, m)
        beta_started = time.perf_counter()
        losses = train_range(converted, plan, t.warmup_steps, t.steps, t, device, f"beta {beta}", cfg.progress)
        result = evaluate(converted, test_sets, t.eval_batch_size, device)
        key = beta_key(beta)
        train_seconds[key] = round(time.perf_counter() - beta_started, 2)
        accuracy[key] = {str(n): round(a, 6) for n, a in result.items()}
        replaced[key] = {"replaced": head_map.replaced_heads, "total": head_map.total_heads, "selected": head_map.selected}
        head_maps[key] = asdict(head_map)
        tail = losses[-t.loss_window :]
        final_loss[key] = round(sum(tail) / len(tail), 6)
        log.info("beta %s: %d/%d heads replaced, accuracy %s", key, head_map.replaced_heads, head_map.total_heads, accuracy[key])
        del converted

    wall = time.perf_counter() - started
    settings = {
        "model": asdict(m),
        "data": asdict(d),
        "train": asdict(t),
        "select": {**asdict(s), "window": window, "profile_length": profile_length},
        "betas": betas,
        "eval_lengths": list(cfg.eval_lengths),
        "seed": cfg.seed,
    }
    tail = warm_losses[-t.loss_window :]
    results = {
        "accuracy": accuracy,
        "lengths": list(cfg.eval_lengths),
        "replaced_heads": replaced,
        "train_loss": final_loss,
        "warmup_loss": round(sum(tail) / len(tail), 6) if tail else None,
        "train_seconds": {"warmup": round(warm_seconds, 2), **train_seconds},
        "head_maps": head_maps,
        "settings": settings,
        "device": str(device),
        "wall_s": round(wall, 2),
    }
    table = markdown_table(accuracy, cfg.eval_lengths)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "results.json", results)
    atomic_write_text(out_dir / "mqar.md", table + "\n")
    series = {
        f"beta {b} ({replaced[b]['replaced']}/{replaced[b]['total']} heads Mamba)": (
            list(cfg.eval_lengths), [accuracy[b][str(n)] for n in cfg.eval_lengths]
        )
        for b in accuracy
    }
    line_plot(series, out_dir / "mqar.png", "sequence length", "MQAR accuracy", "MQAR accuracy vs length per beta", logx=True)
    print(table)
    print(f"wall time {wall:.1f} s -> {out_dir / 'results.json'}, {out_dir / 'mqar.png'}")
    return results


def main(argv: list[str]) -> int:
    """``rfkit eval mqar``: parse and validate (one-line :class:`MQARError` on bad input), then run."""
    cfg = parse_config(list(argv))
    run(cfg)
    return 0
