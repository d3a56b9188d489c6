"""Perplexity from summed token NLL, for the original and the converted model (the metric and
the evaluation loop are :mod:`rfkit.evals.perplexity`).

Distributed runs (DDP, FSDP): validation sums are reduced over the ranks (each rank saw its
share of the validation blocks) on every rank, so every rank logs and records the same value;
the perplexity before conversion and after training is computed on every rank over all the
validation blocks (under FSDP through the sharded root module, in step on every rank).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import lightning as L
import torch

from rfkit.evals.perplexity import SummedNLL, evaluate_perplexity

log = logging.getLogger(__name__)

# bump when what evaluate_perplexity computes changes, so older cached values are not reused
ORIGINAL_CACHE_VERSION = 1


class PerplexityMonitor(L.Callback):
    """Validation perplexity of the original model (before conversion) and of the converted
    model (during validation and after training), on the same validation blocks.

    Args:
        max_batches: Evaluate at most this many validation batches (None: all).
    """

    def __init__(self, max_batches: int | None = None):
        self.max_batches = max_batches
        # reduced explicitly in on_validation_epoch_end (on the strategy's device, as NCCL needs),
        # not by torchmetrics' own sync of these CPU states
        self.metric = SummedNLL(sync_on_compute=False)

    def _evaluate(self, pl_module, datamodule, desc: str) -> float:
        return evaluate_perplexity(pl_module.model, datamodule.val_dataloader(), self.max_batches, desc)

    def on_before_convert(self, pl_module, datamodule) -> None:
        if datamodule is None:
            return
        path = self.original_cache_path(pl_module, datamodule)
        reuse = path is not None and getattr(pl_module, "reuse_profile", True) and path.is_file()
        if reuse:
            ppl = float(json.loads(path.read_text())["ppl"])
            log.info("reusing the original model's perplexity %.4f from %s", ppl, path)
        else:
            ppl = self._evaluate(pl_module, datamodule, "perplexity (original)")
            from rfkit.conversion.profile import dist_rank_world

            if path is not None and dist_rank_world()[0] == 0:  # one writer, as for the head profile
                from rfkit.atomic import atomic_write_json

                atomic_write_json(path, {"ppl": ppl})
        pl_module.run_metrics["ppl_original"] = ppl

    def original_cache_path(self, pl_module, datamodule) -> Path | None:
        """Where the original model's validation perplexity is cached: keyed by the model
        (``model.base_model``), the data (the blocks' fingerprint, validation blocks, batch size),
        ``max_batches``, and the dtype and device it runs in. None when the model has no name to
        key it by. Reused when ``model.reuse_profile`` is on, like the head profile."""
        from rfkit.hub import cache_dir

        name = getattr(pl_module, "base_model", None)
        fingerprint = getattr(datamodule, "fingerprint", None)
        if not isinstance(name, str) or fingerprint is None:
            return None
        weights = next(pl_module.model.parameters())
        key = {
            "model": name, "data": fingerprint(), "val_blocks": getattr(datamodule, "val_blocks", None),
            "batch_size": getattr(datamodule, "batch_size", None), "max_batches": self.max_batches,
            "dtype": str(weights.dtype), "device": weights.device.type, "version": ORIGINAL_CACHE_VERSION,
        }  # fmt: skip
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return cache_dir() / "original_ppl" / f"{digest}.json"

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.metric.reset()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if isinstance(outputs, dict) and "nll_sum" in outputs:
            self.metric.update(outputs["nll_sum"].cpu(), outputs["tokens"])

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:  # the same on every rank, unlike a rank's own token count
            return
        # summed over ranks on every rank (a reduce on some ranks only would wait forever)
        sums = torch.stack([self.metric.nll, self.metric.tokens.to(torch.float64)]).to(trainer.strategy.root_device)
        nll, tokens = trainer.strategy.reduce(sums, reduce_op="sum").cpu().tolist()
        if tokens > 0:
            ppl = float(torch.exp(torch.tensor(nll / tokens, dtype=torch.float64)))
            pl_module.log("val_ppl", ppl, sync_dist=True)  # already the same on every rank; says so to Lightning
            pl_module.run_metrics["ppl_converted"] = ppl

    def on_train_end(self, trainer, pl_module) -> None:
        datamodule = trainer.datamodule
        if datamodule is None:
            return
        from rfkit.training.progress import phase

        with phase(pl_module, "measure", "the converted model"):
            pl_module.run_metrics["ppl_converted"] = self._converted(trainer, pl_module, datamodule)

    def _converted(self, trainer, pl_module, datamodule) -> float:
        from rfkit.callbacks.summary import fsdp_root

        root = fsdp_root(trainer)
        if root is not None:
            # FSDP: pl_module.model holds shards; the root module gathers them layer by layer for
            # each forward (a collective: every rank runs the same batches), and its forward is
            # RecurFormerModule.forward, the HF model's
            ppl = evaluate_perplexity(root, datamodule.val_dataloader(), self.max_batches, "perplexity (converted)")
        else:  # one process, or DDP: every rank holds the whole model; no collective needed
            ppl = self._evaluate(pl_module, datamodule, "perplexity (converted)")
        return ppl
