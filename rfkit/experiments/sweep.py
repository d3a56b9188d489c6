"""``rfkit sweep``: quality against cache over beta, operators and policies, from one profile
(paper Table 4 as a frontier; the reviewers' comparisons at matched cache size).

    rfkit sweep --config recipes/smollm2_b05.yaml --betas 0,0.25,0.5,0.75,0.9,1.0
                [--operators mamba,sliding_window(window=16),sink_recent(sink=4,window=16)]
                [--policies recipe,random,layerwise] [--transfer] [--trained DIR,DIR]
                [--long embedded:shakespeare] [--long-lengths 2048,8192] [--long-blocks 8]
                [--output DIR] [--val-blocks N] [--cache-length 1024] [--fit] [--device cpu]
                [recipe overrides such as --data.val_blocks 8 --trainer.max_steps 10]

``--operators`` and ``--policies`` take comma-separated specs ``NAME`` or ``NAME(key=value, ...)``
(:mod:`rfkit.conversion.registry`): aliases (operators ``mamba``, ``sliding_window``, ``sink_recent``;
policies ``recency``, ``random``, ``layerwise``), class names of plugin classes, or dotted class
paths; ``recipe`` is the recipe's own. Every policy x operator x beta is one row. Policies that
profile take the recipe policy's window, alpha and first-token setting unless the spec sets
them, so they share one cached profile. ``sink_recent(sink=4,window=16)`` holds exactly the
bytes of the default Mamba block's state, which makes the two a matched-cache comparison.

The recipe's base model is profiled once (or the cached profile reused); then for every beta the
recipe's policy selects heads from that same profile, the model is converted, and the sweep
measures validation perplexity (the recipe's validation blocks) and the cache the converted
model holds after ``--cache-length`` tokens, next to the original's.

Without ``--fit`` the converted models are evaluated as converted (new blocks untrained): this
shows which heads can go before any training, and costs minutes. ``--transfer`` runs the
recipe's attention transfer (``model.transfer``) on operators that have weights, so a Mamba
block is measured after its layer-local fit rather than silent. With ``--fit`` every row runs
the recipe's whole ``rfkit fit`` on the sweep's head map and operator (hours on CPU for real
models).

``--trained DIR,...`` adds converted models that ``rfkit fit`` saved (``runs/.../model``) as
rows of their own, measured on the same blocks: this is how trained operators (which take a
recipe of their own and minutes to hours of training each) sit next to the training-free ones in
one table. Their beta and operator come from the directory's head map and config. A trained
hybrid model (``HybridOperator``) gets a second row, ``... trained, state off``: the same model
with its state's gates closed, so the difference is what the state carries from beyond the
window, at the same cache bytes.

``--long SOURCE`` also measures every row (and the original) on long documents: the validation
documents of SOURCE (``embedded:shakespeare``: whole plays of 23,000 to 55,000 tokens) cut into
``--long-blocks`` blocks of each of ``--long-lengths`` tokens. The recipe's validation blocks
(Wikipedia summaries of ~150 tokens, packed into 512-token blocks) mostly cross document
boundaries; long documents show what a state that outlives the window is worth.

Writes ``sweep.json``, ``sweep.md`` and ``sweep.png`` (perplexity ratio against cache bytes per
token, one line per policy x operator, one point per beta; one panel per evaluation set) into
the output directory.

One module: its parts (checks, the per-row convert-and-measure loop, table and plot) share one rows format.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import shlex
import time
from pathlib import Path

from rfkit.config.args import OneLineParser, parse_betas, parse_lengths
from rfkit.config.loading import check_model_spec, parse_recipe, torch_device
from rfkit.errors import RFKitError
from rfkit.validate import POSITIVE_INTEGER, positive_int

log = logging.getLogger(__name__)

DEFAULT_BETAS = "0,0.25,0.5,0.75,0.9,1.0"


class SweepError(RFKitError):
    """Bad sweep input; one line for the user."""


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="rfkit sweep", description="Profile once, then convert and measure quality and cache per beta.", error_class=SweepError
    )
    parser.add_argument("--config", required=True, help="recipe YAML (its policy must take a beta)")
    parser.add_argument("--betas", default=DEFAULT_BETAS, help="comma-separated fractions in [0, 1]")
    parser.add_argument("--output", default=None, help="output directory (default runs/sweep_<recipe>)")
    parser.add_argument("--val-blocks", type=int, default=None, help="validation blocks for perplexity (default: the recipe's)")
    parser.add_argument("--cache-length", type=int, default=1024, help="tokens in the cache when it is measured")
    parser.add_argument("--operators", default="recipe", help="comma-separated operator specs (default: the recipe's)")
    parser.add_argument("--policies", default="recipe", help="comma-separated policy specs (default: the recipe's)")
    parser.add_argument("--transfer", action="store_true", help="run the recipe's attention transfer on trainable operators")
    parser.add_argument("--fit", action="store_true", help="run the recipe's rfkit fit for every row (slow)")
    parser.add_argument("--trained", default=None, help="comma-separated converted model directories (rfkit fit's model/) to add as rows")
    parser.add_argument("--long", default=None, metavar="SOURCE", help="also measure on long documents from SOURCE, e.g. embedded:shakespeare")
    parser.add_argument("--long-lengths", default="2048,8192", help="block lengths (tokens) for --long, comma-separated")
    parser.add_argument("--long-blocks", type=int, default=8, help="validation blocks per length for --long")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-record", action="store_true", help="do not add the results to the --trained models' cards")
    return parser


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
    args.beta_list = parse_betas(args.betas, "--betas", error=SweepError)
    from rfkit.config.catalog import resolve_config

    args.config = resolve_config(args.config, command="sweep")  # a file, or a catalogue name such as smollm2_b05
    if check_model_spec(args.config, require_converted=False, flag="--config") != "recipe":
        raise SweepError(f"--config: '{args.config}' is a directory; give a recipe YAML")
    for flag, value in (("--val-blocks", args.val_blocks), ("--cache-length", args.cache_length), ("--long-blocks", args.long_blocks)):
        positive_int(flag, value, optional=True, error=SweepError, message=POSITIVE_INTEGER)
    args.trained_dirs = [Path(p) for p in (args.trained or "").split(",") if p.strip()]
    for path in args.trained_dirs:
        if not (path / "head_map.json").is_file() or not (path / "config.json").is_file():
            raise SweepError(f"--trained: '{path}' is not a converted model directory (no head_map.json and config.json)")
    args.long_length_list = []
    if args.long is not None:
        from rfkit.data import TextDataModule
        from rfkit.hub import SourceError

        try:
            TextDataModule(source=args.long)  # checks the source's name, no data read
        except SourceError as err:
            raise SweepError(f"--long: {str(err).removeprefix('data.source: ')}") from None
        args.long_length_list = parse_lengths(args.long_lengths, "--long-lengths", error=SweepError)
        if min(args.long_length_list) < 2:  # a 1-token block has no next token to score
            raise SweepError(f"--long-lengths: blocks need at least 2 tokens, got {min(args.long_length_list)}")
    args.torch_device = torch_device(args.device)
    out = Path(args.output or f"runs/sweep_{Path(args.config).stem}")
    if out.exists() and not out.is_dir():
        raise SweepError(f"--output: '{out}' exists and is not a directory")
    args.output_dir = out


def _check_policy(policy) -> None:
    if "beta" not in inspect.signature(type(policy).__init__).parameters:
        raise SweepError(
            f"model.policy: {type(policy).__name__} does not take a beta, so there is nothing to sweep; "
            "use a ratio policy such as rfkit.conversion.policies.RecencyRatioPolicy"
        )


def _policy_at(policy, beta: float):
    """A copy of ``policy`` that replaces fraction ``beta`` (the same profile settings). A
    beta 1 row is the sweep's own reference point, so it carries the ``allow_all_heads``
    opt-in that a recipe would need (:func:`rfkit.conversion.policies.check_all_heads`)."""
    chosen = copy.copy(policy)
    chosen.beta = float(beta)
    if chosen.beta >= 1.0:
        chosen.allow_all_heads = True
    return chosen


def warn_all_heads(betas: list[float]) -> bool:
    """One warning when the sweep includes beta 1 (every head replaced), as a recipe with
    ``allow_all_heads: true`` gets; returns whether it did."""
    from rfkit.conversion.policies import ALL_HEADS_QUALITY

    if not betas or max(betas) < 1.0:
        return False
    log.warning(
        "--betas: beta 1 replaces every attention head, %s; the sweep measures it as a reference point "
        "(allow_all_heads is set for its beta 1 rows)", ALL_HEADS_QUALITY,
    )  # fmt: skip
    return True


def _name(obj, spec: str) -> str:
    """A row label: the spec as given, or the class name for the recipe's own."""
    return type(obj).__name__ if spec == "recipe" else spec.replace(" ", "")


def variants(module, policy_specs: str, operator_specs: str) -> tuple[list, list]:
    """``[(label, policy)]`` and ``[(label, operator)]`` from the command line's specs."""
    from rfkit.conversion import registry

    defaults = module.policy.profile_settings() or {}
    policies, operators = [], []
    for spec in registry.split_specs(policy_specs) or ["recipe"]:
        policy = module.policy if spec == "recipe" else registry.policy(spec, defaults)
        _check_policy(policy)
        policies.append((_name(policy, spec), policy))
    for spec in registry.split_specs(operator_specs) or ["recipe"]:
        operator = module.operator if spec == "recipe" else registry.operator(spec)
        operators.append((_name(operator, spec), operator))
    for kind, items in (("--policies", policies), ("--operators", operators)):
        labels = [label for label, _ in items]
        if len(set(labels)) != len(labels):
            raise SweepError(f"{kind}: the same spec is given twice ({', '.join(labels)})")
    return policies, operators


def long_sets(source: str, tokenizer, lengths: list[int], blocks: int) -> dict[str, list]:
    """``{"shakespeare@2048": batches, ...}``: ``blocks`` validation blocks of each length from the validation
    documents of ``source`` (its default split), one block per batch; ``tokenizer``: a spec or a ModelSource."""
    from rfkit.data import TextDataModule
    from rfkit.hub import ModelSource

    name = source.removeprefix("embedded:") if source.startswith("embedded:") else Path(source).name
    sets = {}
    for length in lengths:
        data = TextDataModule(source=source, tokenizer=getattr(tokenizer, "name", tokenizer), seq_len=length, val_blocks=blocks, calibration_samples=1, batch_size=1)
        data.model_source = tokenizer if isinstance(tokenizer, ModelSource) else None  # resolved: not again
        data.setup("validate")
        sets[f"{name}@{length}"] = [{"input_ids": block[None]} for block in data.validation]
    return sets


def measure(model, val_batches, cache_length: int, device, desc: str, long: dict | None = None) -> dict:
    """Validation perplexity and the cache after ``cache_length`` tokens (plus the analytic
    per-token K/V bytes and constant state); with ``long``, the perplexity on each of its sets."""
    from rfkit.evals.perplexity import evaluate_perplexity
    from rfkit.experiments.bench import cache_after_generation
    from rfkit.experiments.footprint import analytic_cache

    model.to(device).eval()
    ppl = evaluate_perplexity(model, val_batches, desc=desc)
    long_ppl = {name: evaluate_perplexity(model, batches, desc=f"{desc} {name}") for name, batches in (long or {}).items()}
    predicted = analytic_cache(model)
    held = cache_after_generation(model, prompt_len=1, gen_len=cache_length - 1, chunk=1024, seed=0, device=device)
    return {
        "ppl": ppl,
        "long_ppl": long_ppl,
        **{key: predicted[key] for key in ("kv_bytes_per_token", "state_bytes", "kept_kv_fraction")},
        "cache_bytes": held["total"],
        "cache_bytes_per_token": held["total"] / cache_length,
    }


def _fit(config: str, overrides: list[str], head_map_path: Path, operator, run_dir: Path) -> dict:
    """Run the recipe's ``rfkit fit`` on a fixed head map and operator; returns its summary and
    the model."""
    from rfkit.config.lightning_cli import make_cli

    cli = make_cli(
        ["fit", "--config", config, *overrides, "--model.head_map", str(head_map_path),
         "--model.operator", json.dumps(operator.to_dict()),
         "--trainer.default_root_dir", str(run_dir)],  # fmt: skip
        save_config_kwargs={"overwrite": True},
    )
    summary_path = Path(cli.trainer.log_dir or run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"summary": summary, "summary_path": str(summary_path), "model": cli.model.model}


def run(args) -> dict:
    from tqdm.auto import tqdm

    from rfkit import pipeline
    from rfkit.conversion.headmap import HeadMap
    from rfkit.models.layout import AttentionLayout

    module, datamodule = parse_recipe(args.config, args.overrides)
    policies, operators = variants(module, args.policies, args.operators)
    warn_all_heads(args.beta_list)
    device = args.torch_device
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    module.source = pipeline.resolve(module.base_model, datamodule)  # once, for every row; the data share it
    base = pipeline.load(module.source, module.dtype_name, module.trust_remote_code, device)  # profiled there too
    layout = AttentionLayout.from_config(base.config)
    datamodule.setup("fit")
    profiles, by_settings = {}, {}  # one profile per distinct setting, even with reuse_profile: false
    for label, policy in policies:
        key = json.dumps(policy.profile_settings(), sort_keys=True)
        if key not in by_settings:
            by_settings[key] = pipeline.profile(base, module.base_model, policy, datamodule, module.reuse_profile)
        profiles[label] = by_settings[key]
    val = datamodule.validation if args.val_blocks is None else datamodule.validation[: args.val_blocks]
    val_batches = [{"input_ids": val[i : i + datamodule.batch_size]} for i in range(0, len(val), datamodule.batch_size)]

    tokenizer = datamodule.tokenizer_spec()  # the base's resolution when the data's tokenizer is the base
    long = long_sets(args.long, tokenizer, args.long_length_list, args.long_blocks) if args.long else {}
    original = measure(base, val_batches, args.cache_length, device, "perplexity (original)", long)
    several = len(policies) > 1 or len(operators) > 1
    jobs = [(p, o, beta) for p in policies for o in operators for beta in args.beta_list]
    rows = []
    for (p_label, policy), (o_label, operator), beta in tqdm(jobs, desc="sweep", unit="row", disable=None):
        chosen = _policy_at(policy, beta)
        profile, data_info = profiles[p_label]
        selected = chosen.select(layout, profile)
        head_map = HeadMap.build(module.base_model, layout, profile, selected, chosen, data_info)
        tag = f"beta_{beta:g}" if not several else f"{_slug(p_label)}__{_slug(o_label)}__beta_{beta:g}"
        map_path = out / tag / "head_map.json"
        head_map.save(map_path)
        row = {"policy": p_label, "operator": o_label, "beta": beta, "replaced_heads": head_map.replaced_heads,
               "total_heads": head_map.total_heads, "transferred": False}  # fmt: skip
        t0 = time.time()
        desc = f"perplexity ({p_label}, {o_label}, beta {beta:g})" if several else f"perplexity (beta {beta:g})"
        if head_map.replaced_heads == 0:
            row.update(original, trained=False, note="no head replaced: the original model")
        elif args.fit:
            with pipeline.sharing(module.source):  # the fit resolves nothing again
                fitted = _fit(args.config, args.overrides, map_path, operator, out / tag)
            row.update(measure(fitted["model"], val_batches, args.cache_length, device, desc, long))
            row.update(trained=True, summary=fitted["summary_path"])
            del fitted
        else:
            converted, _ = pipeline.convert(copy.deepcopy(base), head_map, operator)
            if args.transfer and module.transfer_config is not None and getattr(operator, "trainable", True):
                from rfkit.training.transfer import load_long_blocks, transfer

                long_blocks = load_long_blocks(module.transfer_config, tokenizer, datamodule.seed)
                report = transfer(converted, datamodule.calibration, module.transfer_config, long_blocks=long_blocks)
                row.update(transferred=True, transfer_mse=report["mean_mse_after"], transfer_seconds=report["seconds"])
            row.update(measure(converted, val_batches, args.cache_length, device, desc, long))
            row["trained"] = False
            del converted
        rows.append(_ratios(row, original, t0))
    for path in args.trained_dirs:
        rows.extend(_trained_rows(path, val_batches, args.cache_length, device, long, original))
    result = {
        "recipe": args.config,
        "overrides": args.overrides,
        "base_model": module.base_model,
        "policy": module.policy.describe(),
        "policies": {label: policy.describe() for label, policy in policies},
        "operator": type(module.operator).__name__,
        "operators": {label: operator.to_dict() for label, operator in operators},
        "trained": bool(args.fit),
        "transfer": bool(args.transfer),
        "cache_length": args.cache_length,
        "val_blocks": int(val.shape[0]),
        "long": {"source": args.long, "lengths": args.long_length_list, "blocks": {k: len(v) for k, v in long.items()}} if long else None,
        "seq_len": int(val.shape[1]),
        "device": str(device),
        "original": original,
        "rows": rows,
        "wall_seconds": round(time.time() - started, 1),
    }
    return result


def _ratios(row: dict, original: dict, started: float) -> dict:
    row["ppl_ratio"] = row["ppl"] / original["ppl"]
    row["long_ppl_ratio"] = {k: v / original["long_ppl"][k] for k, v in row.get("long_ppl", {}).items()}
    row["cache_ratio"] = row["cache_bytes"] / original["cache_bytes"]
    row["seconds"] = round(time.time() - started, 1)
    return row


def operator_label(spec: dict) -> str:
    """``sink_recent(sink=4,window=64)`` for an operator's ``to_dict()`` (its registry alias
    when it has one, else its class name)."""
    from rfkit.classpath import public_path
    from rfkit.conversion.registry import OPERATOR_ALIASES
    from rfkit.models.operators import ReplacementOperator

    path = public_path(spec["class_path"])  # older models' config.json: rfkit.models.operators.X
    alias = next((a for a, p in OPERATOR_ALIASES.items() if p == path), path.rsplit(".", 1)[-1])
    try:  # only the settings that differ from the class's defaults
        defaults = ReplacementOperator.from_dict({"class_path": path}).init_args()
    except Exception:  # noqa: BLE001 - a plugin without defaults: every setting
        defaults = {}
    args = ",".join(f"{k}={v}" for k, v in spec.get("init_args", {}).items() if defaults.get(k, object()) != v)
    return f"{alias}({args})" if args else alias


def _trained_rows(path: Path, val_batches, cache_length: int, device, long: dict, original: dict) -> list[dict]:
    """A ``--trained`` directory measured like the other rows; its beta and operator are read
    from its head map and config. A model whose mixers can switch their state off (the hybrid)
    gets a second row without it (:func:`rfkit.models.mixer.ablate_states`): same window, same
    cache, so the gap is what the state carries from beyond the window."""
    from rfkit.config.loading import load_model
    from rfkit.conversion.headmap import HeadMap
    from rfkit.models.mixer import ablate_states

    head_map = HeadMap.load(path / "head_map.json")
    model = load_model(str(path), device=device).model
    # a model that replaced nothing (beta 0: a control with adapters) holds attention only
    spec = getattr(model.config, "rf_operator", None) or {"class_path": "unknown"}
    label = operator_label(spec) if head_map.replaced_heads else "attention"
    policy = (head_map.policy or {}).get("class_path", "recipe").rsplit(".", 1)[-1]
    base = {"policy": policy, "beta": float(head_map.beta), "replaced_heads": head_map.replaced_heads,
            "total_heads": head_map.total_heads, "transferred": True, "trained": True, "model": str(path)}  # fmt: skip
    t0 = time.time()
    rows = [_ratios({**base, "operator": f"{label} trained", **measure(model, val_batches, cache_length, device, f"perplexity ({path})", long)}, original, t0)]
    with ablate_states(model) as blocks:
        if blocks:
            t0 = time.time()
            measured = measure(model, val_batches, cache_length, device, f"perplexity ({path}, state off)", long)
            rows.append(_ratios({**base, "operator": f"{label} trained, state off", **measured}, original, t0))
    return rows


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label).strip("_")


def _mode(result: dict) -> str:
    if result["trained"]:
        mode = "after `rfkit fit`"
    elif result.get("transfer"):
        mode = "converted, attention transfer only (no end-to-end training)"
    else:
        mode = "converted, new blocks untrained"
    if any(r.get("model") for r in result["rows"]):  # --trained rows
        mode += "; `trained` rows: saved models from `rfkit fit`"
    return mode


def markdown(result: dict) -> str:
    o = result["original"]
    long_names = list(o.get("long_ppl", {}))
    long_note = ""
    if long_names:
        blocks = result["long"]["blocks"]
        long_note = " Long documents: " + ", ".join(f"{blocks[n]} validation blocks of {n}" for n in long_names) + "."
    lines = [
        f"Sweep of {result['recipe']} ({result['base_model']}, {_mode(result)}); perplexity on {result['val_blocks']} "
        f"validation blocks of {result['seq_len']} tokens; cache after {result['cache_length']} tokens.{long_note}",
        "",
        "| policy | operator | beta | heads replaced | kept KV | cache bytes/token | cache ratio | PPL | PPL ratio |"
        + "".join(f" PPL ratio {n} |" for n in long_names),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(long_names),
    ]
    length = result["cache_length"]
    lines.append(
        f"| original | attention | 0 | 0 | 100.0% | {o['cache_bytes'] / length:,.0f} | 1.000 | {o['ppl']:.2f} | 1.000 |"
        + " 1.000 |" * len(long_names)
    )
    for r in result["rows"]:
        long_ratios = r.get("long_ppl_ratio", {})
        lines.append(
            f"| {r.get('policy', '')} | {r.get('operator', '')} | {r['beta']:g} | {r['replaced_heads']}/{r['total_heads']} | "
            f"{100 * r['kept_kv_fraction']:.1f}% | {r['cache_bytes'] / length:,.0f} | {r['cache_ratio']:.3f} | "
            f"{r['ppl']:.2f} | {r['ppl_ratio']:.3f} |" + "".join(f" {long_ratios[n]:.3f} |" for n in long_names)
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Perplexity ratio against cache bytes per token: one line per policy x operator (colour:
    operator, marker and dash: policy), one point per beta; one panel per evaluation set (the
    recipe's validation blocks, then each ``--long`` set)."""
    from rfkit.plots import pyplot, save_figure

    plt = pyplot()
    panels = [("ppl_ratio", f"validation blocks of {result['seq_len']}")]
    panels += [(name, name) for name in result["original"].get("long_ppl", {})]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 + 4.5 * (len(panels) - 1), 4.8), squeeze=False)
    length = result["cache_length"]
    lines: dict[tuple, list] = {}
    for r in result["rows"]:
        lines.setdefault((r.get("policy", ""), r.get("operator", "")), []).append(r)
    policies = list(dict.fromkeys(p for p, _ in lines))
    operators = list(dict.fromkeys(o for _, o in lines))
    colours = plt.get_cmap("tab10")
    markers, dashes = "osD^v<>ph*", ["-", "--", ":", "-."]
    mode = "trained" if result["trained"] else "attention transfer only" if result.get("transfer") else "untrained"
    if any(r.get("model") for r in result["rows"]):
        mode += " + trained models"
    for ax, (key, title) in zip(axes[0], panels):
        ys_all = []
        for (policy, operator), rows in lines.items():
            rows = sorted(rows, key=lambda r: r["cache_bytes"])
            xs = [r["cache_bytes"] / length for r in rows]
            ys = [r["ppl_ratio"] if key == "ppl_ratio" else r["long_ppl_ratio"][key] for r in rows]
            ys_all += ys
            p, o = policies.index(policy), operators.index(operator)
            label = f"{policy} + {operator}" if len(lines) > 1 else result["policy"].get("class_path", "policy").rsplit(".", 1)[-1]
            ax.plot(xs, ys, color=colours(o % 10), marker=markers[p % len(markers)], ls=dashes[p % len(dashes)], label=label)
            for r, x, y in zip(rows, xs, ys):
                if len(lines) == 1 or len(panels) > 1:
                    ax.annotate(f"β={r['beta']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        o = result["original"]
        ax.plot([o["cache_bytes"] / length], [1.0], marker="*", ms=10, color="black", ls="", label="original")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if ys_all and max(ys_all) / max(min(ys_all), 1e-9) > 3:
            ax.set_yscale("log")
        ax.set_xlabel(f"cache bytes per token (after {length} tokens)")
        ax.set_ylabel("perplexity ratio (converted / original)")
        ax.set_title(f"{Path(result['recipe']).stem} ({mode}): {title}", fontsize=9)
        ax.grid(True, alpha=0.3, which="both")
    axes[0][0].legend(fontsize=6.5, ncol=2 if len(lines) > 6 else 1)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str]) -> int:
    from rfkit.experiments.reports import record_trained, write_report

    args, overrides = build_parser().parse_known_args(argv)
    args.overrides = check_overrides(overrides)
    validate(args)
    result = run(args)
    write_report(args.output_dir, "sweep", result, markdown(result), plot, "rfkit sweep " + shlex.join(argv))
    if not args.no_record:
        record_trained(result, "rfkit sweep " + shlex.join(argv))
    return 0
