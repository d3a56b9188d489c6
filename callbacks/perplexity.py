"""Perplexity from summed token NLL, for the original and the converted model.

Distributed runs (DDP, FSDP): validation sums are reduced over the ranks (each rank saw its
share of the validation blocks) on every rank, so every rank logs and records the same value;
the perplexity before conversion and after training is computed on every rank over all the
validation blocks (under FSDP through the sharded root module, in step on every rank).
"""

from __future__ import annotations

import lightning as L
import torch
from torchmetrics import Metric
from tqdm.auto import tqdm


class SummedNLL(Metric):
    """Accumulates summed next-token NLL and token counts; ``compute`` gives perplexity.

    The NLL comes from ``cross_entropy`` on float32 logits (a log-softmax, never a softmax
    over the vocabulary); sums are kept in float64 so long evaluations do not lose digits.
    """

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("nll", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, nll_sum: torch.Tensor, tokens: int) -> None:
        self.nll += nll_sum.detach().to(torch.float64)
        self.tokens += int(tokens)

    def compute(self) -> torch.Tensor:
        return torch.exp(self.nll / self.tokens.clamp_min(1))


@torch.no_grad()
def evaluate_perplexity(model, batches, max_batches: int | None = None, desc: str = "perplexity") -> float:
    """Perplexity of ``model`` over ``batches`` (dicts with ``input_ids``); the progress bar shows
    on rank 0 of a distributed run only."""
    from rfkit.conversion.profile import dist_rank_world
    from rfkit.training.losses import summed_nll

    metric = SummedNLL()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = len(batches) if max_batches is None else min(max_batches, len(batches))
    for i, batch in enumerate(tqdm(batches, desc=desc, total=total, unit="batch", disable=dist_rank_world()[0] != 0)):
        if max_batches is not None and i >= max_batches:
            break
        ids = batch["input_ids"].to(device)
        metric.update(*summed_nll(model(input_ids=ids, use_cache=False).logits, ids))
    model.train(was_training)
    return float(metric.compute())


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
        if datamodule is not None:
            ppl = self._evaluate(pl_module, datamodule, "perplexity (original)")
            pl_module.run_metrics["ppl_original"] = ppl

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
