"""MQAR ablation (paper Fig. 4): accuracy of random-init models as a fraction beta of heads becomes Mamba.

    rfkit eval mqar --config recipes/mqar_smoke.yaml [--output_dir DIR] [--train.steps 50] ...

Multi-query associative recall (MQAR, Zoology style): a sequence opens with key-value pairs
``k1 v1 k2 v2 ...``, then queries the keys again later on; the model must answer each queried
key with its value. A small random-init Llama learns it with attention (induction heads); the
paper shows accuracy collapses when too many heads become Mamba blocks: some attention must stay.

The task (data, alignment, accuracy) is :mod:`rfkit.experiments.mqar_task`; the model, head
selection, conversion and training loops are :mod:`rfkit.experiments.mqar_training`. This module
is the command: its settings, their checks, and the run that ties them together (beta 0 is the
warmed-up model trained on; every other beta converts a copy of it).

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
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rfkit.experiments.mqar_task import RESERVED_IDS, MQARError, check_mqar_settings, make_mqar, vocab_split
from rfkit.experiments.mqar_training import (
    BatchPlan,
    DataSettings,
    ModelSettings,
    SelectSettings,
    TrainSettings,
    build_model,
    convert_for_beta,
    evaluate,
    head_map_for,
    profile_model,
    train_range,
)
from rfkit.validate import fraction, in_range, is_int, one_of, positive_int

log = logging.getLogger(__name__)

MUST_BE = "{field}: must be {bounds}, got {value}"
MUST_LIE = "{field}: must lie {bounds}, got {value}"


def _parser():
    from jsonargparse import ActionConfigFile, ArgumentParser

    from rfkit.config.parse_errors import tidy_parse_error

    class Parser(ArgumentParser):
        def error(self, message, ex=None):  # one line, printed by rfkit.cli (exit 2)
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
        if i + 1 < len(argv) and Path(argv[i + 1]).is_file():
            resolve_config(argv[i + 1], command="eval mqar")  # a fit recipe: name the command that reads it
        elif i + 1 < len(argv) and not Path(argv[i + 1]).exists():
            # a catalogue name (mqar_smoke) is its packaged recipe; anything else names the nearest
            argv[i + 1] = resolve_config(argv[i + 1], command="eval mqar")
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
    positive_int(name, value, minimum, error=MQARError)


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
        fraction("betas", b, error=MQARError, message="{field}: {value} is outside {interval}; beta is the fraction of heads replaced")
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
    in_range("model.rope_theta", m.rope_theta, 0, low_open=True, error=MQARError, message=MUST_BE)
    _lengths("eval_lengths", cfg.eval_lengths)
    _lengths("data.train_lengths", d.train_lengths)
    all_pairs = [p for p in d.train_kv_pairs + d.eval_kv_pairs if is_int(p) and p >= 1]
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
    fraction("data.power_a", d.power_a, low_open=True, error=MQARError, message=MUST_LIE)
    _positive("train.steps", t.steps)
    _positive("train.warmup_steps", t.warmup_steps, 0)
    if t.warmup_steps >= t.steps:
        raise MQARError(f"train.warmup_steps: {t.warmup_steps} must be below train.steps {t.steps} (training continues after conversion)")
    in_range("train.lr", t.lr, 0, low_open=True, error=MQARError, message=MUST_BE)
    _positive("train.lr_warmup_steps", t.lr_warmup_steps, 0)
    one_of("train.schedule", t.schedule, ("cosine", "linear", "constant"), error=MQARError)
    fraction("train.min_lr_ratio", t.min_lr_ratio, error=MQARError, message=MUST_LIE)
    in_range("train.weight_decay", t.weight_decay, 0, error=MQARError, message=MUST_BE)
    in_range("train.grad_clip", t.grad_clip, 0, error=MQARError, message=MUST_BE)
    for name in ("batch_size", "eval_batch_size", "loss_window"):
        _positive(f"train.{name}", getattr(t, name))
    one_of("select.granularity", s.granularity, ("kv_group", "query_head"), error=MQARError)
    one_of("select.scope", s.scope, ("global", "per_layer"), error=MQARError)
    fraction("select.alpha", s.alpha, error=MQARError, message=MUST_LIE)
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
    from rfkit.atomic import atomic_write_json, atomic_write_text
    from rfkit.plots import line_plot

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
    from rfkit.provenance import stamp

    atomic_write_json(out_dir / "results.json", stamp(results, wall_seconds=wall))
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
