"""Cache bytes actually held, for the original and the converted model."""

from __future__ import annotations

import lightning as L

from rfkit.models.cache import measure_cache


class CacheMonitor(L.Callback):
    """Measures the KV cache (plus mixer state) that a prefill of one validation block leaves.

    Numbers come from the tensors the cache holds (kept heads' K/V and the Mamba conv and SSM
    states), not from a formula. Logged per token (the part that grows with length) and as the
    total at the block length, which is the cache peak of that prefill.

    Args:
        batch_size: Number of validation blocks in the measured prefill.
    """

    def __init__(self, batch_size: int = 1):
        self.batch_size = batch_size

    def _measure(self, pl_module, datamodule, tag: str) -> None:
        if datamodule is None:
            return
        datamodule.setup("fit")
        ids = datamodule.validation[: self.batch_size].to(next(pl_module.model.parameters()).device)
        measured = measure_cache(pl_module.model, ids)
        per_sample = ids.shape[0]
        pl_module.run_metrics[f"cache_bytes_per_token_{tag}"] = measured["kv_bytes_per_token"]
        pl_module.run_metrics[f"cache_state_bytes_{tag}"] = measured["state"] // per_sample
        pl_module.run_metrics[f"cache_peak_bytes_{tag}"] = measured["total"] // per_sample
        pl_module.run_metrics["cache_seq_len"] = ids.shape[1]

    def on_before_convert(self, pl_module, datamodule) -> None:
        self._measure(pl_module, datamodule, "original")

    def on_after_convert(self, pl_module, datamodule) -> None:
        self._measure(pl_module, datamodule, "converted")
        original = pl_module.run_metrics.get("cache_bytes_per_token_original")
        if original:
            pl_module.run_metrics["cache_ratio"] = pl_module.run_metrics["cache_bytes_per_token_converted"] / original

    def on_fit_start(self, trainer, pl_module) -> None:
        for key in ("cache_bytes_per_token_original", "cache_bytes_per_token_converted", "cache_ratio"):
            if key in pl_module.run_metrics and trainer.logger is not None:
                trainer.logger.log_metrics({key: float(pl_module.run_metrics[key])}, step=0)
