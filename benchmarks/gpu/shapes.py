"""Memory and speed of rfkit's converted models at the true shapes of the paper's models, with
random weights, original against converted in one process.

    python benchmarks/gpu/shapes.py speed  --output DIR [--tiny] [--device cuda|cpu] [--budget-s S]
    python benchmarks/gpu/shapes.py table2 --output DIR [--tiny] [--device cuda|cpu] [--budget-s S]
                                           [--shapes llama2-7b,qwen2-7b] [--operators mamba,hybrid]
    (also: --resume, --contexts, --batches, --runs, --decode-tokens, --memory-limit, --dtype; --help)

Random weights are enough for bytes and tokens/s: neither depends on the values. The models are
built on the device in bf16 straight from their configs (``from_config`` under ``torch.device``;
a 7B model initialised on the CPU would take minutes), and the heads are drawn with
:class:`rfkit.conversion.policies.RandomHeads` (``kv_group``, seed 0): random weights carry no
recency for :class:`~rfkit.conversion.policies.RecencyRatioPolicy` to find. The operators and betas
are read from the recipes the paper's settings live in (``recipes/*.yaml``), so this measures
exactly what those recipes would convert.

``speed``: SmolLM2-135M's shape (the embedded model's ``config.json`` when it is on disk), beta 0.5,
the default recipe's hybrid operator; prefill and decode tokens/s at contexts 2,048 / 8,192 / 32,768
and batch 1 and 16, with the converted model's decode step eager and then compiled
(:func:`rfkit.models.window.compile_decode_steps`, as ``rfkit bench speed --compile``). Each cell
is ``rfkit bench speed``'s own measurement (:func:`rfkit.experiments.speed._interleaved`: medians of
``--runs`` interleaved ``generate()`` calls after a warm-up). A cell whose cache and activations
would not fit the free memory is skipped, with the bytes that decided it.

``table2``: the paper's Table 2 shapes, Llama-2-7B (MHA) and Qwen2-7B (GQA) at beta 0.9 and
Qwen2-0.5B at beta 0.5, each with the paper's Mamba operator and rfkit's hybrid:

- cache bytes after a 64-token prompt and 10,240 / 61,440 generated tokens, measured
  (:func:`rfkit.experiments.bench.cache_after_generation`, chunked prefill) beside the analytic
  prediction (:func:`rfkit.experiments.bench.analytic_cache`) and the paper's cs;
- the longest prompt one prefill fits in the GPU memory left after the model's weights (l_m), each
  model alone on the GPU. Every probe is :func:`rfkit.experiments.bench.prefill_peak`; the search
  is :func:`max_input_search` below, not ``bench.max_input_length``: that one doubles the length
  until the peak passes the budget, and with the budget at the device's free memory the doubling
  probe dies of an out-of-memory error instead of reporting a peak. This search counts such a probe
  as a failure, predicts the limit from the measured peaks (linear in the length) and stops after
  4 probes, within 1.5% (or 1,024 tokens), or at the cap (131,072 tokens: reported as ">= cap");
- decode tokens/s at 8,192 and 32,768 tokens, batch 1, original vs converted, as in ``speed``. If a
  prefill of the whole prompt runs out of memory (the Mamba operator's PyTorch scan holds
  (L, d_inner, d_state) float32 tensors without mamba-ssm), the row says so and the cell is
  measured again with the prompt prefilled in chunks of 4,096 tokens and the decode as a greedy
  forward loop, for both models.

- what the hybrid recipe's head choice costs where it measures heads (``StreamedLossPolicy``: the
  beta 0.9 hybrids): the pass that keeps every layer's output on the policy's blocks (random ids),
  then a few KV groups spread over the layers each streamed, timed and extrapolated to every group
  (:func:`heads_numbers`), with the peak memory.

Order within a shape: the original's cache and l_m (alone), then per operator: the converted model,
its cache, the decode pair, then (the original freed) its l_m; last the head measurement, on the
original built again. Memory is freed between models.

Output, rewritten atomically after every measurement (a run killed by a time limit leaves every
finished row): ``DIR/{speed,table2}.json`` (one row per measurement, with device, dtype, versions
and wall seconds) and ``DIR/{speed,table2}.md``. ``--budget-s`` stops starting measurements once
the run has taken that long; the rest are rows with ``"skipped": "time budget"``. ``--resume``
keeps the finished rows of an earlier run in ``DIR`` and measures only the others.

``--tiny``: the same code path on tiny configs of the same families (2 layers, width 64), short
lengths, ``aot_eager`` instead of inductor for the compiled step; it runs in CI on the CPU.

Time on one H100 (estimates, not measured: 3.35 TB/s; ~500 TFLOP/s bf16 in big GEMMs and flash
attention, ~250 in masked attention; float32 GEMMs ~50 TFLOP/s, TF32 being off by default; HF
eager decode pays ~0.3-0.5 ms of kernel launches per layer and token):

- speed, ~1.5-2.5 min: imports, CUDA start and two 135M builds ~20 s. A decode token is launch
  bound (~10-15 ms for 30 layers) except at batch 16 x 32k, where the 12 GB K/V (read, and copied
  by DynamicCache's per-step cat) adds ~8 ms. A cell is 2 models x (3 runs + a 256-token warm-up)
  x (prefill + 16 tokens): 32k x 16 ~14 s (its prefill is ~2-3 s: 6e14 FLOP of attention),
  8k x 16 ~4 s, the batch-1 cells ~3 s: ~30 s eager, as much compiled, plus inductor compiling the
  steady step in the first compiled warm-up (~20-60 s).
- table2, ~4-5 min in all; split it with --shapes (and --resume after a kill) if a call must be
  shorter. Builds ~3-5 s each (random init on the GPU; 5 per 7B shape, the original twice).
  Llama-2-7B ~2.3 min: original cache 10k + 61k ~6 s (61k tokens: 8e14 FLOP of weights and 1e15 of
  4k-chunk masked attention; 30 GiB of K/V); original l_m 3 probes ~18 s (a prefill of L tokens is
  1.3e10 L FLOP plus 2 L^2 x 4096 x 32 of flash attention: ~1.5 s at 32k, ~8 s at 100k); Mamba:
  its blocks are 2.8e9 float32 weights (11 GB), so its cache rows take ~12 s, decode at 8k ~10 s
  and at 32k ~30 s (the whole-prompt prefill runs out of memory, then both models are measured
  with the chunked prefill), l_m ~10 s (~25-30k tokens: the PyTorch scan holds ~5 tensors of
  L x d_inner x 16 float32); hybrid: cache ~4 s, decode 8k ~5 s, 32k ~15 s (a 7B decode token is
  13.5 GB of weights, ~5 ms, plus ~15 ms of launches; each 32k prefill ~1.5 s), l_m 2 probes ~12 s
  (32k, then the 131,072 cap). Qwen2-7B ~1.8 min (its Mamba blocks are small: 4 KV heads a layer;
  its l_m probes reach the cap: ~11 s for 131k tokens). Qwen2-0.5B ~0.5 min. The head measurement
  of each 7B shape ~10-15 s (a build, two passes over 8,192 or 12,288 tokens, 4 groups from their
  layers on).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
MiB, GiB = 2**20, 2**30
NOTE_RANDOM = (
    "weights are random (from_config, seed 0) and the replaced heads were chosen at random "
    "(RandomHeads, kv_group, seed 0): neither changes cache bytes or speed"
)

# ----------------------------------------------------------------------------- the shapes
# SmolLM2-135M-Instruct as rfkit embeds it (rfkit/hub.py); its config.json on disk wins when present
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, vocab_size=49152, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LLAMA2_7B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    vocab_size=32000, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
QWEN2_7B = dict(  # Qwen2 projections carry q/k/v biases in every config
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
    max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
)  # fmt: skip
QWEN2_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
    max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
)  # fmt: skip
# tiny configs of the same families (2 layers, width 64): the --tiny rehearsal
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256, bos_token_id=1, eos_token_id=2)
TINY_HEADS = {
    "smollm2-135m": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama2-7b": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16),  # MHA
    "qwen2-7b": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8),  # GQA, 8 KV groups: beta 0.9 keeps one
    "qwen2-0.5b": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}

SHAPES = {
    "smollm2-135m": {"family": "llama", "config": SMOLLM2, "recipes": {"hybrid": "smollm2_b05.yaml"}},
    "llama2-7b": {
        "family": "llama", "config": LLAMA2_7B,
        "recipes": {"mamba": "llama2_b09.yaml", "hybrid": "llama2_b09_hybrid.yaml"},
        # the paper's Table 2 (its Mamba operator, one A100-80G): cs at 10k / 60k, l_m original -> converted
        "paper": {"cs": {10240: 0.1030, 61440: 0.1000}, "max_input": {"original": 71680, "converted": 91800}},
    },
    "qwen2-7b": {
        "family": "qwen2", "config": QWEN2_7B,
        "recipes": {"mamba": "qwen2_7b_b09.yaml", "hybrid": "qwen2_7b_b09_hybrid.yaml"},
        "paper": {"cs": {10240: 0.1268, 61440: 0.1252}, "max_input": {"original": 122880, "converted": 132000}},
    },
    "qwen2-0.5b": {
        "family": "qwen2", "config": QWEN2_05B,
        "recipes": {"mamba": "qwen2_05b_b05.yaml", "hybrid": "qwen2_05b_b05_hybrid.yaml"},
        "paper": {"cs": {10240: 0.4390, 61440: 0.4375}, "max_input": {"original": 133120, "converted": 137216}},
    },
}  # fmt: skip
TABLE2_SHAPES = ("llama2-7b", "qwen2-7b", "qwen2-0.5b")

# lengths and repetitions: the GPU run and the --tiny rehearsal
SETTINGS = {
    False: dict(
        speed_contexts=[2048, 8192, 32768], speed_batches=[1, 16], decode_contexts=[8192, 32768],
        cache_lengths=[10240, 61440], prompt_len=64, cache_chunk=4096, decode_chunk=4096,
        probe_start=32768, probe_cap=131072, probe_step=1024, max_probes=4, runs=3, decode_tokens=16,
        compile_backend=None, heads_lengths=None, heads_units=4,
    ),
    True: dict(
        speed_contexts=[256, 1024], speed_batches=[1, 4], decode_contexts=[256, 1024],
        cache_lengths=[256, 1024], prompt_len=16, cache_chunk=128, decode_chunk=128,
        probe_start=256, probe_cap=4096, probe_step=64, max_probes=4, runs=2, decode_tokens=4,
        compile_backend="aot_eager", heads_lengths=[64, 128], heads_units=2,
    ),
}  # fmt: skip
TINY_PROBE_BUDGET = 4 * MiB  # --tiny l_m budget on the CPU (prefill peak measured as RSS growth)


class ShapesError(Exception):
    """Bad input; one line for the user."""


# ----------------------------------------------------------------------------- environment
def human(n: float) -> str:
    """Bytes for a log line: GiB from 1 GiB up, else MiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` means the device ran out of memory: the allocator's ``OutOfMemoryError`` or
    a library's own failed allocation (cuBLAS / cuDNN workspaces raise a plain RuntimeError)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def free_memory(device: torch.device) -> None:
    """Give back what the models and caches that are gone held (call after dropping references)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(device: torch.device, limit: int | None) -> dict:
    """Memory a measurement may still use: ``--memory-limit`` when given, else the device's free
    memory (CUDA: ``mem_get_info`` after giving cached blocks back; CPU: MemAvailable) less a
    margin for the allocator's rounding and fragmentation (2 GiB or 3% of the total, the larger)."""
    if limit is not None:
        return {"available_bytes": limit, "how": "--memory-limit"}
    free_memory(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        margin = max(2 * GiB, int(0.03 * total))
        return {
            "available_bytes": max(0, free - margin), "free_bytes": free, "total_bytes": total, "margin_bytes": margin,
            "allocated_bytes": torch.cuda.memory_allocated(device), "how": "cuda mem_get_info free - margin",
        }  # fmt: skip
    free = _meminfo_available() or 0
    margin = max(2 * GiB, free // 10)
    return {"available_bytes": max(0, free - margin), "free_bytes": free, "margin_bytes": margin, "how": "MemAvailable - margin"}


# ----------------------------------------------------------------------------- models
def shape_config(name: str, tiny: bool):
    """The HF config of a shape and where its numbers come from."""
    from transformers import LlamaConfig, Qwen2Config

    spec = SHAPES[name]
    cls = LlamaConfig if spec["family"] == "llama" else Qwen2Config
    fields, source = dict(spec["config"]), "rfkit's copy of the published config (benchmarks/gpu/shapes.py)"
    if tiny:
        fields = {**{k: v for k, v in fields.items() if k == "tie_word_embeddings"}, **TINY, **TINY_HEADS[name]}
        source = "tiny config of the same family (--tiny)"
    elif name == "smollm2-135m":
        from rfkit.hub import EMBEDDED_MODEL, read_model_config

        found = read_model_config(EMBEDDED_MODEL)
        if found is not None:
            on_disk, path = found
            keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "vocab_size", "tie_word_embeddings")  # fmt: skip
            differs = [k for k in keys if k in on_disk and on_disk[k] != fields.get(k)]
            fields = {k: v for k, v in on_disk.items() if not k.startswith("_") and k not in ("architectures", "dtype", "transformers_version", "model_type")}
            source = f"{path}" + (f" (differs from the built-in copy in {differs})" if differs else " (matches the built-in copy)")
    return cls(**fields), source


def _model_section(recipe: str) -> dict:
    """The ``model`` section of ``recipes/<recipe>``."""
    import yaml

    return yaml.safe_load((RECIPES / recipe).read_text())["model"]


def read_recipe(recipe: str) -> tuple:
    """``(operator, beta, recipe path)`` of a recipe's ``model`` section."""
    from rfkit.models.operators import ReplacementOperator

    model = _model_section(recipe)
    operator = ReplacementOperator.from_dict(model["operator"])
    return operator, float(model["policy"]["init_args"]["beta"]), f"recipes/{recipe}"


def read_streamed_policy(recipe: str) -> dict | None:
    """The ``init_args`` of a recipe's policy when it ranks heads by measured loss
    (``StreamedLossPolicy``), else None."""
    policy = _model_section(recipe)["policy"]
    return dict(policy.get("init_args") or {}) if policy["class_path"].endswith("StreamedLossPolicy") else None


def _param_summary(model) -> dict:
    from rfkit.models.precision import is_new_weight

    dtypes: dict[str, set] = {"pretrained": set(), "new": set()}
    new_bytes = total = 0
    devices = set()
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        new = is_new_weight(f".{name}")
        new_bytes += size if new else 0
        dtypes["new" if new else "pretrained"].add(str(p.dtype).replace("torch.", ""))
        devices.add(str(p.device))
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    return {
        "param_bytes": total, "new_param_bytes": new_bytes, "devices": sorted(devices),
        "dtypes": {k: sorted(v) for k, v in dtypes.items() if v},
    }  # fmt: skip


def build_original(name: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    """A random-init model of the shape, built on ``device`` in ``dtype`` (never on the CPU first),
    with SDPA attention, in eval mode; and its description."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    config, source = shape_config(name, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval()  # a no-op unless something was made off the device despite the context
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info = {"config_source": source, "class": type(model).__name__, **_param_summary(model)}
    info["build_s"] = round(time.perf_counter() - started, 2)
    return model, info


def build_converted(name: str, tiny: bool, device: torch.device, dtype: torch.dtype, operator, beta: float):
    """A fresh random-init model of the shape converted in place on ``device``: RandomHeads picks
    the heads (``select_heads`` + ``convert``, rfkit's conversion steps). The swapped-out attention
    modules (``model.rf_originals``, kept for the shared teacher in training) are dropped."""
    from rfkit.conversion.convert import convert, select_heads
    from rfkit.conversion.policies import RandomHeads

    started = time.perf_counter()
    model, original = build_original(name, tiny, device, dtype)
    head_map = select_heads(model, f"random:{name}", RandomHeads(beta=beta, seed=0, granularity="kv_group"))
    with torch.device(device):  # new layers are made on the device (the CPU would init them first)
        model = convert(model, head_map, operator)
    model.rf_originals.clear()
    model.to(device).eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    free_memory(device)
    heads = sum(len(h) for h in head_map.selected)
    total = head_map.num_layers * head_map.num_heads
    info = {"config_source": original["config_source"], "class": type(model).__name__, "replaced_heads": heads, "heads": total,
            **_param_summary(model)}  # fmt: skip
    info["build_s"] = round(time.perf_counter() - started, 2)
    return model, info


class Lazy:
    """A model built on first use and dropped on :meth:`drop` (built again if used again)."""

    def __init__(self, build, device):
        self._build, self.device, self.model, self.info = build, device, None, None

    def get(self):
        if self.model is None:
            self.model, self.info = self._build()
        return self.model

    def drop(self) -> None:
        if self.model is not None:
            self.model = None
            free_memory(self.device)


# ----------------------------------------------------------------------------- the record
KEY_FIELDS = ("measurement", "shape", "operator", "model", "context", "batch", "compiled", "generated_tokens")


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY_FIELDS)


class Record:
    """The rows of one run, written to ``DIR/<kind>.json`` and ``.md`` after every measurement."""

    def __init__(self, out_dir: Path, kind: str, meta: dict, budget_s: float | None, resume: bool, argv: list[str]):
        import transformers

        self.json_path, self.md_path = out_dir / f"{kind}.json", out_dir / f"{kind}.md"
        self.started = time.time()
        self.budget_s, self.argv = budget_s, argv
        self.env = {"torch": torch.__version__, "transformers": transformers.__version__}
        self.result = {"kind": kind, **meta, "rows": []}
        self.done: dict[tuple, dict] = {}
        self.stamped = False
        if resume and self.json_path.exists():
            import json

            for row in json.loads(self.json_path.read_text()).get("rows", []):
                if "skipped" not in row and "error" not in row:
                    self.done[row_key(row)] = row
                    self.result["rows"].append(row)

    def elapsed(self) -> float:
        return time.time() - self.started

    def find(self, **ident) -> dict | None:
        """A finished row (this run's or a resumed one's) with these key fields."""
        key = row_key(ident)
        for row in self.result["rows"]:
            if row_key(row) == key and "skipped" not in row and "error" not in row:
                return row
        return None

    def measure(self, ident: dict, fn, device: torch.device) -> dict | None:
        """Run ``fn() -> dict of numbers`` for the row ``ident`` unless it is done already (resumed)
        or the time budget is spent (then a skipped row); out-of-memory and other errors become the
        row's ``error``. Returns the finished row, or None."""
        key = row_key(ident)
        if key in self.done:
            return self.done[key]
        if self.budget_s is not None and self.elapsed() >= self.budget_s:
            self.add({**ident, "skipped": "time budget"}, 0.0)
            return None
        started = time.perf_counter()
        oom = False
        try:
            numbers = fn()
        except Exception as err:  # one failed measurement must not cost the rest of a lent GPU's time
            oom, first = is_oom(err), (str(err).splitlines() or [""])[0][:300]
            if not oom:
                traceback.print_exc()
            row = {**ident, "error": f"out of memory: {first}" if oom else f"{type(err).__name__}: {first}"}
        else:
            row = {**ident, **numbers}
        if oom:
            free_memory(device)
        self.add(row, time.perf_counter() - started)
        return row if "error" not in row and "skipped" not in row else None

    def add(self, row: dict, wall_s: float) -> None:
        row.update(self.env, device=self.result["device"], dtype=self.result["dtype"], wall_s=round(wall_s, 2))
        self.result["rows"].append(row)
        self.write()
        print(f"[{self.elapsed():7.1f}s] {summary_line(row)}", flush=True)

    def write(self) -> None:
        from rfkit.atomic import atomic_write_json, atomic_write_text
        from rfkit.provenance import command_line, stamp

        self.result["elapsed_s"] = round(self.elapsed(), 1)
        if not self.stamped:  # the git state is read once, the wall time on every write
            stamp(self.result, self.started, command_line(self.argv), replace=True)
            self.stamped = True
        self.result["provenance"]["wall_seconds"] = round(self.elapsed(), 1)
        atomic_write_json(self.json_path, self.result)
        atomic_write_text(self.md_path, markdown(self.result))


# ----------------------------------------------------------------------------- measurements
def model_row(lazy: Lazy) -> dict:
    lazy.get()
    return dict(lazy.info)


def heads_numbers(model, policy: dict, settings: dict, device) -> dict:
    """What the recipe's measured-loss head ranking (``StreamedLossPolicy``) costs at this shape:
    the pass that keeps every layer's output, then ``heads_units`` KV groups spread over the
    layers each streamed on the policy's blocks (random token ids; ``heads_lengths`` in the
    rehearsal), extrapolated to every group of the model (one rank; N ranks share the groups)."""
    from rfkit.conversion.streamed_loss import StreamedLossPolicy, streamed_losses
    from rfkit.models.layout import AttentionLayout

    layout = AttentionLayout.from_config(model.config)
    policy = StreamedLossPolicy(**policy)  # the recipe's own checks and defaults
    lengths, counts = (list(x) for x in zip(*policy.lengths()))
    lengths = settings["heads_lengths"] or lengths
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, model.config.vocab_size, (1, n), generator=generator)}
               for n, count in zip(lengths, counts) for _ in range(count)]  # fmt: skip
    k = min(settings["heads_units"], layout.num_layers)
    layers = sorted({round(i * (layout.num_layers - 1) / max(k - 1, 1)) for i in range(k)})
    units = [(layer, layout.query_heads_of(0)) for layer in layers]
    sink, recent = policy.sink, policy.recent
    seconds = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for measured in ([], units):  # the kept pass alone, then with the units
        started = time.perf_counter()
        streamed_losses(model, batches, measured, sink, recent, progress=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    per_unit = max(seconds[1] - seconds[0], 0.0) / len(units)
    total = layout.num_layers * layout.num_kv_heads
    return {
        "lengths": lengths, "blocks": counts, "sink": sink, "recent": recent, "units_total": total,
        "units_timed": len(units), "layers_timed": layers, "kept_pass_s": round(seconds[0], 3),
        "seconds_per_unit": round(per_unit, 4), "estimated_s": round(seconds[0] + per_unit * total, 1),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }  # fmt: skip


def cache_numbers(model, length: int, settings: dict, device, original_row: dict | None) -> dict:
    """Bytes the cache holds after a prompt and ``length`` generated tokens (fed in chunks), the
    analytic prediction, and the ratio to the original's measured cache."""
    from rfkit.experiments.bench import cache_after_generation
    from rfkit.experiments.footprint import analytic_cache

    prompt = settings["prompt_len"]
    measured = cache_after_generation(model, prompt, length, settings["cache_chunk"], 0, device)
    analytic = analytic_cache(model)
    tokens = prompt + length
    row = {
        "prompt_tokens": prompt, "chunk": settings["cache_chunk"], "cache_tokens": measured["tokens"],
        "kv_bytes": measured["kv"], "state_bytes": measured["state"], "cache_bytes": measured["total"],
        "cache_bytes_analytic": analytic["kv_bytes_per_token"] * tokens + analytic["state_bytes"],
        "kv_bytes_per_token_analytic": analytic["kv_bytes_per_token"], "state_bytes_analytic": analytic["state_bytes"],
        "kept_kv_fraction": analytic["kept_kv_fraction"],
    }  # fmt: skip
    if original_row is not None:
        row["cache_bytes_original"] = original_row["cache_bytes"]
        row["ratio"] = row["cache_bytes"] / original_row["cache_bytes"]
        row["ratio_analytic"] = row["cache_bytes_analytic"] / original_row["cache_bytes_analytic"]
    return row


def _probe(model, length: int, device) -> dict:
    from rfkit.experiments.bench import prefill_peak

    started = time.perf_counter()
    oom = False
    try:
        peak = prefill_peak(model, length, 0, device)["peak_bytes"]
    except RuntimeError as err:  # OutOfMemoryError is one
        if not is_oom(err):
            raise
        oom, peak = True, None
    if oom:
        free_memory(device)
    return {"length": length, "peak_bytes": peak, "oom": oom, "s": round(time.perf_counter() - started, 2)}


def max_input_search(model, budget: int, device, start: int, cap: int, step: int, max_probes: int) -> dict:
    """The longest prompt (a multiple of ``step``, at most ``cap``) whose one-forward prefill peak
    (:func:`rfkit.experiments.bench.prefill_peak`) fits ``budget`` bytes, in at most ``max_probes``
    probes. A probe that runs out of device memory counts as too long. The peak grows about
    linearly in the length (K/V and activations; flash attention keeps no L x L buffer), so each
    next probe is the length the measured peaks predict, aimed just below the budget, or the
    middle of the bracket when the prediction falls outside it. Stops when the bracket is within
    ``max(step, lo / 64)`` tokens or the cap fits (then ``max_input`` is a lower bound)."""
    probes: list[dict] = []
    lo, hi = 0, None  # longest that fit, shortest that did not

    def rounded(x: float) -> int:
        return max(step, min(cap, int(x) // step * step))

    def predict() -> float | None:
        points = sorted({(p["length"], p["peak_bytes"]) for p in probes if p["peak_bytes"] is not None and p["peak_bytes"] > 0})
        if not points:
            return None
        if len(points) == 1 or points[-1][0] == points[0][0]:
            (n, peak), a = points[-1], 0.0
            b = peak / n
        else:  # the line through the two longest probes
            (n0, p0), (n1, p1) = points[-2], points[-1]
            b = (p1 - p0) / (n1 - n0)
            a = p0 - b * n0
            if b <= 0:
                return None
        return (budget - a) / b

    def next_length() -> int | None:
        tried = {p["length"] for p in probes}
        upper = cap + step if hi is None else hi  # the next probe lies strictly between lo and upper
        guess = predict()
        choices = []
        if guess is not None:
            choices.append(rounded(0.995 * guess))  # just below where the measured peaks reach the budget
            if hi is None:  # the prediction is at or below what fit (or beyond the cap): bracket from above
                choices.append(cap if guess >= cap else rounded(lo + max(step, lo // 64)))
        elif hi is None:
            choices.append(rounded(2 * lo) if lo else cap)
        choices.append(rounded((lo + upper) / 2))
        for length in choices:
            if lo < length < upper and length not in tried:
                return length
        return None

    length = rounded(start)
    while length is not None and len(probes) < max_probes:
        probe = _probe(model, length, device)
        probe["fits"] = not probe["oom"] and probe["peak_bytes"] <= budget
        probes.append(probe)
        if probe["fits"]:
            lo = max(lo, length)
        else:
            hi = length if hi is None else min(hi, length)
        if lo >= cap or (hi is not None and hi - lo <= max(step, lo // 64)):
            break
        length = next_length()
    return {
        "max_input": lo, "first_too_long": hi, "at_cap": lo >= cap, "cap": cap, "budget_bytes": budget,
        "probes": probes, "method": "benchmarks/gpu/shapes.py max_input_search over bench.prefill_peak",
    }  # fmt: skip


def max_input_numbers(model, settings: dict, device, limit: int | None, tiny: bool) -> dict:
    if limit is None and tiny:
        memory = {"available_bytes": TINY_PROBE_BUDGET, "how": "--tiny budget (RSS growth of the prefill on the CPU)"}
    else:
        memory = available_bytes(device, limit)
    found = max_input_search(
        model, memory["available_bytes"], device, settings["probe_start"], settings["probe_cap"],
        settings["probe_step"], settings["max_probes"],
    )  # fmt: skip
    return {**found, "memory": memory}


@torch.no_grad()
def time_chunked(model, ids: torch.Tensor, new_tokens: int, chunk: int) -> tuple[float, float]:
    """As :func:`rfkit.experiments.speed.time_generate` (prefill seconds, decode seconds per token),
    with the prompt fed ``chunk`` tokens a forward and the greedy tokens from a forward loop (one
    device sync per token, as the streamer's clock does): the fallback when one forward of the
    whole prompt does not fit."""
    from rfkit.experiments.speed import _Clock
    from rfkit.models.cache import cache_kwargs, output_cache

    clock = _Clock(ids.device)
    start = clock.now()
    cache = None
    for first in range(0, ids.shape[1], chunk):
        extra = {} if cache is None else cache_kwargs(cache)
        out = model(input_ids=ids[:, first : first + chunk], use_cache=True, logits_to_keep=1, **extra)
        cache = output_cache(out)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    prefilled = clock.now()
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        clock.now()
    done = clock.now()
    return prefilled - start, (done - prefilled) / max(1, new_tokens - 1)


def _pair_numbers(pair, context: int, batch: int, runs: int, decode_tokens: int, device) -> dict:
    """``rfkit bench speed``'s row for one context and batch: medians of interleaved runs, and what
    one decode step of each model reads (``bytes_ratio``: the most a bandwidth-bound step can gain)."""
    from rfkit.experiments.speed import _interleaved, _row, bytes_columns, random_ids

    ids = random_ids(pair.original, batch, context, 0, device)
    times = _interleaved(pair, lambda name: ids, runs, decode_tokens, None)
    row = {**_row(times, context, batch), **bytes_columns(pair, context, batch)}
    del row["context"], row["batch"]
    return row


def decode_numbers(pair, context: int, batch: int, settings: dict, runs: int, decode_tokens: int, device) -> dict:
    """Decode (and prefill) tokens/s of both models; a whole-prompt prefill that runs out of
    memory is measured again with a chunked prefill (:func:`time_chunked`) for both."""
    from rfkit.experiments import speed

    oom = None
    try:
        return {"method": "generate", **_pair_numbers(pair, context, batch, runs, decode_tokens, device)}
    except RuntimeError as err:  # OutOfMemoryError is one
        if not is_oom(err):
            raise
        oom = (str(err).splitlines() or [""])[0][:300]
    free_memory(device)
    chunk = settings["decode_chunk"]
    with mock.patch.object(speed, "time_generate", lambda model, ids, new: time_chunked(model, ids, new, chunk)):
        row = _pair_numbers(pair, context, batch, runs, decode_tokens, device)
    return {"method": f"chunked prefill ({chunk} tokens a forward) + greedy forward loop", "generate_error": f"out of memory: {oom}", **row}


def speed_cell(pair, context: int, batch: int, settings, runs, decode_tokens, device, limit) -> dict:
    """One speed cell, or a skip when the original's K/V plus the prefill's activations would not
    fit the free memory (the original holds the larger cache; the two models run one at a time)."""
    from rfkit.experiments.footprint import analytic_cache

    config = pair.original.config
    tokens = context + decode_tokens
    kv = analytic_cache(pair.original, batch)["kv_bytes_per_token"] * tokens
    conv = analytic_cache(pair.converted, batch)
    itemsize = next(pair.original.parameters()).element_size()
    # per prompt token while one layer runs: the MLP's gate/up/act (3 x intermediate) and a few
    # hidden-wide tensors (residual, norm, projections, attention output)
    activations = batch * context * itemsize * (3 * config.intermediate_size + 8 * config.hidden_size)
    # DynamicCache's torch.cat copies one layer's K/V per decode step
    need = kv + kv // config.num_hidden_layers + activations
    memory = available_bytes(device, limit)
    sizes = {
        "kv_bytes_original": kv, "cache_bytes_converted_analytic": conv["kv_bytes_per_token"] * tokens + conv["state_bytes"],
        "estimated_bytes": need, **memory,
    }  # fmt: skip
    if need > memory["available_bytes"]:
        free = memory["available_bytes"]
        return {"skipped": f"memory: the original needs ~{human(need)} (K/V {human(kv)}), {human(free)} free", **sizes}
    return {**decode_numbers(pair, context, batch, settings, runs, decode_tokens, device), **sizes}


# ----------------------------------------------------------------------------- the two runs
def run_speed(args, rec: Record, settings: dict, device, dtype) -> None:
    name = "smollm2-135m"
    operator, beta, recipe = read_recipe(SHAPES[name]["recipes"]["hybrid"])
    original = Lazy(lambda: build_original(name, args.tiny, device, dtype), device)
    converted = Lazy(lambda: build_converted(name, args.tiny, device, dtype, operator, beta), device)
    base = {"shape": name, "beta": beta}
    rec.measure({**base, "measurement": "model", "model": "original"}, lambda: model_row(original), device)
    rec.measure({**base, "measurement": "model", "model": "converted", "operator": "hybrid", "recipe": recipe,
                 "operator_spec": operator.to_dict()}, lambda: model_row(converted), device)  # fmt: skip
    compiled_mixers = None
    for compiled in (False, True):
        for context in settings["speed_contexts"]:
            for batch in settings["speed_batches"]:
                ident = {**base, "measurement": "speed", "operator": "hybrid", "context": context, "batch": batch, "compiled": compiled}

                def cell(context=context, batch=batch, compiled=compiled):
                    nonlocal compiled_mixers
                    pair = SimpleNamespace(original=original.get(), converted=converted.get())
                    if compiled and compiled_mixers is None:
                        from rfkit.models.window import compile_decode_steps

                        options = {} if settings["compile_backend"] is None else {"backend": settings["compile_backend"]}
                        compiled_mixers = compile_decode_steps(pair.converted, **options)
                    extra = {"compiled_mixers": compiled_mixers, "compile_backend": settings["compile_backend"] or "inductor"} if compiled else {}
                    return {**speed_cell(pair, context, batch, settings, args.runs, args.decode_tokens, device, args.memory_limit), **extra}

                rec.measure(ident, cell, device)


def run_table2(args, rec: Record, settings: dict, device, dtype) -> None:
    for name in args.shapes:
        spec = SHAPES[name]
        ops = [(op, *read_recipe(spec["recipes"][op])) for op in args.operators if op in spec["recipes"]]
        betas = {beta for _, _, beta, _ in ops}
        if len(betas) != 1:
            raise ShapesError(f"{name}: its recipes disagree on beta ({sorted(betas)})")
        beta = betas.pop()
        paper = {} if args.tiny else spec.get("paper", {})
        base = {"shape": name, "beta": beta}
        original = Lazy(lambda name=name: build_original(name, args.tiny, device, dtype), device)

        # the original, alone on the device: its cache after generation, then its l_m
        rec.measure({**base, "measurement": "model", "model": "original"}, lambda: model_row(original), device)
        for length in settings["cache_lengths"]:
            ident = {**base, "measurement": "cache", "model": "original", "generated_tokens": length}
            rec.measure(ident, lambda length=length: {**cache_numbers(original.get(), length, settings, device, None), "ratio": 1.0}, device)
        rec.measure(
            {**base, "measurement": "max_input", "model": "original", "paper": paper.get("max_input", {}).get("original")},
            lambda: max_input_numbers(original.get(), settings, device, args.memory_limit, args.tiny), device,
        )  # fmt: skip

        for op_name, operator, _, recipe in ops:
            converted = Lazy(lambda operator=operator: build_converted(name, args.tiny, device, dtype, operator, beta), device)
            common = {**base, "operator": op_name}
            rec.measure({**common, "measurement": "model", "model": "converted", "recipe": recipe, "operator_spec": operator.to_dict()},
                        lambda converted=converted: model_row(converted), device)  # fmt: skip
            for length in settings["cache_lengths"]:
                orig = rec.find(measurement="cache", shape=name, model="original", generated_tokens=length)
                ident = {**common, "measurement": "cache", "model": "converted", "generated_tokens": length,
                         "paper_ratio": paper.get("cs", {}).get(length)}  # fmt: skip
                rec.measure(ident, lambda length=length, orig=orig, converted=converted: cache_numbers(converted.get(), length, settings, device, orig), device)
            for context in settings["decode_contexts"]:
                ident = {**common, "measurement": "decode", "model": "pair", "context": context, "batch": 1}

                def cell(context=context, converted=converted):
                    pair = SimpleNamespace(original=original.get(), converted=converted.get())
                    return decode_numbers(pair, context, 1, settings, args.runs, args.decode_tokens, device)

                rec.measure(ident, cell, device)
            original.drop()  # the converted model's l_m with the device to itself
            ident = {**common, "measurement": "max_input", "model": "converted", "paper": paper.get("max_input", {}).get("converted")}

            def longest(converted=converted):
                row = max_input_numbers(converted.get(), settings, device, args.memory_limit, args.tiny)
                orig = rec.find(measurement="max_input", shape=name, model="original")
                if orig is not None and orig["max_input"]:
                    row["max_input_original"] = orig["max_input"]
                    row["ratio"] = row["max_input"] / orig["max_input"]
                return row

            rec.measure(ident, longest, device)
            converted.drop()
        # what choosing the hybrid recipe's heads costs, when it measures them (last: the rows above come first)
        policy = read_streamed_policy(spec["recipes"]["hybrid"]) if "hybrid" in args.operators else None
        if policy is not None:
            ident = {**base, "measurement": "heads", "operator": "hybrid", "model": "original",
                     "policy": "StreamedLossPolicy", "recipe": f"recipes/{spec['recipes']['hybrid']}"}  # fmt: skip
            rec.measure(ident, lambda policy=policy: heads_numbers(original.get(), policy, settings, device), device)
        original.drop()


# ----------------------------------------------------------------------------- output
def summary_line(row: dict) -> str:
    what = " ".join(str(row[k]) for k in ("measurement", "shape", "operator", "model") if row.get(k) is not None)
    where = " ".join(f"{k}={row[k]}" for k in ("context", "batch", "compiled", "generated_tokens") if row.get(k) is not None)
    head = f"{what} {where}".strip()
    if "skipped" in row:
        return f"{head}: skipped ({row['skipped']})"
    if "error" in row:
        return f"{head}: ERROR {row['error']}"
    m = row["measurement"]
    if m == "model":
        return f"{head}: {human(row['param_bytes'])} of weights {row['dtypes']} on {row['devices']}, built in {row['build_s']}s"
    if m == "cache":
        ratio = "" if "ratio_analytic" not in row else f", cs {row['ratio']:.4f} (analytic {row['ratio_analytic']:.4f})"
        return f"{head}: {row['cache_bytes'] / MiB:,.1f} MiB{ratio}"
    if m == "heads":
        return (f"{head}: {row['units_total']} KV groups, {row['seconds_per_unit']:.2f} s each after a {row['kept_pass_s']:.1f} s pass: "
                f"~{row['estimated_s'] / 60:.1f} min on one device")  # fmt: skip
    if m == "max_input":
        at = ">= " if row["at_cap"] else ""
        return f"{head}: l_m {at}{row['max_input']:,} tokens ({len(row['probes'])} probes, budget {human(row['budget_bytes'])})"
    return (
        f"{head}: decode {row['decode_tps_original']:.1f} -> {row['decode_tps_converted']:.1f} tok/s ({row['decode_ratio']:.2f}x"
        f"{_bytes_note(row)}), "
        f"prefill {row['prefill_tps_original']:.0f} -> {row['prefill_tps_converted']:.0f} tok/s ({row['prefill_ratio']:.2f}x)"
    )


def _bytes_note(row: dict) -> str:
    return f"; bytes ratio {row['bytes_ratio']:.2f}x" if "bytes_ratio" in row else ""


def _cells(row: dict, cells) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    if "error" in row:
        return f"error: {row['error']}"
    return cells(row)


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"Device {result['device']}, {result['dtype']}; {result['note']}.", ""]
    models = [r for r in rows if r["measurement"] == "model"]
    if models:
        lines += ["| shape | model | operator | weights (GiB) | dtypes | built (s) |", "|---|---|---|---:|---|---:|"]
        for r in models:
            body = _cells(r, lambda r: f"{r['param_bytes'] / GiB:.2f} | {r['dtypes']} | {r['build_s']}")
            lines.append(f"| {r['shape']} | {r['model']} | {r.get('operator') or '-'} | {body} |")
        lines.append("")
    speed = [r for r in rows if r["measurement"] in ("speed", "decode")]
    if speed:
        head = "| shape | operator | context | batch | compiled | prefill tok/s original | converted | ratio | decode tok/s original | converted | ratio | bytes ratio |"
        lines += [head, "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in speed:
            body = _cells(r, lambda r: (
                f"{r['prefill_tps_original']:,.0f} | {r['prefill_tps_converted']:,.0f} | {r['prefill_ratio']:.2f}x | "
                f"{r['decode_tps_original']:,.1f} | {r['decode_tps_converted']:,.1f} | {r['decode_ratio']:.2f}x"
                + ("" if r.get("method", "generate") == "generate" else " (chunked prefill)")
                + (f" | {r['bytes_ratio']:.2f}x" if "bytes_ratio" in r else " | -")
            ))  # fmt: skip
            lines.append(f"| {r['shape']} | {r['operator']} | {r['context']:,} | {r['batch']} | {'yes' if r.get('compiled') else 'no'} | {body} |")
        lines.append("")
    cache = [r for r in rows if r["measurement"] == "cache"]
    if cache:
        lines += ["| shape | model | operator | l_g | cache (MiB) | cs measured | cs analytic | cs paper |", "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in cache:
            paper = "-" if r.get("paper_ratio") is None else f"{r['paper_ratio']:.4f}"
            body = _cells(r, lambda r: (
                f"{r['cache_bytes'] / MiB:,.1f} | {r['ratio']:.4f} | "
                f"{r['ratio_analytic']:.4f}" if "ratio_analytic" in r else f"{r['cache_bytes'] / MiB:,.1f} | {r['ratio']:.4f} | 1.0000"
            ))  # fmt: skip
            lines.append(f"| {r['shape']} | {r['model']} | {r.get('operator') or '-'} | {r['generated_tokens']:,} | {body} | {paper} |")
        lines.append("")
    lm = [r for r in rows if r["measurement"] == "max_input"]
    if lm:
        lines += ["| shape | model | operator | l_m (tokens) | budget (GiB) | probes | paper |", "|---|---|---|---:|---:|---:|---:|"]
        for r in lm:
            paper = "-" if r.get("paper") is None else f"{r['paper']:,}"
            body = _cells(r, lambda r: f"{'>= ' if r['at_cap'] else ''}{r['max_input']:,} | {r['budget_bytes'] / GiB:.2f} | {len(r['probes'])}")
            lines.append(f"| {r['shape']} | {r['model']} | {r.get('operator') or '-'} | {body} | {paper} |")
        lines.append("")
    heads = [r for r in rows if r["measurement"] == "heads"]
    if heads:
        lines += ["| shape | recipe | measured blocks (tokens) | KV groups | timed | kept pass (s) | s per group | estimated (min) | peak (GiB) |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in heads:
            body = _cells(r, lambda r: (
                f"{' + '.join(f'{c} x {n:,}' for n, c in zip(r['lengths'], r['blocks']))} | {r['units_total']:,} | {r['units_timed']} | "
                f"{r['kept_pass_s']:.1f} | {r['seconds_per_unit']:.2f} | {r['estimated_s'] / 60:.1f} | "
                + ("-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GiB:.1f}")
            ))  # fmt: skip
            lines.append(f"| {r['shape']} | {r['recipe']} | {body} |")
        lines.append("")
    for note in result.get("notes", []):
        lines.append(f"Note: {note}.")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("speed", "table2"))
    parser.add_argument("--output", required=True, help="directory for <what>.json and <what>.md")
    parser.add_argument("--tiny", action="store_true", help="tiny configs and lengths: the CPU rehearsal")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no measurement after this many seconds")
    parser.add_argument("--shapes", default=",".join(TABLE2_SHAPES), help="table2: shapes to run, comma separated")
    parser.add_argument("--operators", default="mamba,hybrid", help="table2: operators to run, comma separated")
    parser.add_argument("--contexts", default=None, help="speed and table2 decode contexts, comma separated (default: the run's)")
    parser.add_argument("--batches", default=None, help="speed: batch sizes, comma separated (default 1,16; --tiny 1,4)")
    parser.add_argument("--runs", type=int, default=None, help="interleaved runs per speed cell (default 3; --tiny 2)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="tokens per decode measurement (default 16; --tiny 4)")
    parser.add_argument("--memory-limit", default=None, help="memory a cell / an l_m search may use (e.g. 40GiB; default: the free memory)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--resume", action="store_true", help="keep the finished rows of an earlier run in --output")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    settings = dict(SETTINGS[args.tiny])
    for flag, keys in (("contexts", ("speed_contexts", "decode_contexts")), ("batches", ("speed_batches",))):
        text = getattr(args, flag)
        if text is not None:
            try:
                values = [int(v) for v in re.split(r"[,\s]+", text) if v]
            except ValueError:
                values = []
            if not values or min(values) < 1:
                raise ShapesError(f"--{flag}: '{text}' is not a comma-separated list of positive integers")
            settings.update({key: values for key in keys})
    args.runs = settings["runs"] if args.runs is None else args.runs
    args.decode_tokens = settings["decode_tokens"] if args.decode_tokens is None else args.decode_tokens
    if args.runs < 1 or args.decode_tokens < 2:
        raise ShapesError("--runs must be >= 1 and --decode-tokens >= 2")
    args.shapes = [s for s in re.split(r"[,\s]+", args.shapes) if s]
    args.operators = [s for s in re.split(r"[,\s]+", args.operators) if s]
    bad = [s for s in args.shapes if s not in TABLE2_SHAPES] + [o for o in args.operators if o not in ("mamba", "hybrid")]
    if bad:
        raise ShapesError(f"unknown shapes or operators {bad}; shapes: {', '.join(TABLE2_SHAPES)}; operators: mamba, hybrid")
    from rfkit.config.args import parse_bytes
    from rfkit.devices import torch_device
    from rfkit.models.mamba import fused_kernels_available

    args.memory_limit = None if args.memory_limit is None else parse_bytes(args.memory_limit, "--memory-limit", error=ShapesError)
    device = torch_device(args.device)
    dtype = getattr(torch, args.dtype)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": device_name(device), "dtype": args.dtype, "tiny": args.tiny, "runs": args.runs,
        "decode_tokens": args.decode_tokens, "settings": settings, "note": NOTE_RANDOM,
        "heads": "random (RandomHeads, granularity kv_group, seed 0)", "weights": "random (from_config, seed 0)",
        "mamba_fused_kernels": fused_kernels_available(), "budget_s": args.budget_s,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "notes": [
            NOTE_RANDOM,
            "cache: bytes the cache tensors hold after the prompt and l_g tokens fed in chunks (rfkit.experiments.bench.cache_after_generation)",
            "speed / decode: rfkit.experiments.speed._interleaved, medians of the runs, the first model alternating, after a warm-up",
            "compiled: only the converted model's steady decode step (rfkit.models.window.compile_decode_steps); the original runs eager",
            "paper: the RecurFormer paper's Table 2 (its Mamba operator, its selected heads, one A100-80G), for reference",
        ],
    }  # fmt: skip
    if device.type == "cuda":
        meta["device_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    rec = Record(out_dir, args.what, meta, args.budget_s, args.resume, [str(Path(__file__)), *argv])
    import transformers  # noqa: F401  (loaded before the freeze below)

    import rfkit.experiments.bench  # noqa: F401
    import rfkit.models.modeling  # noqa: F401

    # what the imports made lives to the end: keep it out of every later gc.collect (each model
    # drop and, in bench.prefill_peak, each CPU probe collects; with transformers loaded a full
    # collection takes ~0.2 s)
    gc.freeze()
    threads = torch.get_num_threads()
    if args.tiny and device.type == "cpu":  # tiny models gain nothing from more threads, and on a shared
        torch.set_num_threads(1)  # CI runner OpenMP threads waiting on each other cost milliseconds a call
    rec.result["threads"] = torch.get_num_threads()
    rec.write()
    try:
        (run_speed if args.what == "speed" else run_table2)(args, rec, settings, device, dtype)
    finally:  # main() may run inside a longer process (the tests)
        gc.unfreeze()
        torch.set_num_threads(threads)
    rec.write()
    errors = [r for r in rec.result["rows"] if "error" in r]
    print(f"{len(rec.result['rows'])} rows, {len(errors)} errors, {rec.elapsed():.1f}s: {rec.json_path}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    from rfkit.errors import RFKitError

    try:
        sys.exit(main())
    except (ShapesError, RFKitError) as err:  # bad flags, --device cuda without a GPU
        print(f"shapes.py: {err}", file=sys.stderr)
        sys.exit(2)
