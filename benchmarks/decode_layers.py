"""Where one decode token's time goes, original against converted, measured inside the running
model (cold caches, as in ``generate``), and how far the converted model is from the bound its
head map allows.

    python benchmarks/decode_layers.py --model runs/smollm2_b05/lightning_logs/version_2/model \
        --contexts 2048,8192 --runs 7 --output benchmarks/results/decode_layers/decode_layers.json

For every decode step (greedy, batch 1, after a prefill of ``context`` random tokens) a forward
hook pair times every attention layer, and in the original also its four projections. Per run,
each model decodes ``--tokens`` tokens; the two models alternate run by run; every figure is a
median over the runs of the per-run median step.

The **head-map bound** is the converted model's step if every replaced head cost nothing
beyond its share of the projections: the original's step minus, in every converted layer, the
original layer's non-projection time times the fraction of its KV heads that were replaced. It
is measured, not modelled, and is what "attention halved, everything else equal" means for this
head map (layers whose heads all stay keep their full cost).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class Stopwatch:
    """Forward-hook timers: seconds per call of each watched module, by name."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}
        self._started: dict[str, float] = {}
        self._handles = []

    def watch(self, name: str, module: torch.nn.Module) -> None:
        self.seconds[name] = []

        def pre(mod, args, kwargs):
            self._started[name] = time.perf_counter()

        def post(mod, args, kwargs, out):
            self.seconds[name].append(time.perf_counter() - self._started[name])

        self._handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post, with_kwargs=True)]

    def clear(self) -> None:
        for times in self.seconds.values():
            times.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def layer_kinds(model) -> list[dict]:
    """Per decoder layer: its class, KV heads and replaced KV heads."""
    from rfkit.models.modeling import RecurFormerAttention

    kinds = []
    kv = model.config.num_key_value_heads
    for layer in model.get_decoder().layers:
        attn = layer.self_attn
        if isinstance(attn, RecurFormerAttention):
            replaced = len(attn.mixer_kv_heads)
            kind = "converted, kept heads" if attn.has_kept else "converted, no kept heads"
        else:
            replaced, kind = 0, "unconverted"
        kinds.append({"kind": kind, "kv_heads": kv, "replaced_kv_heads": replaced})
    return kinds


@torch.no_grad()
def decode_run(model, ids: torch.Tensor, tokens: int, watch: Stopwatch) -> float:
    """Prefill ``ids`` (1, L) and decode ``tokens`` greedy tokens; the median step in seconds.
    The watch keeps only the decode steps' times."""
    from rfkit.models.cache import cache_kwargs, output_cache

    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
    watch.clear()
    steps = []
    for _ in range(tokens):
        started = time.perf_counter()
        out = model(input_ids=token, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        steps.append(time.perf_counter() - started)
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a converted model directory")
    parser.add_argument("--contexts", default="2048,8192", help="context lengths, comma separated")
    parser.add_argument("--runs", type=int, default=7, help="interleaved runs per model and context")
    parser.add_argument("--tokens", type=int, default=24, help="decode steps timed per run")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args()

    from tqdm import tqdm

    from rfkit.atomic import atomic_write_json
    from rfkit.experiments.bench import load_pair
    from rfkit.experiments.speed import random_ids
    from rfkit.provenance import cpu_pressure, stamp

    started = time.time()
    device = torch.device("cpu")
    pair = load_pair(args.model, device)
    kinds = layer_kinds(pair.converted)
    watches = {}
    for name in ("original", "converted"):
        watch = Stopwatch()
        for i, layer in enumerate(getattr(pair, name).get_decoder().layers):
            watch.watch(f"attn.{i}", layer.self_attn)
            if name == "original":
                for proj in PROJECTIONS:
                    watch.watch(f"{proj}.{i}", getattr(layer.self_attn, proj))
        watches[name] = watch

    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    bar = tqdm(total=len(contexts) * args.runs * 2, desc="decode_layers", unit="run")
    for context in contexts:
        ids = random_ids(pair.original, 1, context, 0, device)
        for name in ("original", "converted"):  # warm-up: allocator and kernels at this shape
            decode_run(getattr(pair, name), ids[:, :256], 4, watches[name])
        per_run = {name: [] for name in watches}
        for run in range(args.runs):
            for name in ("original", "converted") if run % 2 == 0 else ("converted", "original"):
                step = decode_run(getattr(pair, name), ids, args.tokens, watches[name])
                per_run[name].append({"step": step, **{k: statistics.median(v) for k, v in watches[name].seconds.items()}})
                bar.update()
        med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in per_run.items()}
        o, c = med["original"], med["converted"]
        layers = []
        saving = 0.0
        for i, kind in enumerate(kinds):
            proj = sum(o[f"{p}.{i}"] for p in PROJECTIONS)
            replaced = kind["replaced_kv_heads"] / kind["kv_heads"]
            saving += (o[f"attn.{i}"] - proj) * replaced
            layers.append({**kind, "original_us": 1e6 * o[f"attn.{i}"], "original_projections_us": 1e6 * proj, "converted_us": 1e6 * c[f"attn.{i}"]})
        by_kind = {}
        for layer in layers:
            group = by_kind.setdefault(layer["kind"], {"layers": 0, "original_ms": 0.0, "converted_ms": 0.0})
            group["layers"] += 1
            group["original_ms"] += layer["original_us"] / 1000
            group["converted_ms"] += layer["converted_us"] / 1000
        attention = {name: sum(m[f"attn.{i}"] for i in range(len(kinds))) for name, m in med.items()}
        bound = o["step"] - saving
        row = {
            "context": context,
            "step_ms_original": 1000 * o["step"],
            "step_ms_converted": 1000 * c["step"],
            "decode_ratio": o["step"] / c["step"],
            "attention_ms_original": 1000 * attention["original"],
            "attention_ms_converted": 1000 * attention["converted"],
            "rest_ms_original": 1000 * (o["step"] - attention["original"]),
            "rest_ms_converted": 1000 * (c["step"] - attention["converted"]),
            "head_map_bound_step_ms": 1000 * bound,
            "head_map_bound_ratio": o["step"] / bound,
            "by_kind": by_kind,
            "layers": layers,
            "step_ms_runs": {name: [1000 * r["step"] for r in runs] for name, runs in per_run.items()},
        }
        rows.append(row)
        bar.write(
            f"{context}: step {row['step_ms_original']:.1f} ms -> {row['step_ms_converted']:.1f} ms ({row['decode_ratio']:.3f}x); "
            f"head-map bound {row['head_map_bound_step_ms']:.1f} ms ({row['head_map_bound_ratio']:.3f}x); attention "
            f"{row['attention_ms_original']:.1f} -> {row['attention_ms_converted']:.1f} ms; rest {row['rest_ms_original']:.1f} -> {row['rest_ms_converted']:.1f} ms"
        )
    bar.close()
    for watch in watches.values():
        watch.remove()
    result = {
        "kind": "decode_layers",
        "model": args.model,
        "threads": torch.get_num_threads(),
        "runs": args.runs,
        "tokens": args.tokens,
        "cpu_pressure_after": cpu_pressure(),
        "rows": rows,
    }
    command = f"python benchmarks/decode_layers.py --model {args.model} --contexts {args.contexts} --runs {args.runs} --tokens {args.tokens} --output {args.output}"
    atomic_write_json(args.output, stamp(result, started, command))


if __name__ == "__main__":
    main()
