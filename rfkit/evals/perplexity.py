"""Perplexity from summed next-token NLL: the metric and the evaluation loop that ``rfkit fit``'s
:class:`~rfkit.callbacks.perplexity.PerplexityMonitor`, ``rfkit eval ppl``, ``rfkit eval
context`` and ``rfkit sweep`` share.

The callbacks run inside ``rfkit fit``, a layer below the evaluation commands, so this module
ranks with them (``tests/test_layout.py``): it imports only from ``rfkit.training`` and below,
and ``rfkit/evals/__init__.py`` imports nothing, so importing it loads no evaluation command.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric
from tqdm.auto import tqdm

from rfkit.conversion.profile import dist_rank_world
from rfkit.training.losses import summed_nll


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
