"""``rfkit sweep``: quality against cache over beta, from one profile (paper Table 4 as a frontier).

    rfkit sweep --config recipes/smollm2_b05.yaml --betas 0,0.25,0.5,0.75,0.9,1.0
                [--output DIR] [--val-blocks N] [--cache-length 1024] [--fit] [--device cpu]
                [recipe overrides such as --data.val_blocks 8 --trainer.max_steps 10]

The recipe's base model is profiled once (or the cached profile reused); then for every beta the
recipe's policy selects heads from that same profile, the model is converted, and the sweep
measures validation perplexity (the recipe's validation blocks) and the cache the converted
model holds after ``--cache-length`` tokens, next to the original's.

Without ``--fit`` the converted models are evaluated as converted (new blocks untrained): this
shows which heads can go before any training, and costs minutes. With ``--fit`` every beta runs
the recipe's whole ``rfkit fit`` on the sweep's head map (hours on CPU for real models).

Writes ``sweep.json``, ``sweep.md`` and ``sweep.png`` (perplexity ratio against cache ratio,
one point per beta) into the output directory.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import sys
import time
from pathlib import Path

import torch

from rfkit.errors import RFKitError
from rfkit.loading import OneLineParser, check_model_spec, parse_recipe, torch_device

log = logging.getLogger(__name__)

DEFAULT_BETAS = "0,0.25,0.5,0.75,0.9,1.0"


class SweepError(RFKitError):
    """Bad sweep input; one line for the user."""


class _Parser(OneLineParser):
    error_class = SweepError


def build_parser() -> _Parser:
    parser = _Parser(prog="rfkit sweep", description="Profile once, then convert and measure quality and cache per beta.")
    parser.add_argument("--config", required=True, help="recipe YAML (its policy must take a beta)")
    parser.add_argument("--betas", default=DEFAULT_BETAS, help="comma-separated fractions in [0, 1]")
    parser.add_argument("--output", default=None, help="output directory (default runs/sweep_<recipe>)")
    parser.add_argument("--val-blocks", type=int, default=None, help="validation blocks for perplexity (default: the recipe's)")
    parser.add_argument("--cache-length", type=int, default=1024, help="tokens in the cache when it is measured")
    parser.add_argument("--fit", action="store_true", help="run the recipe's rfkit fit for every beta (slow)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser


def parse_betas(text: str) -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]`` (sorted, duplicates dropped); else a SweepError."""
    values = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise SweepError(f"--betas: '{part}' is not a number; give fractions in [0, 1] like 0,0.5,1") from None
        if not 0.0 <= value <= 1.0:
            raise SweepError(f"--betas: {value} is outside [0, 1]; beta is the fraction of heads replaced")
        values.append(value)
    if not values:
        raise SweepError("--betas: give at least one fraction in [0, 1], like 0,0.5,1")
    return sorted(set(values))


def check_overrides(extra: list[str]) -> list[str]:
    """Arguments the sweep does not know go to the recipe, like ``rfkit fit`` overrides
    (``--data.val_blocks 8``); anything else is an error."""
    for arg in extra:
        if arg.startswith("--") and arg.split("=", 1)[0].count(".") == 0:
            raise SweepError(f"unrecognized argument '{arg}'; recipe overrides look like --data.seq_len 256")
    if extra and not extra[0].startswith("--"):
        raise SweepError(f"unrecognized argument '{extra[0]}'")
    return extra


def validate(args) -> None:
    """Every check that needs no model weights."""
    args.beta_list = parse_betas(args.betas)
    if check_model_spec(args.config, require_converted=False, flag="--config") != "recipe":
        raise SweepError(f"--config: '{args.config}' is a directory; give a recipe YAML")
    for flag, value in (("--val-blocks", args.val_blocks), ("--cache-length", args.cache_length)):
        if value is not None and value < 1:
            raise SweepError(f"{flag}: must be a positive integer, got {value}")
    args.torch_device = torch_device(args.device)
    out = Path(args.output or f"runs/sweep_{Path(args.config).stem}")
    if out.exists() and not out.is_dir():
        raise SweepError(f"--output: '{out}' exists and is not a directory")
    args.output_dir = out


def _check_policy(policy) -> None:
    if "beta" not in inspect.signature(type(policy).__init__).parameters:
        raise SweepError(
            f"model.policy: {type(policy).__name__} does not take a beta, so there is nothing to sweep; "
            "use a ratio policy such as rfkit.policies.RecencyRatioPolicy"
        )


def _policy_at(policy, beta: float):
    """A copy of ``policy`` that replaces fraction ``beta`` (the same profile settings)."""
    chosen = copy.copy(policy)
    chosen.beta = float(beta)
    return chosen


def measure(model, val_batches, cache_length: int, device, desc: str) -> dict:
    """Validation perplexity and the cache after ``cache_length`` tokens (plus the analytic
    per-token K/V bytes and constant state)."""
    from rfkit.bench import analytic_cache, cache_after_generation
    from rfkit.callbacks.perplexity import evaluate_perplexity

    model.to(device).eval()
    ppl = evaluate_perplexity(model, val_batches, desc=desc)
    predicted = analytic_cache(model)
    held = cache_after_generation(model, prompt_len=1, gen_len=cache_length - 1, chunk=1024, seed=0, device=device)
    return {
        "ppl": ppl,
        "kv_bytes_per_token": predicted["kv_bytes_per_token"],
        "state_bytes": predicted["state_bytes"],
        "kept_kv_fraction": predicted["kept_kv_fraction"],
        "cache_bytes": held["total"],
    }


def _fit(config: str, overrides: list[str], head_map_path: Path, run_dir: Path) -> dict:
    """Run the recipe's ``rfkit fit`` on a fixed head map; returns its summary and the model."""
    from rfkit.cli import make_cli

    cli = make_cli(
        ["fit", "--config", config, *overrides, "--model.head_map", str(head_map_path),
         "--trainer.default_root_dir", str(run_dir)],  # fmt: skip
        save_config_kwargs={"overwrite": True},
    )
    summary_path = Path(cli.trainer.log_dir or run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"summary": summary, "summary_path": str(summary_path), "model": cli.model.model}


def run(args) -> dict:
    from tqdm.auto import tqdm

    from rfkit.convert import convert, load_base_model, profile_for
    from rfkit.headmap import HeadMap
    from rfkit.layout import AttentionLayout

    module, datamodule = parse_recipe(args.config, args.overrides)
    _check_policy(module.policy)
    device = args.torch_device
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    base = load_base_model(module.base_model, module.dtype_name, module.trust_remote_code)
    profile, data_info = profile_for(base, module.base_model, module.policy, datamodule, module.reuse_profile)
    layout = AttentionLayout.from_config(base.config)
    datamodule.setup("fit")
    val = datamodule.validation if args.val_blocks is None else datamodule.validation[: args.val_blocks]
    val_batches = [{"input_ids": val[i : i + datamodule.batch_size]} for i in range(0, len(val), datamodule.batch_size)]

    original = measure(base, val_batches, args.cache_length, device, "perplexity (original)")
    rows = []
    for beta in tqdm(args.beta_list, desc="sweep", unit="beta", disable=None):
        policy = _policy_at(module.policy, beta)
        selected = policy.select(layout, profile)
        head_map = HeadMap.build(module.base_model, layout, profile, selected, policy, data_info)
        tag = f"beta_{beta:g}"
        map_path = out / tag / "head_map.json"
        head_map.save(map_path)
        row = {"beta": beta, "replaced_heads": head_map.replaced_heads, "total_heads": head_map.total_heads}
        t0 = time.time()
        if head_map.replaced_heads == 0:
            row.update(original, trained=False, note="no head replaced: the original model")
        elif args.fit:
            fitted = _fit(args.config, args.overrides, map_path, out / tag)
            row.update(measure(fitted["model"], val_batches, args.cache_length, device, f"perplexity (beta {beta:g})"))
            row.update(trained=True, summary=fitted["summary_path"])
            del fitted
        else:
            converted = convert(copy.deepcopy(base), head_map, module.operator)
            row.update(measure(converted, val_batches, args.cache_length, device, f"perplexity (beta {beta:g})"))
            row["trained"] = False
            del converted
        row["ppl_ratio"] = row["ppl"] / original["ppl"]
        row["cache_ratio"] = row["cache_bytes"] / original["cache_bytes"]
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
    result = {
        "recipe": args.config,
        "overrides": args.overrides,
        "base_model": module.base_model,
        "policy": module.policy.describe(),
        "operator": type(module.operator).__name__,
        "trained": bool(args.fit),
        "cache_length": args.cache_length,
        "val_blocks": int(val.shape[0]),
        "seq_len": int(val.shape[1]),
        "device": str(device),
        "original": original,
        "rows": rows,
        "wall_seconds": round(time.time() - started, 1),
    }
    return result


def markdown(result: dict) -> str:
    mode = "after `rfkit fit`" if result["trained"] else "converted, new blocks untrained"
    lines = [
        f"Sweep of {result['recipe']} ({result['base_model']}, {mode}); perplexity on {result['val_blocks']} "
        f"validation blocks of {result['seq_len']} tokens; cache after {result['cache_length']} tokens.",
        "",
        "| beta | heads replaced | kept KV | cache bytes | cache ratio | PPL | PPL ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    o = result["original"]
    lines.append(f"| original | 0 | 100.0% | {o['cache_bytes']:,} | 1.000 | {o['ppl']:.2f} | 1.000 |")
    for r in result["rows"]:
        lines.append(
            f"| {r['beta']:g} | {r['replaced_heads']}/{r['total_heads']} | {100 * r['kept_kv_fraction']:.1f}% | "
            f"{r['cache_bytes']:,} | {r['cache_ratio']:.3f} | {r['ppl']:.2f} | {r['ppl_ratio']:.3f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    from rfkit.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["cache_ratio"] for r in result["rows"]]
    ys = [r["ppl_ratio"] for r in result["rows"]]
    ax.plot(xs, ys, marker="o", label=result["policy"].get("class_path", "policy").rsplit(".", 1)[-1])
    for r, x, y in zip(result["rows"], xs, ys):
        ax.annotate(f"β={r['beta']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    if max(ys) / max(min(ys), 1e-9) > 20:
        ax.set_yscale("log")
    ax.set_xlabel(f"cache ratio (converted / original, {result['cache_length']} tokens)")
    ax.set_ylabel("perplexity ratio (converted / original)")
    ax.set_title(f"quality vs cache: {Path(result['recipe']).stem} ({'trained' if result['trained'] else 'untrained'})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str]) -> int:
    from rfkit.headmap import atomic_write_json, atomic_write_text

    try:
        args, overrides = build_parser().parse_known_args(argv)
        args.overrides = check_overrides(overrides)
        validate(args)
        result = run(args)
    except (RFKitError, ValueError) as err:
        from rfkit.cli import one_line, user_error

        found = err if isinstance(err, RFKitError) else user_error(err)
        if found is None:
            raise
        sys.stderr.write(f"rfkit sweep: error: {one_line(found)}\n")
        return 2
    out = args.output_dir
    atomic_write_json(out / "sweep.json", result)
    table = markdown(result)
    atomic_write_text(out / "sweep.md", table + "\n")
    plot(result, out / "sweep.png")
    print(table)
    print(f"\nsweep.json, sweep.md, sweep.png -> {out}")
    return 0
