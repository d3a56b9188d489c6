"""The model card (``README.md``) of a saved converted model.

:func:`model_card` writes Hugging Face style YAML front matter (``library_name: rfkit``,
``base_model`` when the base model is a hub id, ``tags``) and the sections: what this is, how
to load it, the head-map summary, the measured results (only the numbers a run summary
holds; "Not measured." without one) and the resolved recipe.
"""

from __future__ import annotations

import json
import re

from rfkit.conversion.headmap import HeadMap

TAGS = ["rfkit", "recurformer", "hybrid"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LAYERS_PER_TABLE = 16


def hub_id(name: str) -> str | None:
    """``name`` when it reads as a hub id (``org/name``, not an existing local path)."""
    from rfkit.hub import is_embedded, looks_like_path

    name = str(name)
    if is_embedded(name) or not _HUB_ID.match(name) or looks_like_path(name):
        return None
    return name


def _float(value) -> str:
    return f"{float(value):.4f}"


def _count(value) -> str:
    value = float(value)
    return f"{int(round(value)):,}" if value.is_integer() else f"{value:,.1f}"


def _present(metrics: dict, key: str) -> bool:
    return metrics.get(key) is not None and not isinstance(metrics.get(key), (dict, list, str, bool))


def _settings(settings: dict, skip=("class_path",)) -> str:
    items = [f"{k}={json.dumps(v)}" for k, v in settings.items() if k not in skip]
    return ", ".join(items) if items else "no settings"


def _front_matter(head_map: HeadMap) -> list[str]:
    import yaml

    meta: dict = {"library_name": "rfkit"}
    base = hub_id(head_map.model)
    if base:
        meta["base_model"] = base
    meta["tags"] = list(TAGS)
    return ["---", yaml.safe_dump(meta, sort_keys=False, default_flow_style=None).strip(), "---", ""]


def _about(head_map: HeadMap, operator: dict | None) -> list[str]:
    from rfkit.version import __version__

    share = 100.0 * head_map.replaced_heads / head_map.total_heads if head_map.total_heads else 0.0
    blocks = "recurrent blocks"
    if operator and operator.get("class_path"):
        blocks = f"`{operator['class_path'].rsplit('.', 1)[-1]}` blocks"
    policy = head_map.policy.get("class_path", "an unrecorded policy")
    return [
        f"# RecurFormer hybrid of `{head_map.model}`",
        "",
        "## What this is",
        "",
        f"`{head_map.model}` converted by rfkit {__version__} into a RecurFormer hybrid: "
        f"{head_map.replaced_heads} of {head_map.total_heads} query heads ({share:.1f}%) were replaced by {blocks}, "
        "which carry a fixed-size state instead of a KV cache that grows with the context; the other heads "
        f"attend as before. `{policy}` chose the heads (see the head map below and `head_map.json`).",
        "",
    ]


def _how_to_load() -> list[str]:
    return [
        "## How to load",
        "",
        "```python",
        "import rfkit  # registers the converted model types (rf_llama, rf_mistral, rf_qwen2) with transformers",
        "from transformers import AutoModelForCausalLM",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")',
        "```",
        "",
    ]


def _layer_tables(head_map: HeadMap) -> list[str]:
    groups = head_map.replaced_kv_groups()
    lines = []
    for start in range(0, head_map.num_layers, _LAYERS_PER_TABLE):
        layers = range(start, min(head_map.num_layers, start + _LAYERS_PER_TABLE))
        lines += [
            "| layer | " + " | ".join(str(i) for i in layers) + " |",
            "|---|" + "---|" * len(layers),
            f"| query heads (of {head_map.num_heads}) | " + " | ".join(str(len(head_map.selected[i])) for i in layers) + " |",
        ]
        if groups:
            lines.append(f"| KV groups (of {head_map.num_kv_heads}) | " + " | ".join(str(groups[i]) for i in layers) + " |")
        lines.append("")
    return lines


def _data_line(data: dict) -> str:
    parts = [f"{k}={json.dumps(v)}" for k, v in data.items() if isinstance(v, (str, int, float, bool)) or v is None]
    blocks = data.get("blocks")
    if isinstance(blocks, dict):
        parts.append("blocks: " + ", ".join(f"{k} {v}" for k, v in blocks.items()))
    return ", ".join(parts)


def _head_map_summary(head_map: HeadMap, operator: dict | None) -> list[str]:
    share = 100.0 * head_map.replaced_heads / head_map.total_heads if head_map.total_heads else 0.0
    lines = [
        "## Head map",
        "",
        f"- Replaced query heads: {head_map.replaced_heads} of {head_map.total_heads} ({share:.1f}%)",
    ]
    groups = head_map.replaced_kv_groups()
    if groups:
        total = head_map.num_layers * head_map.num_kv_heads
        lines.append(
            f"- Replaced KV groups (every query head of the group replaced, its KV cache freed): {sum(groups)} of {total}"
        )
    lines.append(
        f"- Layout: {head_map.num_layers} layers, {head_map.num_heads} query heads, {head_map.num_kv_heads} KV heads per layer"
    )
    if operator:
        lines.append(f"- Replacement: `{operator.get('class_path', '?')}` ({_settings(operator.get('init_args') or {})})")
    if head_map.policy:
        lines.append(f"- Policy: `{head_map.policy.get('class_path', '?')}` ({_settings(head_map.policy)})")
    if head_map.samples:
        lines.append(
            f"- Profile: {head_map.samples} calibration samples of {head_map.seq_len} tokens, window {head_map.window}, "
            f"alpha {head_map.alpha}, first token excluded: {head_map.exclude_first_token}"
        )
    else:
        lines.append("- Profile: none (the policy needed no calibration profile)")
    lines.append(f"- Calibration data: {_data_line(head_map.data)}" if head_map.data else "- Calibration data: none")
    made = f"- Head map made with rfkit {head_map.rfkit_version or 'unknown'}"
    lines.append(made + (f" on {head_map.created}" if head_map.created else ""))
    fp = head_map.model_fingerprint
    if fp:
        weights = f"weights sha256 `{fp['weights']}`" if fp.get("weights") else "weights unknown"
        lines.append(f"- Fingerprint of the model the map was made on: config sha256 `{fp.get('config_sha256')}`, {weights}")
    else:
        lines.append("- Model fingerprint: unknown")
    if head_map.source:
        where = head_map.source.get("url") or head_map.source.get("path")
        lines.append(
            f"- Taken from the shared head map `{where}` (sha256 `{head_map.source.get('sha256')}`), "
            f"made for `{head_map.source.get('model')}`"
        )
    return lines + ["", "Query heads replaced per layer:", ""] + _layer_tables(head_map)


def _results(metrics: dict | None) -> list[str]:
    lines = ["## Measured results", ""]
    metrics = metrics or {}
    rows = []
    if _present(metrics, "ppl_original") or _present(metrics, "ppl_converted"):
        ratio = metrics.get("ppl_ratio")
        if ratio is None and _present(metrics, "ppl_original") and _present(metrics, "ppl_converted"):
            ratio = metrics["ppl_converted"] / metrics["ppl_original"]
        rows.append(("validation perplexity", metrics.get("ppl_original"), metrics.get("ppl_converted"), ratio, _float))
    if _present(metrics, "cache_bytes_per_token_original") or _present(metrics, "cache_bytes_per_token_converted"):
        rows.append(
            (
                "KV cache bytes per token",
                metrics.get("cache_bytes_per_token_original"),
                metrics.get("cache_bytes_per_token_converted"),
                metrics.get("cache_ratio"),
                _count,
            )
        )
    bullets = []
    if _present(metrics, "params_added") or _present(metrics, "params_removed"):
        added = _count(metrics["params_added"]) if _present(metrics, "params_added") else "not measured"
        removed = _count(metrics["params_removed"]) if _present(metrics, "params_removed") else "not measured"
        bullets.append(f"- Parameters added: {added}; removed: {removed}")
    if _present(metrics, "train_tokens"):
        bullets.append(f"- Training tokens: {_count(metrics['train_tokens'])}")
    if _present(metrics, "cache_seq_len"):
        bullets.append(f"- Cache measured after a prefill of {_count(metrics['cache_seq_len'])} tokens")
    if not rows and not bullets:
        return lines + ["Not measured.", ""]
    if rows:
        lines += ["| | original | converted | converted / original |", "|---|---|---|---|"]
        for name, before, after, ratio, fmt in rows:
            cells = [fmt(v) if v is not None else "not measured" for v in (before, after)]
            lines.append(f"| {name} | {cells[0]} | {cells[1]} | {_float(ratio) if ratio is not None else 'not measured'} |")
        lines.append("")
    return lines + bullets + ([""] if bullets else [])


def _recipe(config_text: str | None) -> list[str]:
    if not config_text:
        return []
    longest = max((len(run) for run in re.findall(r"`+", config_text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [
        "## Recipe",
        "",
        "The resolved rfkit configuration of the run (also in `config.yaml`):",
        "",
        f"{fence}yaml",
        config_text.rstrip("\n"),
        fence,
        "",
    ]


def model_card(
    head_map: HeadMap,
    config_text: str | None = None,
    metrics: dict | None = None,
    operator=None,
) -> str:
    """README.md for a converted model.

    Args:
        head_map: The map the model was converted with.
        config_text: The resolved recipe (YAML), shown in a fenced block.
        metrics: A run summary (``summary.json``'s keys: ``ppl_original``, ``ppl_converted``,
            ``ppl_ratio``, ``cache_bytes_per_token_*``, ``cache_ratio``, ``params_added``,
            ``params_removed``, ``train_tokens``, ``cache_seq_len``); absent keys are left out.
        operator: The replacement operator: a :class:`~rfkit.models.operators.ReplacementOperator` or
            its dict as saved in the model config (``rf_operator``: ``{class_path, init_args}``).
    """
    if operator is not None and hasattr(operator, "to_dict"):  # a ReplacementOperator instance
        operator = operator.to_dict()
    lines = (
        _front_matter(head_map)
        + _about(head_map, operator)
        + _how_to_load()
        + _head_map_summary(head_map, operator)
        + _results(metrics)
        + _recipe(config_text)
    )
    return "\n".join(lines).rstrip("\n") + "\n"
