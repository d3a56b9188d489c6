"""``rfkit bench cache`` and ``rfkit bench speed``: the paper's cache and speed tables, measured.

    rfkit bench cache --model DIR|RECIPE --lengths 1024,10240,61440 [--prompt-len N]
                      [--max-input BYTES] [--json OUT]
    rfkit bench speed --model DIR|RECIPE --contexts 512,2048,8192,16384 [--runs 5] [--batch 1,4]
                      [--max-input BYTES] [--layer-step] [--json OUT]

``--model`` is a converted model directory (``rfkit convert`` / ``rfkit fit`` output; the
original is loaded from the base model named in its ``head_map.json``) or a recipe YAML (the
base model is converted on the spot, without training, to the architecture a fit saves: no
attention transfer and no LoRA adapters, since weights do not change cache sizes or speed).
Both models run in the same process on random token ids, as in the paper.

Every number is measured; the analytic cache prediction is printed beside the measurement,
never instead of it.

Cache lives here; the speed measurements are in :mod:`rfkit.experiments.speed`. Both share the
model pair, random inputs, parser and report.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rfkit.config.args import OneLineParser, parse_bytes, parse_lengths
from rfkit.config.loading import DTYPE_NAMES, ModelSpec, check_output_file, torch_device
from rfkit.config.loading import check_model_spec as _check_spec
from rfkit.conversion.evaluations import add_to_model
from rfkit.errors import RFKitError
from rfkit.validate import POSITIVE_INTEGER, positive_int

log = logging.getLogger(__name__)


class BenchError(RFKitError):
    """Bad bench input; the message is one line for the user."""


# ----------------------------------------------------------------------------- argument parsing
def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="rfkit bench", description="Measure cache size and speed: original vs converted.",
        error_class=BenchError, value_hints={"--max-input": " (a memory budget, like 512MiB or 2GB)"},
    )  # fmt: skip
    sub = parser.add_subparsers(dest="what", required=True, metavar="cache|speed")  # subcommands: the same errors
    common = OneLineParser(add_help=False, error_class=BenchError)
    common.add_argument("--model", required=True, help="converted model directory or recipe YAML")
    common.add_argument("--json", dest="json_out", help="also write the rows as JSON to this file")
    common.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    common.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    common.add_argument("--no-record", action="store_true", help="do not add the results to a converted model directory's card")

    cache = sub.add_parser("cache", parents=[common], help="cache bytes after l_g generated tokens (paper Tables 2, 4)")
    cache.add_argument("--lengths", default="1024,10240,61440", help="generated lengths l_g, comma separated")
    cache.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens before generation")
    cache.add_argument(
        "--chunk", type=int, default=1024, help="tokens fed per forward while growing the cache (1 = token by token)"
    )
    cache.add_argument("--max-input", default=None, help="memory budget (e.g. 512MiB): find the longest prompt that fits")
    cache.add_argument("--no-peak", action="store_true", help="skip the prefill-peak measurement")

    speed = sub.add_parser("speed", parents=[common], help="prefill and decode tokens/s at each context length")
    speed.add_argument("--contexts", default="512,2048,8192,16384", help="context lengths, comma separated")
    speed.add_argument("--runs", type=int, default=5, help="measured runs per model and context (median reported)")
    speed.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode measurement")
    speed.add_argument("--batch", default="1", help="batch sizes, comma separated (e.g. 1,4)")
    speed.add_argument(
        "--max-input", default=None,
        help="cache budget (e.g. 1GiB): per context, the largest batch that fits and its decode tokens/s",
    )  # fmt: skip
    speed.add_argument("--max-batch", type=int, default=16, help="largest batch run for --max-input (default 16)")
    speed.add_argument("--layer-step", action="store_true", help="also time one attention layer's decode step and count its torch calls")
    speed.add_argument(
        "--compile", action="store_true",
        help="run the converted model's steady decode step through torch.compile (fullgraph; CUDA and non-float32 paths)",
    )  # fmt: skip
    return parser


# ----------------------------------------------------------------------------- loading
@dataclass
class ModelPair:
    original: torch.nn.Module
    converted: torch.nn.Module
    base_model: str
    source: str
    notes: list[str] = field(default_factory=list)


def check_model_spec(spec: str) -> str:
    """Cheap checks before anything loads: 'directory' or 'recipe', else a ModelSpecError."""
    return _check_spec(spec, require_converted=True)


def load_pair(spec: str | ModelSpec, device: torch.device) -> ModelPair:
    """The original and the converted model, in eval mode on ``device``: the converted one as
    saved (:func:`rfkit.pipeline.load_saved`) or converted from the recipe to the architecture a
    fit saves, without transfer or adapters (:func:`rfkit.pipeline.prepare` with
    ``improve_model=False``), then the original from the same one resolution of the base model
    (:func:`rfkit.pipeline.load`), in the converted model's dtype or the recipe's."""
    spec = ModelSpec.of(spec, require_converted=True)
    notes = []
    converted = spec.converted(device, improve_model=False)
    if spec.kind == "directory":
        dtype = DTYPE_NAMES[converted.dtype]
    else:
        dtype = None  # the recipe's model.dtype
        notes.append("converted from the recipe without training (weights change neither cache size nor speed)")
    original = spec.original(device, dtype)
    for model in (original, converted):
        model.to(device).eval()
        model.generation_config.pad_token_id = model.generation_config.eos_token_id
    return ModelPair(original, converted, spec.base_model, spec.kind, notes)


# ----------------------------------------------------------------------------- cache
def _random_ids(model, length: int, seed: int, device) -> torch.Tensor:
    from rfkit.experiments.speed import random_ids

    return random_ids(model, 1, length, seed, device)


@torch.no_grad()
def cache_after_generation(model, prompt_len: int, gen_len: int, chunk: int, seed: int, device, progress=None) -> dict:
    """Cache bytes held after a ``prompt_len`` prompt and ``gen_len`` more tokens.

    The generated tokens are fed through the same cache ``chunk`` at a time (random ids, as in
    the paper): the cache then holds exactly the tensors that token-by-token decoding leaves
    (tested), without waiting for tens of thousands of sequential steps.
    """
    from rfkit.models.cache import cache_bytes, cache_kwargs, output_cache

    ids = _random_ids(model, prompt_len + gen_len, seed, device)
    out = model(input_ids=ids[:, :prompt_len], use_cache=True, logits_to_keep=1)
    cache = output_cache(out)
    for start in range(prompt_len, prompt_len + gen_len, chunk):
        piece = ids[:, start : min(start + chunk, prompt_len + gen_len)]
        model(input_ids=piece, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        if progress is not None:
            progress.update(piece.shape[1])
    measured = cache_bytes(cache)
    measured["tokens"] = cache.get_seq_length()
    del cache, out
    return measured


def _linux_rss() -> tuple[int, int] | None:
    """(current RSS, peak RSS) of this process in bytes, from /proc (Linux only)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _release_freed_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back, so RSS starts low
    except (OSError, AttributeError):
        pass


@torch.no_grad()
def prefill_peak(model, length: int, seed: int, device) -> dict:
    """Memory peak of one prefill of ``length`` random tokens, above what was held before.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU (Linux): the process's RSS high-water mark
    (reset just before) minus its RSS before: the cache, activations and transient attention
    buffers of the prefill, measured. Elsewhere: only the cache's tensor bytes.
    """
    from rfkit.models.cache import cache_bytes, output_cache

    ids = _random_ids(model, length, seed, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize(device)
        peak, method = torch.cuda.max_memory_allocated(device) - before, "cuda max_memory_allocated"
    else:
        _release_freed_memory()
        rss = _linux_rss()
        if rss is not None and _reset_rss_peak():
            before = _linux_rss()[0]
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            peak, method = _linux_rss()[1] - before, "cpu RSS high-water (cache + activations + attention buffers)"
        else:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            peak, method = None, "cpu cache tensors only (no RSS high-water on this OS)"
    held = cache_bytes(output_cache(out))["total"]
    del out
    return {"peak_bytes": peak if peak is not None else held, "cache_bytes": held, "method": method}


def max_input_length(model, budget: int, seed: int, device, start: int = 512, limit: int = 1 << 20) -> dict:
    """Longest prompt whose measured prefill peak fits ``budget`` bytes (paper's l_m).

    Doubles the length from ``start`` until the peak exceeds the budget, then bisects to within
    1/32 of the bracket. Every probe is a real prefill.
    """
    probes = []

    def fits(length: int) -> bool:
        peak = prefill_peak(model, length, seed, device)["peak_bytes"]
        probes.append({"length": length, "peak_bytes": peak})
        return peak <= budget

    lo, hi = 0, start
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if lo == 0:
        hi = start
    step = max(1, (hi - lo) // 32)
    while hi - lo > step:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"max_input": lo, "probes": probes}


def run_cache(args, pair: ModelPair, device) -> dict:
    from tqdm.auto import tqdm

    from rfkit.experiments.footprint import analytic_cache

    lengths = args.lengths_list
    pred = {name: analytic_cache(getattr(pair, name)) for name in ("original", "converted")}
    rows = []
    total = 2 * sum(lengths)
    with tqdm(total=total, desc="cache", unit="tok", disable=None) as bar:
        for length in lengths:
            row = {"l_g": length, "prompt_len": args.prompt_len}
            for name in ("original", "converted"):
                model = getattr(pair, name)
                m = cache_after_generation(model, args.prompt_len, length, args.chunk, args.seed, device, bar)
                row[f"kv_bytes_{name}"], row[f"state_bytes_{name}"] = m["kv"], m["state"]
                row[f"cache_bytes_{name}"] = m["total"]
            tokens = args.prompt_len + length
            row["cs"] = row["cache_bytes_converted"] / row["cache_bytes_original"]
            predicted = (pred["converted"]["kv_bytes_per_token"] * tokens + pred["converted"]["state_bytes"]) / (
                pred["original"]["kv_bytes_per_token"] * tokens
            )
            row["cs_analytic"] = predicted
            row["cs_rel_diff"] = abs(row["cs"] - predicted) / predicted
            if not args.no_peak:
                for name in ("original", "converted"):
                    peak = prefill_peak(getattr(pair, name), length, args.seed, device)
                    row[f"prefill_peak_bytes_{name}"] = peak["peak_bytes"]
                    row["peak_method"] = peak["method"]
            rows.append(row)
    result = {
        "kind": "cache",
        "model": args.model,
        "base_model": pair.base_model,
        "device": str(device),
        "kept_kv_fraction": pred["converted"]["kept_kv_fraction"],
        "analytic": pred,
        "rows": rows,
        "notes": pair.notes,
    }
    if args.max_input is not None:
        result["max_input"] = {
            name: max_input_length(getattr(pair, name), args.budget, args.seed, device)
            for name in ("original", "converted")
        }
        result["max_input_budget_bytes"] = args.budget
    return result


# ----------------------------------------------------------------------------- output
def _mib(n) -> str:
    return f"{n / 2**20:,.2f}"


def markdown(result: dict) -> str:
    lines = []
    if result["kind"] == "cache":
        peak = any("prefill_peak_bytes_original" in r for r in result["rows"])
        head = ["l_g", "cache original (MiB)", "cache converted (MiB)", "cs measured", "cs analytic", "rel. diff"]
        if peak:
            head += ["prefill peak original (MiB)", "prefill peak converted (MiB)"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in result["rows"]:
            cells = [
                f"{r['l_g']:,}",
                _mib(r["cache_bytes_original"]),
                _mib(r["cache_bytes_converted"]),
                f"{r['cs']:.4f}",
                f"{r['cs_analytic']:.4f}",
                f"{100 * r['cs_rel_diff']:.2f}%",
            ]
            if peak:
                cells += [_mib(r["prefill_peak_bytes_original"]), _mib(r["prefill_peak_bytes_converted"])]
            lines.append("| " + " | ".join(cells) + " |")
        a = result["analytic"]
        lines.append("")
        lines.append(
            f"Prompt {result['rows'][0]['prompt_len']} tokens; K/V per token {a['original']['kv_bytes_per_token']:,} B -> "
            f"{a['converted']['kv_bytes_per_token']:,} B (kept KV fraction {result['kept_kv_fraction']:.4f}); "
            f"mixer state {a['converted']['state_bytes']:,} B. Device {result['device']}."
        )
        if peak:
            lines.append(f"Prefill peak of l_g tokens in one forward: {result['rows'][0]['peak_method']}.")
        if "max_input" in result:
            mi = result["max_input"]
            lines.append(
                f"Longest prompt within {_mib(result['max_input_budget_bytes'])} MiB of prefill peak (l_m): "
                f"original {mi['original']['max_input']:,}, converted {mi['converted']['max_input']:,} tokens."
            )
    else:
        from rfkit.experiments.speed import markdown as speed_markdown

        lines += speed_markdown(result, _mib)
    for note in result.get("notes", []):
        lines.append(f"Note: {note}.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point
def validate(args) -> None:
    """Every check that needs no model, so bad input exits before anything loads."""
    if args.what == "cache":
        args.lengths_list = parse_lengths(args.lengths, "--lengths", error=BenchError)
        positive_int("--prompt-len", args.prompt_len, error=BenchError, message=POSITIVE_INTEGER)
        positive_int("--chunk", args.chunk, error=BenchError, message=POSITIVE_INTEGER)
        args.budget = None if args.max_input is None else parse_bytes(args.max_input, "--max-input", error=BenchError)
    else:
        args.contexts_list = parse_lengths(args.contexts, "--contexts", error=BenchError)
        args.batch_list = parse_lengths(args.batch, "--batch", example="1,4", error=BenchError, noun="batch sizes")
        args.budget = None if args.max_input is None else parse_bytes(args.max_input, "--max-input", error=BenchError)
        positive_int("--max-batch", args.max_batch, error=BenchError, message=POSITIVE_INTEGER)
        positive_int("--runs", args.runs, error=BenchError, message=POSITIVE_INTEGER)
        positive_int("--decode-tokens", args.decode_tokens, 2, error=BenchError, message="{field}: must be at least {minimum}, got {value}")
    from rfkit.config.catalog import resolve_model_spec

    args.torch_device = torch_device(args.device)
    check_output_file(args.json_out)
    args.model = resolve_model_spec(args.model)  # a catalogue name (smollm2_b05) is its recipe
    args.model_spec = ModelSpec(args.model, require_converted=True)  # check_model_spec's checks, once


def main(argv: list[str]) -> int:
    from rfkit.atomic import atomic_write_json

    started = time.time()
    args = build_parser().parse_args(argv)
    validate(args)
    device = args.torch_device
    pair = load_pair(args.model_spec, device)
    if getattr(args, "compile", False):
        from rfkit.models.window import compile_decode_steps

        pair.notes.append(f"compiled the steady decode step of {compile_decode_steps(pair.converted)} window mixers (torch.compile, fullgraph)")
    if args.what == "cache":
        result = run_cache(args, pair, device)
    else:
        from rfkit.experiments.speed import run_speed

        result = run_speed(args, pair, device)
    print(markdown(result))
    if args.json_out:
        from rfkit.provenance import stamp

        atomic_write_json(args.json_out, stamp(result, started, "rfkit bench " + shlex.join(argv)))
        print(f"\nJSON: {args.json_out}", file=sys.stderr)
    if not args.no_record:
        from rfkit.experiments.reports import bench_record

        key, title, rows, formats = bench_record(result)
        add_to_model(args.model, key, title, rows, "rfkit bench " + shlex.join(argv), formats)
    return 0
