"""Attention transfer's loss after ``W_O`` (``transfer.space: output``), through the Gram matrix of
the replaced heads' ``W_O`` columns: one matrix product per layer and batch.

:func:`rfkit.training.transfer.train_blocks` gives the Gram matrix the dtype the targets were
captured in when that is bf16 (a bf16 model), float32 otherwise: in float32 the product was about
a fifth of a beta 0.9 transfer step on a 2-core CPU with native bf16, and bf16 runs the step's loss
2.5 times as fast (``benchmarks/transfer_gram.py``; ``benchmarks/results/transfer_gram/b09.json``).
The error, its square and the sum stay float32, so the loss and its gradient differ from
float32's by bf16's rounding of the product alone.
"""

from __future__ import annotations

import torch


class _GramSquare(torch.autograd.Function):
    """``sum(d * (d @ G))`` for a symmetric ``G``, with the gradient ``2 d G`` kept from the
    forward: one matrix product in all where ``((d @ P) ** 2).sum()`` (``G = P P^T``) takes three.
    The product runs in ``G``'s dtype (``d`` cast to it, the result back to ``d``'s), the sum in
    ``d``'s."""

    @staticmethod
    def forward(ctx, d, G):
        dG = (d.to(G.dtype) @ G).to(d.dtype)
        ctx.save_for_backward(dG)
        return (d * dG).sum()

    @staticmethod
    def backward(ctx, grad):
        (dG,) = ctx.saved_tensors
        return 2 * grad * dG, None


def mapped_mse(d: torch.Tensor, gram: torch.Tensor | None, proj: torch.Tensor | None) -> torch.Tensor:
    """``F.mse_loss(d @ proj, 0)`` (plain ``d``'s mean square without ``proj``) through the Gram
    matrix ``gram = proj @ proj.T``: the error of the block's output after ``W_O`` without mapping
    the prediction and the target through it every step (``d_out <= hidden``: at most the same
    work, a third of it for one KV group of three). The product ``d @ gram`` runs in ``gram``'s
    dtype."""
    if proj is None:
        return d.pow(2).mean()
    return _GramSquare.apply(d, gram) / (d[..., 0].numel() * proj.shape[1])
