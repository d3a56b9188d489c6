"""Writes the run's summary.json, head map and converted model (with its model card) at the end of ``rfkit fit``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import torch

from rfkit.headmap import atomic_write_json

SUMMARY_FIELDS = (
    "ppl_original",
    "ppl_converted",
    "cache_bytes_per_token_original",
    "cache_bytes_per_token_converted",
    "params_added",
    "params_removed",
    "replaced_heads",
    "total_heads",
    "train_tokens",
    "wall_seconds",
)


def run_dir(trainer) -> Path:
    return Path(trainer.log_dir or trainer.default_root_dir)


class RunSummary(L.Callback):
    """Collects what the other callbacks and the module measured into ``summary.json``.

    Args:
        save_model: Also save the converted model (HF format) to ``<run dir>/model``.
    """

    def __init__(self, save_model: bool = True):
        self.save_model = save_model

    def summary(self, trainer, pl_module) -> dict:
        metrics = dict(pl_module.run_metrics)
        tokens = torch.tensor(float(pl_module.train_tokens), device=pl_module.device)
        metrics["train_tokens"] = int(trainer.strategy.reduce(tokens, reduce_op="sum"))  # summed over ranks
        metrics["wall_seconds"] = round(time.time() - pl_module.started, 1)
        ordered = {key: metrics.get(key) for key in SUMMARY_FIELDS}
        ordered.update({k: v for k, v in metrics.items() if k not in ordered})
        if ordered.get("ppl_original") and ordered.get("ppl_converted"):
            ordered["ppl_ratio"] = ordered["ppl_converted"] / ordered["ppl_original"]
        return ordered

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        out = run_dir(trainer)
        summary = self.summary(trainer, pl_module)
        if pl_module.head_map is not None:
            pl_module.head_map.save(out / "head_map.json")
        if self.save_model and pl_module.head_map is not None:
            from rfkit.convert import save_converted

            tokenizer = getattr(trainer.datamodule, "tokenizer", None)
            saved = save_converted(
                pl_module.model, pl_module.head_map, out / "model", tokenizer, config_text(trainer, out), metrics=summary
            )
            summary["model_dir"] = str(saved)
        atomic_write_json(out / "summary.json", summary)
        print(format_summary(summary, out / "summary.json"))


def config_text(trainer, out: Path) -> str | None:
    """The run's resolved recipe: what the rfkit CLI handed the trainer, else the log dir's config.yaml."""
    text = getattr(trainer, "rf_config_text", None)
    if text is None and (out / "config.yaml").is_file():
        text = (out / "config.yaml").read_text()
    return text


def format_summary(summary: dict, path: Path) -> str:
    lines = [f"rfkit summary ({path})"]
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) else json.dumps(value)
        lines.append(f"  {key:34s} {shown}")
    return "\n".join(lines)
