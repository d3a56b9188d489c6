"""The next-token loss shared by training, validation, perplexity evaluation and the MQAR
experiment: summed NLL and the number of tokens it covers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def summed_nll(logits: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL in float32 (log-softmax via cross_entropy) and the token count.

    ``labels`` (same shape as ``input_ids``, -100 where no loss is wanted, as in transformers)
    restricts the loss, for example to the completion of a prompt; by default every next
    token counts.
    """
    shift_logits = logits[:, :-1].float()
    targets = (input_ids if labels is None else labels)[:, 1:]
    nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), targets.reshape(-1), reduction="sum", ignore_index=-100
    )
    return nll, int((targets != -100).sum()) if labels is not None else targets.numel()
