"""Rotary position embedding of packed heads, as the converted layers and the window mixers apply it.

:func:`rotate` is the formula of transformers' ``apply_rotary_pos_emb`` for one tensor holding
queries and keys; :func:`rotation_matrix` is the same rotation as one matrix, so that a decode
step rotates every head of a layer in one product (and rounds once in half precision, as the
compiled CPU step does: ``rfkit/ops/kernels/window_cpu.c``).
"""

from __future__ import annotations

import weakref

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (B, H, L, hd) with the model's ``cos`` / ``sin`` (B, L, hd): the
    formula of transformers' ``apply_rotary_pos_emb`` for one tensor holding queries and keys
    (its ``rotate_half`` written out: it reads ``x.shape`` twice, one more call per decode step)."""
    half = x.shape[-1] // 2
    return x * cos.unsqueeze(1) + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.unsqueeze(1)


#: the last :func:`rotation_matrix` as one tuple (weak references to the ``cos`` / ``sin`` it was built
#: from, the matrix), replaced whole so that a reader never pairs one call's keys with another's matrix
_LAST_ROTATION: list = [None]
#: ``rotate_half`` as a signed permutation matrix, per (head_dim, dtype, device)
_SIGNED_PERMUTATIONS: dict = {}


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` as a matrix ``R`` ``(B, L, hd, hd)``: ``x @ R`` for ``x`` ``(B, H, L, hd)``
    rotates every head in one call. ``R = diag(cos) + P diag(sin)`` with ``P`` the signed
    permutation of ``rotate_half`` (``P = rotate_half(I)``, made once). A decode step's layers
    share one ``cos`` / ``sin`` pair (the model computes them once per forward), so the matrix
    is built once per token, by the first converted layer, and found again by the others."""
    last = _LAST_ROTATION[0]
    if last is not None and last[0]() is cos and last[1]() is sin:
        return last[2]
    hd = cos.shape[-1]
    key = (hd, cos.dtype, cos.device)
    signed = _SIGNED_PERMUTATIONS.get(key)
    if signed is None:
        eye = torch.eye(hd, dtype=cos.dtype, device=cos.device)
        signed = _SIGNED_PERMUTATIONS[key] = torch.cat((-eye[:, hd // 2 :], eye[:, : hd // 2]), dim=-1)
    matrix = torch.diag_embed(cos).addcmul_(signed, sin.unsqueeze(-2))
    _LAST_ROTATION[0] = (weakref.ref(cos), weakref.ref(sin), matrix)
    return matrix
