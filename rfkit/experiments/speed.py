"""``rfkit bench speed``: tokens/s of the original and the converted model, side by side.

Three questions a server operator asks, each measured in one process with both models
interleaved (medians of ``--runs``):

- **Prefill and decode tokens/s** at every context length and batch size (``--batch 1,4``),
  through ``model.generate`` with a clock on its streamer.
- **Throughput at a memory budget** (``--max-input 1GiB``): per context, the largest batch whose
  cache (K/V + mixer state, measured after a real prefill) fits the budget, and the decode
  tokens/s that batch gives. Half the cache means twice the sequences in the same memory.
- **Bytes one decode step reads** (every row): the weights (the output head's table once, one row
  of an input table it does not share) plus the whole cache at that context, for each model, and
  their ratio: the most a decode step can gain if memory traffic bounds it. A measured decode
  ratio near ``bytes_ratio`` is a step at the bandwidth bound; one above it gained on compute
  (the original's attention over a long cache costing more than reading it).
- **One layer's decode step** (``--layer-step``): wall time of one attention layer's forward for
  one new token (forward hooks, median over layers and steps) and the torch calls it makes
  (``TorchFunctionMode``), for the original's layers and the converted layers. A regression in
  the decode path shows here before it shows in tokens/s.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

NAMES = ("original", "converted")


def random_ids(model, batch: int, length: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(device)


class _Clock:
    """A ``generate`` streamer that timestamps the prompt and every new token."""

    def __init__(self, device):
        self.device, self.stamps = device, []

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def put(self, value) -> None:
        self.stamps.append(self.now())

    def end(self) -> None:
        pass


@torch.no_grad()
def time_generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per step) of one ``model.generate`` call on ``ids`` (B, L).
    The clock is called once per step for the whole batch."""
    clock = _Clock(ids.device)
    clock.stamps.append(clock.now())
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
    )
    # stamps: [start, prompt put (before prefill), first token (after prefill), token 2, ...]
    prefill = clock.stamps[2] - clock.stamps[0]
    decode = (clock.stamps[-1] - clock.stamps[2]) / max(1, len(clock.stamps) - 3)
    return prefill, decode


def _interleaved(pair, ids_for, runs: int, new_tokens: int, bar) -> dict:
    """``{name: {"prefill": [...], "decode": [...]}}``: both models, alternating which goes first."""
    times = {name: {"prefill": [], "decode": []} for name in NAMES}
    for name in NAMES:  # warm-up: a short run of each model
        ids = ids_for(name)
        time_generate(getattr(pair, name), ids[:, : min(ids.shape[1], 256)], 4)
    for run in range(runs):
        for name in NAMES if run % 2 == 0 else NAMES[::-1]:
            prefill, decode = time_generate(getattr(pair, name), ids_for(name), new_tokens)
            times[name]["prefill"].append(prefill)
            times[name]["decode"].append(decode)
            if bar is not None:
                bar.update(1)
    return times


def _row(times: dict, context: int, batch: int) -> dict:
    row = {"context": context, "batch": batch}
    for name in NAMES:
        row[f"prefill_tps_{name}"] = batch * context / statistics.median(times[name]["prefill"])
        row[f"decode_tps_{name}"] = batch / statistics.median(times[name]["decode"])
        row[f"prefill_s_runs_{name}"] = times[name]["prefill"]
        row[f"decode_s_per_token_runs_{name}"] = times[name]["decode"]
    row["prefill_ratio"] = row["prefill_tps_converted"] / row["prefill_tps_original"]
    row["decode_ratio"] = row["decode_tps_converted"] / row["decode_tps_original"]
    return row


def bytes_columns(pair, context: int, batch: int) -> dict:
    """``bytes_per_step_{name}`` for both models and ``bytes_ratio`` (original over converted)."""
    from rfkit.experiments.footprint import step_bytes

    row = {}
    for name in NAMES:
        row[f"bytes_per_step_{name}"] = step_bytes(getattr(pair, name), context, batch)["total"]
    row["bytes_ratio"] = row["bytes_per_step_original"] / row["bytes_per_step_converted"]
    return row


# ----------------------------------------------------------------------------- one layer's step
class _CallCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def layer_step(model, context: int, seed: int, device, steps: int = 8) -> dict:
    """One attention layer's decode step after ``context`` tokens: median wall time (µs) over
    the replaced layers (all layers for a model with none) and steps, and torch calls per step."""
    from rfkit.models.cache import cache_kwargs, output_cache
    from rfkit.models.modeling import RecurFormerAttention

    layers = [layer.self_attn for layer in model.get_decoder().layers]
    converted = [a for a in layers if isinstance(a, RecurFormerAttention)]
    watched = converted or layers
    ids = random_ids(model, 1, context + steps + 1, seed, device)
    cache = output_cache(model(input_ids=ids[:, :context], use_cache=True, logits_to_keep=1))
    stamps: list[float] = []
    counters: list[_CallCounter] = []
    clock = _Clock(device)

    def pre(module, args, kwargs):
        stamps.append(-clock.now())
        if counting:
            counters.append(_CallCounter())
            counters[-1].__enter__()

    def post(module, args, kwargs, out):
        if counting:
            counters[-1].__exit__(None, None, None)
        stamps[-1] += clock.now()

    handles = [h for a in watched for h in (a.register_forward_pre_hook(pre, with_kwargs=True), a.register_forward_hook(post, with_kwargs=True))]
    try:
        counting = False
        for t in range(steps):
            model(input_ids=ids[:, context + t : context + t + 1], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        timed = list(stamps)
        counting = True
        model(input_ids=ids[:, -1:], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    calls = [sum(c.calls.values()) for c in counters]
    return {
        "layers": len(watched),
        "step_us": 1e6 * statistics.median(timed),
        "torch_calls": statistics.median(calls),
        # per converted layer, in order: the first also builds what a token's layers share (the rotary matrix)
        "torch_calls_per_layer": calls,
    }


# ----------------------------------------------------------------------------- memory budget
def cache_bytes_per_sequence(model, context: int, seed: int, device) -> int:
    """Cache bytes (K/V + mixer state) one sequence holds after a ``context``-token prefill, measured."""
    from rfkit.models.cache import measure_cache

    return measure_cache(model, random_ids(model, 1, context, seed, device))["total"]


def budget_rows(args, pair, device, bar) -> list[dict]:
    """Per context: the largest batch whose cache fits ``args.budget`` bytes for each model, and
    the decode tokens/s at that batch (capped at ``--max-batch``)."""
    rows = []
    for context in args.contexts_list:
        row = {"context": context, "budget_bytes": args.budget}
        batches = {}
        for name in NAMES:
            per_seq = cache_bytes_per_sequence(getattr(pair, name), context, args.seed, device)
            fits = args.budget // per_seq
            row[f"cache_bytes_per_sequence_{name}"] = per_seq
            row[f"batch_fits_{name}"] = int(fits)
            batches[name] = int(min(fits, args.max_batch))
            row[f"batch_{name}"] = batches[name]
        if min(batches.values()) < 1:
            row["note"] = "a single sequence does not fit the budget"
            rows.append(row)
            continue
        ids = {name: random_ids(pair.original, batches[name], context, args.seed, device) for name in NAMES}
        times = _interleaved(pair, ids.get, args.runs, args.decode_tokens, bar)
        for name in NAMES:
            row[f"decode_tps_{name}"] = batches[name] / statistics.median(times[name]["decode"])
            row[f"decode_s_per_token_runs_{name}"] = times[name]["decode"]
        row["throughput_ratio"] = row["decode_tps_converted"] / row["decode_tps_original"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the command
def run_speed(args, pair, device) -> dict:
    from tqdm.auto import tqdm

    batches = args.batch_list
    total = len(args.contexts_list) * args.runs * 2 * (len(batches) + (args.budget is not None))
    rows, steps, budget = [], [], []
    with tqdm(total=total, desc="speed", unit="run", disable=None) as bar:
        for context in args.contexts_list:
            for batch in batches:
                ids = random_ids(pair.original, batch, context, args.seed, device)
                times = _interleaved(pair, lambda name: ids, args.runs, args.decode_tokens, bar)
                rows.append({**_row(times, context, batch), **bytes_columns(pair, context, batch)})
            if args.layer_step:
                step = {"context": context}
                for name in NAMES:
                    measured = layer_step(getattr(pair, name), context, args.seed, device)
                    step.update({f"{key}_{name}": value for key, value in measured.items()})
                steps.append(step)
        if args.budget is not None:
            budget = budget_rows(args, pair, device, bar)
    result = {
        "kind": "speed",
        "model": args.model,
        "base_model": pair.base_model,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "runs": args.runs,
        "decode_tokens": args.decode_tokens,
        "rows": rows,
        "notes": pair.notes,
    }
    if steps:
        result["layer_step"] = steps
    if args.budget is not None:
        result["budget"] = budget
        result["budget_bytes"] = args.budget
        result["max_batch"] = args.max_batch
    return result


def _bytes_ratio(row: dict) -> str:
    return f"{row['bytes_ratio']:.2f}x" if "bytes_ratio" in row else "-"  # files written before the column


def markdown(result: dict, mib) -> list[str]:
    head = ["context", "batch", "prefill tok/s original", "prefill tok/s converted", "ratio", "decode tok/s original", "decode tok/s converted", "ratio", "bytes ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        lines.append(
            f"| {r['context']:,} | {r.get('batch', 1)} | {r['prefill_tps_original']:.1f} | {r['prefill_tps_converted']:.1f} | "
            f"{r['prefill_ratio']:.2f}x | {r['decode_tps_original']:.2f} | {r['decode_tps_converted']:.2f} | "
            f"{r['decode_ratio']:.2f}x | {_bytes_ratio(r)} |"
        )
    lines.append("")
    lines.append(
        f"Median of {result['runs']} interleaved runs after a warm-up; decode over {result['decode_tokens']} "
        f"greedy tokens of `generate()`; "
        f"device {result['device']}, {result['threads']} threads. Bytes ratio: what one decode step reads "
        f"(weights and the whole cache), original over converted: the most a step bound by memory traffic can gain."
    )
    if result.get("layer_step"):
        lines += ["", "One attention layer's decode step (median over the converted layers; every layer of the original):", ""]
        lines += ["| context | original (µs) | converted (µs) | torch calls original | torch calls converted |", "|---|---|---|---|---|"]
        for s in result["layer_step"]:
            lines.append(
                f"| {s['context']:,} | {s['step_us_original']:.0f} | {s['step_us_converted']:.0f} | "
                f"{s['torch_calls_original']:.0f} | {s['torch_calls_converted']:.0f} |"
            )
    if "budget" in result:
        lines += ["", f"Decode throughput within a cache budget of {mib(result['budget_bytes'])} MiB (batch capped at {result['max_batch']}):", ""]
        lines += ["| context | batch original | batch converted | tok/s original | tok/s converted | ratio |", "|---|---|---|---|---|---|"]
        for b in result["budget"]:
            if "note" in b:
                lines.append(f"| {b['context']:,} | {b['batch_fits_original']} | {b['batch_fits_converted']} | - | - | {b['note']} |")
                continue
            lines.append(
                f"| {b['context']:,} | {b['batch_original']} (fits {b['batch_fits_original']}) | "
                f"{b['batch_converted']} (fits {b['batch_fits_converted']}) | {b['decode_tps_original']:.2f} | "
                f"{b['decode_tps_converted']:.2f} | {b['throughput_ratio']:.2f}x |"
            )
    return lines
