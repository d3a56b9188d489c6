"""Quality against context length: long-document perplexity and passkey, per length, against the original.

The converted model, the original and a training-free streaming baseline at the same cache.

    rfkit eval context --model DIR [--baseline matched | "sink_recent(sink=4,window=64)" | none]
                       [--lengths 1024,2048,4096,8192] [--source embedded:shakespeare]
                       [--tokens 8192] [--depths 0,0.5,1] [--trials 1] [--seed 0]
                       [--no-passkey] [--output DIR] [--device cpu]

The claim it tests: a recurrent state keeps something a fixed window loses as the context grows.
All models run in one process on the same blocks and prompts:

- ``original``: the base model named in DIR's head map;
- ``converted``: DIR itself (``rfkit fit`` / ``rfkit convert`` output);
- ``converted, state off``: for a model whose mixers can switch their state off (the hybrid's
  gates close; :meth:`rfkit.models.mixer.ReplacementMixer.state_ablation`), the same model
  without its state: its window alone, at the same cache;
- the ``--baseline`` operator on DIR's head map, training-free. The default, ``matched``, is
  ``sink_recent`` with 4 sink tokens and the recent window that holds the bytes DIR's replaced
  heads hold (:func:`matched_baseline`): 4 + 64 tokens for the default hybrid in float32, 4 + 72
  in bf16, where its K/V window halves but its state stays float32. ``--baseline none`` leaves it out.

Perplexity: for each length L, ``--tokens // L`` blocks (at least one) of L tokens from the
held-out documents of ``--source`` (``embedded:shakespeare``: whole plays, so every block is
one document's running text); each block is one forward pass. Passkey
(:mod:`rfkit.evals.passkey`): a key hidden at each of ``--depths`` in prompts of each length
less the 8 answer tokens (so prompt and answer fit in L), ``--trials`` keys per depth. Cache bytes at each length are the analytic K/V bytes per token
times L plus the constant state (``rfkit bench cache`` measures the same within 0.1%).

Writes ``context.json``, ``context.md`` and ``context.png`` (perplexity ratio and passkey
accuracy against length, one line per model) to ``--output`` (default ``runs/context_<name of
DIR>``) and adds the table to DIR's model card (unless ``--no-record``). The original's and the
baseline's rows are reused from an earlier run on the same blocks and weights
(:mod:`rfkit.evals.references`; ``--no-reuse`` measures them again).
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path

from rfkit.config.args import parse_depths, parse_lengths
from rfkit.evals import references
from rfkit.evals.common import EvalError, add_model_arguments, add_reuse_argument, check_model_arguments, positive_int

DEFAULT_BASELINE = "matched"
EXAMPLE_BASELINE = "sink_recent(sink=4,window=64)"
SINK = 4  # the matched baseline's sink tokens


def add_arguments(parser) -> None:
    add_model_arguments(parser, original=False)
    parser.add_argument(
        "--baseline", default=DEFAULT_BASELINE,
        help="training-free operator on the same head map; matched (default): sink_recent at the converted heads' bytes; or none",
    )  # fmt: skip
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="context lengths in tokens, comma separated")
    parser.add_argument("--source", default="embedded:shakespeare", help="long documents whose held-out part is scored")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens scored per length: tokens // length blocks (at least 1)")
    parser.add_argument("--depths", default="0,0.5,1", help="passkey depths in [0, 1], comma separated")
    parser.add_argument("--trials", type=int, default=1, help="passkey keys per (length, depth)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the passkey keys")
    parser.add_argument("--no-passkey", action="store_true", help="perplexity only")
    add_reuse_argument(parser)
    parser.add_argument("--output", default=None, help="output directory (default runs/context_<model dir name>)")


def validate(args) -> None:
    """Every check that needs no weights."""
    check_converted_dir(args)
    args.length_list = parse_lengths(args.lengths, "--lengths", example="1024,2048", error=EvalError)
    if min(args.length_list) < 2:  # a 1-token block has no next token to score
        raise EvalError(f"--lengths: blocks need at least 2 tokens, got {min(args.length_list)}")
    args.depth_list = parse_depths(args.depths, "--depths", error=EvalError)
    positive_int(args, "tokens")
    positive_int(args, "trials")
    check_model_arguments(args, args.length_list)
    check_baseline(args)
    from rfkit.data import TextDataModule
    from rfkit.hub import SourceError

    try:
        TextDataModule(source=args.source)  # checks the source's name, no data read
    except SourceError as err:
        raise EvalError(f"--source: {str(err).removeprefix('data.source: ')}") from None
    if not args.no_passkey:
        from rfkit.evals.passkey import NEW_TOKENS, spec_tokenizer, template_tokens

        need = template_tokens(spec_tokenizer(args.model_spec)) + NEW_TOKENS
        if min(args.length_list) < need:
            raise EvalError(
                f"--lengths: {min(args.length_list)} tokens cannot hold the passkey template and its answer "
                f"({need} tokens); give longer lengths or --no-passkey"
            )
    args.output_dir = output_dir(args, "context")


def check_converted_dir(args) -> None:
    """``--model`` must be a converted model directory (its head map names the original)."""
    from rfkit.config.loading import check_model_spec

    if check_model_spec(args.model, require_converted=True) != "directory":
        raise EvalError(f"--model: '{args.model}' is a recipe; give a converted model directory (rfkit fit's model/)")


def check_baseline(args) -> None:
    """``--baseline``: ``matched`` (sized once the model loads), ``none``, or a training-free
    operator spec; sets ``args.baseline_operator`` (None for none)."""
    args.baseline_operator = None
    if args.baseline.strip().lower() == "matched":
        args.baseline_operator = "matched"  # sized once the model is loaded (matched_baseline)
    elif args.baseline.strip().lower() != "none":
        from rfkit.conversion import registry

        args.baseline_operator = registry.operator(args.baseline, "--baseline")  # a bad spec: one line
        if args.baseline_operator.trainable:
            raise EvalError(f"--baseline: '{args.baseline}' has weights to train; give a training-free operator such as {EXAMPLE_BASELINE}")


def output_dir(args, stem: str) -> Path:
    """``--output``, or ``runs/<stem>_<name of DIR>``; refused when it is a file."""
    out = Path(args.output or f"runs/{stem}_{Path(args.model).resolve().name}")
    if out.exists() and not out.is_dir():
        raise EvalError(f"--output: '{out}' exists and is not a directory")
    return out


def _blocks(source: str, tokenizer, lengths: list[int], tokens: int) -> dict[int, list]:
    from rfkit.experiments.sweep import long_sets

    return {n: next(iter(long_sets(source, tokenizer, [n], max(1, tokens // n)).values())) for n in lengths}


def models_to_measure(args, loaded, head_map, state_off: bool = True):
    """``[(name, model, state_off, training_free)]``: the models measured, each built once
    (``state_off``: run within :func:`rfkit.models.mixer.ablate_states`). The original loads
    from the base model's one resolution, in the dtype DIR declares
    (:meth:`~rfkit.config.loading.ModelSpec.original`)."""
    from rfkit import pipeline
    from rfkit.models.mixer import ablatable_mixers

    original = args.model_spec.original(args.torch_device).eval()
    models = [("original", original, False, False), ("converted", loaded.model, False, False)]
    if state_off and ablatable_mixers(loaded.model):  # mixers with a state they can switch off (the hybrid's gates)
        models.append(("converted, state off", loaded.model, True, False))
    if args.baseline_operator is not None:
        spec, operator = args.baseline.replace(" ", ""), args.baseline_operator
        if operator == "matched":  # sized to this model's bytes, now that it is loaded
            from rfkit.conversion import registry

            spec = matched_baseline(loaded.model)
            operator = registry.operator(spec, "--baseline")
        baseline, _ = pipeline.convert(copy.deepcopy(original), head_map, operator)
        baseline = baseline.to(args.torch_device).eval()
        models.append((f"{spec}, training-free", baseline, False, True))  # the spec as given or as sized
    return models


def matched_baseline(model) -> str:
    """``sink_recent(sink=4,window=W)`` whose K/V hold the bytes of ``model``'s replaced heads:
    the mixers' constant state (less each layer's 8-byte token counter, which the baseline keeps
    too) over the replaced KV heads, in tokens of K/V at the model's dtype, rounded down, less the
    4 sink tokens. It is the training-free model at the converted model's cache, in every dtype."""
    from rfkit.experiments.footprint import analytic_cache
    from rfkit.models.layout import AttentionLayout
    from rfkit.models.modeling import RecurFormerAttention

    layout = AttentionLayout.from_config(model.config)
    converted = [m for m in model.modules() if isinstance(m, RecurFormerAttention)]
    replaced_kv = sum(len(a.mixer_kv_heads) for a in converted)  # the KV heads each layer's mixer reads
    if not replaced_kv:
        raise EvalError("--baseline matched: the model replaces no KV head; give --baseline none or an operator")
    itemsize = converted[0].o_proj.weight.element_size()  # the K/V dtype (the base's)
    state = analytic_cache(model)["state_bytes"] - 8 * len(converted)
    tokens = state // (replaced_kv * 2 * layout.head_dim * itemsize)
    if tokens <= SINK:
        raise EvalError(f"--baseline matched: the replaced heads hold {tokens} tokens of K/V, no more than the {SINK} sink tokens; give --baseline with an operator")
    return f"sink_recent(sink={SINK},window={tokens - SINK})"


def measure(model, tokenizer, blocks: dict[int, list], args, name: str) -> dict:
    """Perplexity per length, passkey accuracy per length and the analytic cache of one model."""
    from rfkit.evals.perplexity import evaluate_perplexity
    from rfkit.evals.passkey import NEW_TOKENS, evaluate_passkey
    from rfkit.experiments.footprint import analytic_cache

    ppl = {n: evaluate_perplexity(model, batches, desc=f"perplexity ({name}, {n})") for n, batches in blocks.items()}
    passkey, by_depth = {}, {}
    if not args.no_passkey:  # prompt + answer within L tokens
        prompts = [n - NEW_TOKENS for n in args.length_list]
        result = evaluate_passkey(model, tokenizer, prompts, args.depth_list, args.trials, args.seed, new_tokens=NEW_TOKENS)
        passkey = {n: row["accuracy"] for n, row in zip(args.length_list, result["by_length"])}
        for n, prompt in zip(args.length_list, prompts):
            by_depth[n] = {c["depth"]: c["accuracy"] for c in result["cells"] if c["length"] == prompt}
    cache = analytic_cache(model)
    return {
        "ppl": ppl,
        "passkey": passkey,
        "passkey_by_depth": by_depth,
        "kv_bytes_per_token": cache["kv_bytes_per_token"],
        "state_bytes": cache["state_bytes"],
        "cache_bytes": {n: cache["kv_bytes_per_token"] * n + cache["state_bytes"] for n in args.length_list},
    }


def run(args) -> int:
    from rfkit.config.loading import load_model
    from rfkit.evals.passkey import NEW_TOKENS
    from rfkit.experiments.reports import write_report
    from rfkit.models.mixer import ablate_states

    start = time.time()
    loaded = load_model(args.model_spec, device=args.torch_device)
    head_map = args.model_spec.head_map
    blocks = _blocks(args.source, args.model_spec.source(), args.length_list, args.tokens)  # the base's tokenizer

    def measure_one(name, model, closed) -> dict:
        with ablate_states(model) if closed else contextlib.nullcontext():
            return measure(model, loaded.tokenizer, blocks, args, name)

    passkey_settings = None if args.no_passkey else [args.depth_list, args.trials, args.seed, NEW_TOKENS]
    settings = {"source": args.source, "lengths": args.length_list, "tokens": args.tokens, "passkey": passkey_settings}
    measured = references.measure_models(
        models_to_measure(args, loaded, head_map), measure_one, "context", settings, blocks, head_map.selected,
        not args.no_reuse,
    )  # fmt: skip
    rows = {name: {**row, "seconds": seconds, "reused": reused} for name, (row, seconds, reused) in measured.items()}
    first = rows["original"]
    for row in rows.values():
        row["ppl_ratio"] = {n: row["ppl"][n] / first["ppl"][n] for n in args.length_list}
        row["cache_ratio"] = {n: row["cache_bytes"][n] / first["cache_bytes"][n] for n in args.length_list}
    result = {
        "task": "context",
        "model": args.model,
        "base_model": head_map.model,
        "beta": head_map.beta,
        "source": args.source,
        "lengths": args.length_list,
        "tokens": args.tokens,
        "blocks": {n: len(b) for n, b in blocks.items()},
        "passkey": None if args.no_passkey else {"depths": args.depth_list, "trials": args.trials, "seed": args.seed},
        "device": str(args.torch_device),
        "rows": rows,
        "wall_seconds": round(time.time() - start, 1),
    }
    write_report(args.output_dir, "context", result, markdown(result), plot, getattr(args, "command_line", None))
    _record(args, result)
    return 0


def _record(args, result: dict) -> None:
    from rfkit.conversion.evaluations import add_to_model

    if args.no_record:
        return
    rows, formats = {}, {}
    for n in result["lengths"]:
        label = f"perplexity, {n:,} tokens"
        rows[label] = {name: row["ppl"][n] for name, row in result["rows"].items()}
        formats[label] = ".3f"
        if result["passkey"]:
            label = f"passkey accuracy, {n:,} tokens"
            rows[label] = {name: row["passkey"][n] for name, row in result["rows"].items()}
            formats[label] = ".2f"
    settings = f"{result['source']} tokens={result['tokens']} passkey={result['passkey']}"
    title = f"Quality against context length ({result['source']}, {result['tokens']:,} tokens per length; rfkit eval context)"
    add_to_model(args.model, f"context {settings}", title, rows, getattr(args, "command_line", None), formats)


def markdown(result: dict) -> str:
    lengths = result["lengths"]
    longest = lengths[-1] if lengths == sorted(lengths) else max(lengths)
    passkey = bool(result["passkey"])
    blocks = ", ".join(f"{result['blocks'][n]} x {n:,}" for n in lengths)
    lines = [
        f"Quality against context length: {result['model']} (beta {result['beta']:g}) on held-out "
        f"{result['source']} blocks ({blocks} tokens)"
        + (f"; passkey at depths {', '.join(f'{d:g}' for d in result['passkey']['depths'])}, "
           f"{result['passkey']['trials']} key(s) each" if passkey else "") + ".",
        "",
        f"| model | cache bytes at {longest:,} | cache ratio |" + "".join(f" PPL ratio {n:,} |" for n in lengths)
        + ("".join(f" passkey {n:,} |" for n in lengths) if passkey else ""),
        "|---|---:|---:|" + "---:|" * len(lengths) * (1 + passkey),
    ]  # fmt: skip
    for name, row in result["rows"].items():
        cells = [f"{row['cache_bytes'][longest]:,}", f"{row['cache_ratio'][longest]:.3f}"]
        cells += [f"{row['ppl_ratio'][n]:.3f}" for n in lengths]
        if passkey:
            cells += [f"{row['passkey'][n]:.2f}" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    first = result["rows"]["original"]["ppl"]
    lines.append("")
    lines.append("Original perplexity: " + ", ".join(f"{first[n]:.2f} at {n:,}" for n in lengths) + ".")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Perplexity ratio (and passkey accuracy) against context length, one line per model."""
    from rfkit.plots import pyplot, save_figure

    plt = pyplot()
    panels = [("ppl_ratio", "perplexity ratio (model / original)")]
    if result["passkey"]:
        panels.append(("passkey", "passkey accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    lengths = result["lengths"]
    for ax, (key, label) in zip(axes[0], panels):
        for i, (name, row) in enumerate(result["rows"].items()):
            ax.plot(lengths, [row[key][n] for n in lengths], marker="os^Dv"[i % 5], ms=10 - 2 * (i % 4), alpha=0.85, label=name)  # overlaps stay visible
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_title(f"{result['model']} (beta {result['beta']:g}), {result['source']}", fontsize=8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)
