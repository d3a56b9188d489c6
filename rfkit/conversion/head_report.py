"""Pictures and tables of the profiled heads, written by ``rfkit profile`` next to the head map.

The paper's head analyses (RecurFormer Fig. 5, Fig. 6 and Table 5):

- ``rai_heatmap.png``: every head's RA-I as the fraction of calibration samples with
  RR > alpha, layers on the x axis and query heads on the y axis; replaced heads ringed.
- ``attention_maps.png``: mean attention maps (over up to ``max_samples`` blocks, first
  ``map_tokens`` tokens) of the head with the highest, a middle and the lowest RA-I, with the
  first token (row and column 0, the attention sink) left out of the picture.
- ``first_token_contribution.json`` / ``.md``: how much the first token contributes to the
  attention output compared with the other tokens (definitions in :data:`DEFINITIONS`).

All of it comes from one extra forward pass over the calibration blocks with an attention
function of our own (installed with :func:`rfkit.conversion.profile.capture_attention`) that
computes the attention in query chunks, as profiling does, returns the same output, and adds
up the statistics on the way: memory stays constant in the number of blocks.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rfkit.atomic import atomic_write_json, atomic_write_text
from rfkit.conversion.headmap import HeadMap
from rfkit.conversion.profile import capture_attention
from rfkit.models.layout import AttentionLayout

log = logging.getLogger(__name__)

REPORT_ATTENTION = "rfkit_report"
_OUTSIDE = "rfkit report attention called outside write_head_report()"

# Per (layer, query head), statistics of these quantities are kept: running count, sum and sum
# of squares in float64. Query positions i run over 1..L-1 (row 0 only sees token 0, so it has
# no "other tokens"); a = softmax attention weights, v = value vectors (v_proj output, the KV
# head's value repeated for every query head of its group).
METRICS = (
    "weight_first",  # a_i0
    "weight_other",  # mean_{1<=j<=i} a_ij, i.e. (1 - a_i0) / i
    "value_first_l1",  # ||v_0||_1, one value per block
    "value_first_l2",
    "value_other_l1",  # ||v_j||_1 for j >= 1, one value per token
    "value_other_l2",
    "first_l1",  # ||a_i0 v_0||_1
    "first_l2",
    "other_per_token_l1",  # mean_{1<=j<=i} ||a_ij v_j||_1
    "other_per_token_l2",
    "other_sum_l1",  # ||sum_{1<=j<=i} a_ij v_j||_1 (all other tokens together)
    "other_sum_l2",
)
_INDEX = {name: k for k, name in enumerate(METRICS)}

DEFINITIONS = {
    "positions": "query positions i = 1..L-1 of every block (row 0 attends only to token 0); "
    "statistics pool query positions x blocks (x heads for layer and overall rows)",
    "first": "||a_i0 * v_0||_p: the first token's term of head output o_i = sum_j a_ij v_j",
    "other_per_token": "mean over j = 1..i of ||a_ij * v_j||_p: the average other token's term",
    "other_sum": "||sum_{j=1..i} a_ij * v_j||_p = ||o_i - a_i0 v_0||_p: all other tokens together",
    "weight": "a_i0 for the first token; mean over j = 1..i of a_ij for the other tokens",
    "value_norm": "||v_0||_p (one per block and head) versus ||v_j||_p for j >= 1 (one per token and head)",
    "ci95": "mean +- 1.96 * sd / sqrt(n) (normal approximation; positions within a block are "
    "correlated, so the interval is narrower than an independent-sample interval would be)",
    "norms": "L1 = sum of absolute values, L2 = Euclidean norm, over the head dimension",
}


class _ReportCollector:
    """Accumulates contribution statistics for every head and attention maps for a few."""

    def __init__(self, layout: AttentionLayout, tracked: list[tuple[int, int]], map_tokens: int, chunk: int, device):
        self.layout, self.chunk, self.map_tokens = layout, chunk, map_tokens
        shape = (len(METRICS), layout.num_layers, layout.num_heads)
        self.count = torch.zeros(shape, dtype=torch.float64, device=device)
        self.sum = torch.zeros(shape, dtype=torch.float64, device=device)
        self.sumsq = torch.zeros(shape, dtype=torch.float64, device=device)
        self.tracked = list(tracked)
        self.maps = [torch.zeros(map_tokens, map_tokens, dtype=torch.float64, device=device) for _ in tracked]
        self.samples = 0
        self.seq_len = 0

    def _add(self, layer: int, name: str, x: torch.Tensor) -> None:
        """Add ``x`` (B, H, n) to the statistics of ``name`` for every head of ``layer``."""
        k = _INDEX[name]
        x = x.double()
        self.count[k, layer] += x.shape[0] * x.shape[2]
        self.sum[k, layer] += x.sum((0, 2))
        self.sumsq[k, layer] += (x * x).sum((0, 2))

    def attend(self, module, query, key, value, scaling: float):
        """Causal attention in query chunks. query (B, H, L, d), key/value (B, Hkv, L, d)."""
        B, H, L, _ = query.shape
        if L < self.map_tokens and self.tracked:
            raise ValueError(f"head report: blocks of {L} tokens are shorter than the {self.map_tokens}-token maps")
        layer = module.layer_idx
        rep = H // key.shape[1]
        key = key.repeat_interleave(rep, dim=1) if rep > 1 else key
        value = value.repeat_interleave(rep, dim=1) if rep > 1 else value
        v = value.float()
        norms = {"l1": v.abs().sum(-1), "l2": v.norm(dim=-1)}  # (B, H, L)
        for p, n in norms.items():
            self._add(layer, f"value_first_{p}", n[:, :, :1])
            self._add(layer, f"value_other_{p}", n[:, :, 1:])
        v0 = v[:, :, 0]  # (B, H, d)
        out = torch.empty_like(query)
        columns = torch.arange(L, device=query.device)
        tracked_here = [(m, h) for m, (lay, h) in enumerate(self.tracked) if lay == layer]
        for start in range(0, L, self.chunk):
            rows = torch.arange(start, min(L, start + self.chunk), device=query.device)
            scores = torch.matmul(query[:, :, rows], key.transpose(-1, -2)).float() * scaling  # (B, H, c, L)
            probs = scores.masked_fill_(rows[:, None] < columns[None, :], float("-inf")).softmax(-1)
            o = torch.matmul(probs, v)  # (B, H, c, d), float32
            out[:, :, rows] = o.to(out.dtype)
            for m, h in tracked_here:
                if start < self.map_tokens:
                    upto = min(len(rows), self.map_tokens - start)
                    self.maps[m][start : start + upto] += probs[:, h, :upto, : self.map_tokens].sum(0).double()
            if start == 0:  # row 0 has no other tokens: leave it out (views, no copies)
                if len(rows) == 1:
                    continue
                probs, o, rows = probs[:, :, 1:], o[:, :, 1:], rows[1:]
            others = rows.float()  # query i has i other tokens (1..i)
            p0 = probs[..., 0]  # (B, H, c)
            self._add(layer, "weight_first", p0)
            self._add(layer, "weight_other", probs[..., 1:].sum(-1) / others)
            rest = o - p0[..., None] * v0[:, :, None, :]  # sum_{j>=1} a_ij v_j
            rest_norms = {"l1": rest.abs().sum(-1), "l2": rest.norm(dim=-1)}
            for p, n in norms.items():
                # a_ij >= 0, so ||a_ij v_j|| = a_ij ||v_j||
                self._add(layer, f"first_{p}", p0 * n[:, :, :1])
                self._add(layer, f"other_per_token_{p}", torch.matmul(probs[..., 1:], n[:, :, 1:, None]).squeeze(-1) / others)
                self._add(layer, f"other_sum_{p}", rest_norms[p])
        if layer == 0:
            self.samples += B
            self.seq_len = L
        return out.transpose(1, 2).contiguous()  # (B, L, H, d) as HF attention functions return


def pick_heads(head_map: HeadMap) -> list[tuple[str, int, int]]:
    """``[(label, layer, head)]`` for the highest, a middle (the median) and the lowest RA-I head.

    Ties in RA-I are broken by the mean RR. Empty when the head map has no profile.
    """
    if not head_map.rai:
        return []
    rr = head_map.rr_mean or [[0.0] * head_map.num_heads for _ in range(head_map.num_layers)]
    order = sorted(
        ((head_map.rai[layer][h], rr[layer][h], layer, h) for layer in range(head_map.num_layers) for h in range(head_map.num_heads)),
    )
    chosen, seen = [], set()
    for label, idx in (("highest", len(order) - 1), ("middle", len(order) // 2), ("lowest", 0)):
        _, _, layer, h = order[idx]
        if (layer, h) not in seen:
            seen.add((layer, h))
            chosen.append((label, layer, h))
    return chosen


def _summary(collector: _ReportCollector, name: str, mask: torch.Tensor | None = None) -> dict:
    """mean, sd, n and 95% CI of metric ``name`` pooled over the heads where ``mask`` is true."""
    k = _INDEX[name]
    count, total, squares = collector.count[k], collector.sum[k], collector.sumsq[k]
    if mask is not None:
        count, total, squares = count[mask], total[mask], squares[mask]
    n, s, ss = float(count.sum()), float(total.sum()), float(squares.sum())
    if n == 0:
        return {"mean": None, "sd": None, "n": 0, "ci95": [None, None]}
    mean = s / n
    var = max(ss - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    sd = math.sqrt(var)
    half = 1.96 * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "n": int(n), "ci95": [mean - half, mean + half]}


def _group(collector: _ReportCollector, mask: torch.Tensor | None) -> dict:
    return {name: _summary(collector, name, mask) for name in METRICS}


def contribution_tables(collector: _ReportCollector, head_map: HeadMap) -> dict:
    """The JSON document: overall (all / replaced / kept heads), per layer and per head."""
    layout = collector.layout
    replaced = torch.zeros(layout.num_layers, layout.num_heads, dtype=torch.bool)
    for layer, heads in enumerate(head_map.selected):
        for h in heads:
            replaced[layer, h] = True
    replaced = replaced.to(collector.count.device)
    overall = {"all heads": _group(collector, None)}
    if bool(replaced.any()):
        overall["replaced heads"] = _group(collector, replaced)
    if bool((~replaced).any()):
        overall["kept heads"] = _group(collector, ~replaced)
    per_layer = []
    for layer in range(layout.num_layers):
        mask = torch.zeros_like(replaced)
        mask[layer] = True
        per_layer.append({"layer": layer, **_group(collector, mask)})
    means = (collector.sum / collector.count.clamp_min(1)).cpu()
    per_head = {name: [[round(float(x), 6) for x in row] for row in means[k]] for k, name in enumerate(METRICS)}
    return {
        "model": head_map.model,
        "samples": collector.samples,
        "seq_len": collector.seq_len,
        "definitions": DEFINITIONS,
        "overall": overall,
        "per_layer": per_layer,
        "per_head_mean": per_head,
    }


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) >= 1e-3 else f"{x:.3e}"


def _ci(s: dict) -> str:
    if s["mean"] is None:
        return "-"
    lo, hi = s["ci95"]
    return f"{_fmt(s['mean'])} [{_fmt(lo)}, {_fmt(hi)}]"


def _ratio(a: dict, b: dict) -> str:
    if a["mean"] is None or not b["mean"]:
        return "-"
    return f"{a['mean'] / b['mean']:.3g}"


OVERALL_ROWS = (
    ("attention weight a_ij (per token)", "weight_first", "weight_other"),
    ("value norm L1 ||v_j||_1", "value_first_l1", "value_other_l1"),
    ("value norm L2 ||v_j||_2", "value_first_l2", "value_other_l2"),
    ("contribution L1, per token ||a_ij v_j||_1", "first_l1", "other_per_token_l1"),
    ("contribution L2, per token ||a_ij v_j||_2", "first_l2", "other_per_token_l2"),
    ("contribution L1, other tokens summed ||sum a_ij v_j||_1", "first_l1", "other_sum_l1"),
    ("contribution L2, other tokens summed ||sum a_ij v_j||_2", "first_l2", "other_sum_l2"),
)


def _md(text: str) -> str:
    """Norm bars as the ‖ character: a ``|`` would split a Markdown table cell."""
    return text.replace("||", "‖").replace("+-", "±")


def contribution_markdown(doc: dict, head_map: HeadMap) -> str:
    """Table 5 of the paper as Markdown: overall rows, then one row per layer."""
    lines = [
        f"# First-token contribution to the attention output ({doc['model']})",
        "",
        (
            f"{doc['samples']} calibration blocks of {doc['seq_len']} tokens; "
            f"{head_map.replaced_heads} of {head_map.total_heads} query heads replaced."
        ),
        "",
        "Definitions (a = softmax attention weights, v = value vectors, per head; o_i = sum_j a_ij v_j):",
        "",
    ]
    lines += [f"- **{key}**: {_md(text)}" for key, text in DEFINITIONS.items()]
    for group, stats in doc["overall"].items():
        lines += [
            "",
            f"## Overall, {group}",
            "",
            "| quantity | first token (j = 0): mean [95% CI] | other tokens (j >= 1): mean [95% CI] | first / other |",
            "|---|---|---|---|",
        ]
        for label, first, other in OVERALL_ROWS:
            lines.append(f"| {_md(label)} | {_ci(stats[first])} | {_ci(stats[other])} | {_ratio(stats[first], stats[other])} |")
    lines += [
        "",
        "## Per layer (all heads of the layer; mean ± 95% CI half-width)",
        "",
        (
            "| layer | replaced heads | weight a_i0 | first L1 | other per token L1 | other summed L1 "
            "| first L2 | other per token L2 | other summed L2 |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def pm(s: dict) -> str:
        if s["mean"] is None:
            return "-"
        return f"{_fmt(s['mean'])} ± {_fmt(s['ci95'][1] - s['mean'])}"

    for row in doc["per_layer"]:
        layer = row["layer"]
        heads = head_map.selected[layer] if layer < len(head_map.selected) else []
        cells = [pm(row[name]) for name in ("weight_first", "first_l1", "other_per_token_l1", "other_sum_l1",
                                             "first_l2", "other_per_token_l2", "other_sum_l2")]  # fmt: skip
        lines.append(f"| {layer} | {','.join(map(str, heads)) or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _input_ids(batch) -> torch.Tensor:
    return batch["input_ids"] if isinstance(batch, dict) else batch


@torch.no_grad()
def collect(model, batches, tracked, max_samples: int = 8, map_tokens: int = 128, chunk: int = 128, progress: bool = True):
    """One forward pass over up to ``max_samples`` blocks of ``batches`` with the report attention.

    Returns the collector (statistics, summed maps of ``tracked`` ``(layer, head)`` pairs).
    Batches are dicts with ``input_ids`` (B, L) (or plain tensors); padding is not supported.
    """
    layout = AttentionLayout.from_config(model.config)
    device = next(model.parameters()).device
    total = max_samples
    if hasattr(batches, "dataset"):  # a DataLoader: the bar ends where the data does
        total = min(total, len(batches.dataset))
    batches = iter(batches)
    first = next(batches, None)
    if first is None:
        raise ValueError("head report: got no calibration blocks")
    collector = _ReportCollector(layout, tracked, min(map_tokens, _input_ids(first).shape[1]), chunk, device)
    was_training = model.training
    model.eval()
    bar = tqdm(total=total, desc="head report", unit="block", disable=not progress)
    try:
        with capture_attention(model, collector, REPORT_ATTENTION, _OUTSIDE):
            for batch in itertools.chain([first], batches):
                ids = _input_ids(batch)[: max_samples - collector.samples].to(device)
                model(input_ids=ids, use_cache=False)
                bar.update(ids.shape[0])
                if collector.samples >= max_samples:
                    break
    finally:
        bar.close()
        model.train(was_training)
    if collector.samples == 0:
        raise ValueError("head report: got no calibration blocks")
    return collector


def write_head_report(
    model,
    head_map: HeadMap,
    batches,
    out_dir: str | os.PathLike,
    max_samples: int = 8,
    progress: bool = True,
    map_tokens: int = 128,
    chunk: int = 128,
) -> dict[str, Path]:
    """Write the head pictures and the first-token table into ``out_dir``; return their paths.

    Args:
        model: the base model the head map was profiled on (Llama / Mistral / Qwen2 layout).
        head_map: its head map; RA-I and the selection come from here (without a profile, i.e.
            an explicit head list, only the contribution table is written).
        batches: calibration batches, dicts with ``input_ids`` (B, L).
        out_dir: directory for the files (created if missing).
        max_samples: blocks to run (the attention maps and statistics use these).
        progress: show a tqdm bar over the blocks.
        map_tokens: the attention maps cover the first ``min(L, map_tokens)`` tokens.
        chunk: query rows per attention chunk (peak memory O(chunk x L) per layer).

    Returns:
        ``{"rai_heatmap", "attention_maps", "first_token_contribution_json",
        "first_token_contribution_md": path}`` (the first two only with a profile).
    """
    from rfkit import plots

    if max_samples < 1 or map_tokens < 2 or chunk < 1:
        raise ValueError("head report: max_samples and chunk must be >= 1 and map_tokens >= 2")
    layout = AttentionLayout.from_config(model.config)
    head_map.check_layout(layout)
    out_dir = Path(out_dir)
    picks = pick_heads(head_map)
    collector = collect(model, batches, [(layer, h) for _, layer, h in picks], max_samples, map_tokens, chunk, progress)
    written: dict[str, Path] = {}

    if head_map.rai:
        samples = max(head_map.samples, 1)
        frac = [[head_map.rai[layer][h] / samples for layer in range(layout.num_layers)] for h in range(layout.num_heads)]
        marks = [(h, layer) for layer, heads in enumerate(head_map.selected) for h in heads]
        written["rai_heatmap"] = plots.heatmap(
            frac,
            out_dir / "rai_heatmap.png",
            xlabel="layer",
            ylabel="query head",
            title=(
                f"RA-I per head: {head_map.model}\n"
                f"fraction of {head_map.samples} calibration blocks with RR > alpha={head_map.alpha} "
                f"(window k={head_map.window}, first token {'excluded' if head_map.exclude_first_token else 'included'})"
            ),
            marks=marks,
            mark_label=f"replaced head ({head_map.replaced_heads} of {head_map.total_heads}, beta={head_map.beta})",
            cbar_label="RA-I / samples",
            vmin=0.0,
            vmax=1.0,
        )
        n = collector.map_tokens
        maps = [(m / collector.samples).cpu().numpy() for m in collector.maps]
        titles = [
            f"{label} RA-I: layer {layer}, head {h}\nRA-I {head_map.rai[layer][h]}/{head_map.samples}"
            + (f", mean RR {head_map.rr_mean[layer][h]:.2f}" if head_map.rr_mean else "")
            for label, layer, h in picks
        ]
        written["attention_maps"] = plots.attention_panels(
            maps,
            titles,
            out_dir / "attention_maps.png",
            suptitle=(
                f"Mean attention maps, first {n} tokens, {collector.samples} calibration blocks: {head_map.model}\n"
                "first token (row and column 0, the attention sink) not shown"
            ),
            first=1,
            log=True,
        )
    else:
        log.info("head report: the head map has no profile (RA-I); writing the contribution table only")

    doc = contribution_tables(collector, head_map)
    doc["attention_map_heads"] = [
        {"label": label, "layer": layer, "head": h, "rai": head_map.rai[layer][h]} for label, layer, h in picks
    ]
    path = out_dir / "first_token_contribution.json"
    from rfkit.provenance import stamp

    atomic_write_json(path, stamp(doc))
    written["first_token_contribution_json"] = path
    path = out_dir / "first_token_contribution.md"
    atomic_write_text(path, contribution_markdown(doc, head_map))
    written["first_token_contribution_md"] = path
    return written
