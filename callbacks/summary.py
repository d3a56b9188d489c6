"""Writes the run's summary.json, head map and converted model (with its model card) at the end of ``rfkit fit``.

The model is written by the pipeline's save step, :func:`rfkit.pipeline.save`, which this callback
runs at the end of training.

Distributed runs (DDP, FSDP): every rank takes part in what needs all ranks (summing the
training tokens, ``trainer.log_dir``, which broadcasts, and, under FSDP, the save step's gather
of the sharded weights into one unsharded copy on rank 0); only global rank 0 writes files.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import torch

from rfkit.atomic import atomic_write_json
from rfkit.training.report import final_screen
from rfkit import pipeline
from rfkit.training.saving import fsdp_root

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
    """The run directory. ``trainer.log_dir`` is a broadcast under DDP/FSDP: call on every rank."""
    return Path(trainer.log_dir or trainer.default_root_dir)


class RunSummary(L.Callback):
    """Collects what the other callbacks and the module measured into ``summary.json``.

    Args:
        save_model: Also save the converted model (HF format) to ``<run dir>/model``.
    """

    def __init__(self, save_model: bool = True):
        self.save_model = save_model
        self._written = False

    def summary(self, trainer, pl_module) -> dict:
        """The summary dict; sums the training tokens over ranks, so call it on every rank."""
        metrics = dict(pl_module.run_metrics)
        # on the strategy's device: NCCL reduces CUDA tensors only, and by on_fit_end the
        # strategy's teardown has moved the module itself to the CPU
        tokens = torch.tensor(float(pl_module.train_tokens), dtype=torch.float64, device=trainer.strategy.root_device)
        metrics["train_tokens"] = int(trainer.strategy.reduce(tokens, reduce_op="sum"))  # summed over ranks
        metrics["wall_seconds"] = round(getattr(pl_module, "_wall_before", 0.0) + time.time() - pl_module.started, 1)  # resumed runs included
        ordered = {key: metrics.get(key) for key in SUMMARY_FIELDS}
        ordered.update({k: v for k, v in metrics.items() if k not in ordered})
        if ordered.get("ppl_original") and ordered.get("ppl_converted"):
            ordered["ppl_ratio"] = ordered["ppl_converted"] / ordered["ppl_original"]
        return ordered

    def on_fit_start(self, trainer, pl_module) -> None:
        self._written = False

    def on_train_end(self, trainer, pl_module) -> None:
        # A sharded model must be gathered while its shards are still where FSDP put them: the
        # strategy's teardown (before on_fit_end) moves them to the CPU.
        if fsdp_root(trainer) is not None:
            self._write(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self._written:
            self._write(trainer, pl_module)

    def _write(self, trainer, pl_module) -> None:
        # collectives first, on every rank (a collective on rank 0 alone would wait forever)
        out = run_dir(trainer)
        summary = self.summary(trainer, pl_module)
        self._written = True
        if trainer.is_global_zero and pl_module.head_map is not None:
            pl_module.head_map.save(out / "head_map.json")
        saved = None
        if self.save_model and pl_module.head_map is not None:
            # the pipeline's save step, on every rank (under FSDP it gathers the shards first)
            tokenizer = getattr(trainer.datamodule, "tokenizer", None)
            text = config_text(trainer, out) if trainer.is_global_zero else None
            saved = pipeline.save(trainer, pl_module, out / "model", tokenizer, text, metrics=summary)
        if not trainer.is_global_zero:
            return
        if saved is not None:
            summary["model_dir"] = str(saved)
        phases = getattr(getattr(pl_module, "phases", None), "seconds", None)
        if phases:
            summary["phases"] = dict(phases)
        from rfkit.provenance import stamp

        atomic_write_json(out / "summary.json", stamp(summary, wall_seconds=summary.get("wall_seconds")))
        print(final_screen(summary, "fit", saved, out / "summary.json"))


def config_text(trainer, out: Path) -> str | None:
    """The run's resolved recipe: what the rfkit CLI handed the trainer, else the log dir's config.yaml."""
    text = getattr(trainer, "rf_config_text", None)
    if text is None and (out / "config.yaml").is_file():
        text = (out / "config.yaml").read_text()
    return text

