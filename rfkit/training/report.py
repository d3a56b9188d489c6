"""The screen that ends ``rfkit fit`` and ``rfkit convert``: a short table of what the conversion
cost and saved, where the model is, and what to run next with that path filled in.

Per-layer details (transfer losses, calibration, LoRA layers) stay in ``summary.json`` and the
model card; nothing here is wider than the terminal (paths aside, which are shown relative to
the working directory when they are inside it).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from rfkit.training.progress import format_seconds


def shown_path(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies inside it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _number(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 100):  # counts, bytes
        return f"{int(value):,}"
    return f"{value:,.{digits}f}"


def _ratio(new, old) -> str:
    return f"{new / old:.3f}" if new is not None and old else "-"


def summary_table(summary: dict) -> list[str]:
    """The rows of the end screen's table (only what the run measured)."""
    ppl_o, ppl_c = summary.get("ppl_original"), summary.get("ppl_converted")
    kv_o, kv_c = summary.get("cache_bytes_per_token_original"), summary.get("cache_bytes_per_token_converted")
    rows = [f"  {'':<22}{'original':>12}{'converted':>12}{'ratio':>9}"]
    if ppl_o is not None or ppl_c is not None:
        rows.append(f"  {'perplexity':<22}{_number(ppl_o):>12}{_number(ppl_c):>12}{_ratio(ppl_c, ppl_o):>9}")
    if kv_o is not None or kv_c is not None:
        rows.append(f"  {'KV cache bytes/token':<22}{_number(kv_o):>12}{_number(kv_c):>12}{_ratio(kv_c, kv_o):>9}")
    facts = []
    if summary.get("replaced_heads") is not None:
        facts.append(("heads replaced", f"{summary['replaced_heads']} of {summary.get('total_heads', '?')} query heads"))
    if summary.get("params_added") is not None:
        facts.append(("parameters", f"+{summary['params_added']:,} added, -{summary.get('params_removed', 0):,} removed"))
    if summary.get("train_tokens") is not None:
        facts.append(("training tokens", f"{summary['train_tokens']:,}"))
    if summary.get("wall_seconds") is not None:
        facts.append(("wall time", format_seconds(summary["wall_seconds"])))
    rows += [f"  {name:<22}{value}" for name, value in facts]
    return rows


def next_commands(model_dir: str) -> list[str]:
    """Two commands and a generate snippet for the saved model, its path filled in."""
    quoted = shlex.quote(model_dir)
    if (Path(model_dir) / "modeling_rfkit.py").is_file():  # the folder carries its code: transformers alone loads it
        load = ["  generate (Python; the folder carries its code, no rfkit needed):"]
        model_args = "path, trust_remote_code=True"
    else:
        load = ["  generate (Python):", "    import rfkit  # registers the converted model classes with transformers"]
        model_args = "path"
    return [
        f"  rfkit eval ppl --model {quoted}",
        f"  rfkit eval passkey --model {quoted} --lengths 1024,2048",
        f"  rfkit bench cache --model {quoted}",
        "",
        *load,
        "    from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"    path = {model_dir!r}",
        "    tok = AutoTokenizer.from_pretrained(path)",
        f"    model = AutoModelForCausalLM.from_pretrained({model_args})",
        '    out = model.generate(**tok("The river", return_tensors="pt"), max_new_tokens=30)',
        "    print(tok.decode(out[0], skip_special_tokens=True))",
    ]


def final_screen(summary: dict, command: str, model_dir: str | Path | None, summary_path: str | Path | None) -> str:
    """What ``rfkit fit`` / ``rfkit convert`` print last."""
    lines = ["", f"rfkit {command}: done" + (f" in {format_seconds(summary['wall_seconds'])}" if summary.get("wall_seconds") else ""), ""]
    lines += summary_table(summary)
    lines.append("")
    if model_dir is not None:
        lines.append(f"  model    {shown_path(model_dir)}")
    if summary_path is not None:
        lines.append(f"  summary  {shown_path(summary_path)}  (per-layer details)")
    if model_dir is not None:
        lines += ["", "next:"] + next_commands(shown_path(model_dir))
    return "\n".join(lines)

