"""Head profiling (paper section 3.1): recency ratio RR, recency-aware index RA-I, and
normalised attention entropy.

For head h and one sample with causal softmax attention A[h, i, j]::

    RR_h = sum_{|i-j| <= k} A[h, i, j] / sum_{i, j} A[h, i, j]

With first-token exclusion, row 0 and column 0 are left out of both sums, so heads that park
attention on token 0 (an attention sink) are judged by where the rest of their attention goes.
A head's RA-I counts the samples in which RR_h > alpha.

The normalised attention entropy of query row i is the entropy of the row's attention
distribution divided by its maximum, the log of the number of tokens the row can see::

    E_h,i = -sum_j A[h, i, j] log A[h, i, j] / log(i + 1)        (rows i >= 1)

so a row spread uniformly over its prefix gives 1 and a row on one token gives 0. First-token
exclusion applies to entropy as it does to RR: column 0 is dropped and each row renormalised
over tokens 1..i (as the RR denominator leaves the sink's share out), so the row's maximum is
log(i) and only rows i >= 2 count. A sink head is then judged by how it spreads the rest of its
attention. A head's entropy in one sample is the mean of E_h,i over the counted rows; the
profile keeps its mean over samples (``entropy_mean``).

The attention is never materialised for the whole model: profiling swaps in an attention
function (:func:`capture_attention`, registered with transformers' ``AttentionInterface``)
that computes each layer's output in query chunks and accumulates the RR sums and row
entropies on the way, so peak memory is O(chunk x L) for one layer.

Under ``torch.distributed`` (a DDP or FSDP run with more than one process), each rank profiles
only its shard of the calibration batches (batch ``i`` on rank ``i % world_size``) and the counts
and sums are then all-reduced, so every rank returns the same profile, the one a single process
would compute.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from rfkit.models.layout import AttentionLayout

log = logging.getLogger(__name__)

PROFILE_ATTENTION = "rfkit_recency_profile"


def recency_mask(q_positions: torch.Tensor, L: int, window: int, exclude_first_token: bool):
    """Masks for the RR numerator and denominator over rows ``q_positions`` and all L columns."""
    i = q_positions[:, None]  # (c, 1)
    j = torch.arange(L, device=q_positions.device)[None, :]  # (1, L)
    causal = j <= i
    denom = causal
    if exclude_first_token:
        denom = denom & (j >= 1) & (i >= 1)
    numer = denom & (i - j <= window)
    return numer, denom


def recency_ratio(attn: torch.Tensor, window: int, exclude_first_token: bool = True) -> torch.Tensor:
    """RR per head from full attention matrices ``attn`` (..., H, L, L) -> (..., H).

    The reference definition, used by tests and for small inputs.
    """
    L = attn.shape[-1]
    numer, denom = recency_mask(torch.arange(L, device=attn.device), L, window, exclude_first_token)
    a = attn.float()
    return (a * numer).sum((-1, -2)) / (a * denom).sum((-1, -2)).clamp_min(1e-30)


def _entropy_rows(exclude_first_token: bool) -> tuple[int, int]:
    """(first counted row, tokens left out of every row): rows with at least two tokens to
    attend to count; with first-token exclusion column 0 is not among them."""
    skip = 1 if exclude_first_token else 0
    return 1 + skip, skip


def attention_entropy(attn: torch.Tensor, exclude_first_token: bool = True) -> torch.Tensor:
    """Mean normalised row entropy per head from full attention matrices ``attn`` (..., H, L, L)
    -> (..., H).

    The reference definition (see the module docstring), used by tests and for small inputs.
    """
    L = attn.shape[-1]
    first, skip = _entropy_rows(exclude_first_token)
    if L <= first:
        return attn.new_zeros(attn.shape[:-2], dtype=torch.float64)
    a = attn.double()[..., first:, skip:]  # counted rows, visible columns
    a = a / a.sum(-1, keepdim=True).clamp_min(1e-300)  # renormalised without column 0 (a no-op otherwise)
    visible = torch.arange(first, L, dtype=torch.float64, device=attn.device) + 1 - skip  # tokens per row
    rows = -torch.special.xlogy(a, a).sum(-1) / visible.log()
    return rows.mean(-1)


@dataclass
class HeadProfile:
    """RR and attention-entropy statistics of every query head over the calibration set.

    Profiles cached before entropy was collected load with an empty ``entropy_mean``.
    """

    window: int
    alpha: float
    exclude_first_token: bool
    seq_len: int
    samples: int
    rai: list[list[int]]  # (layers, query heads): samples with RR > alpha
    rr_mean: list[list[float]]  # (layers, query heads)
    meta: dict = field(default_factory=dict)
    entropy_mean: list[list[float]] = field(default_factory=list)  # (layers, query heads), in [0, 1]


class _RecencyCollector:
    def __init__(self, layout: AttentionLayout, window: int, alpha: float, exclude_first_token: bool, chunk: int):
        self.layout, self.window, self.alpha = layout, window, alpha
        self.exclude_first_token, self.chunk = exclude_first_token, chunk
        shape = (layout.num_layers, layout.num_heads)
        self.rai = torch.zeros(shape, dtype=torch.long)
        self.rr_sum = torch.zeros(shape, dtype=torch.float64)
        self.entropy_sum = torch.zeros(shape, dtype=torch.float64)
        self.samples = 0

    def attend(self, module, query, key, value, scaling: float):
        """Causal attention in query chunks; accumulates RR and entropy.
        query (B, H, L, d), key/value (B, Hkv, L, d)."""
        B, H, L, _ = query.shape
        rep = H // key.shape[1]
        key = key.repeat_interleave(rep, dim=1) if rep > 1 else key
        value = value.repeat_interleave(rep, dim=1) if rep > 1 else value
        out = torch.empty_like(query)
        numer = torch.zeros(B, H, dtype=torch.float64, device=query.device)
        denom = torch.zeros_like(numer)
        entropy = torch.zeros_like(numer)
        first, skip = _entropy_rows(self.exclude_first_token)
        for start in range(0, L, self.chunk):
            rows = torch.arange(start, min(L, start + self.chunk), device=query.device)
            scores = torch.matmul(query[:, :, rows], key.transpose(-1, -2)).float() * scaling  # (B, H, c, L)
            scores = scores.masked_fill(rows[:, None] < torch.arange(L, device=query.device)[None, :], float("-inf"))
            probs = scores.softmax(-1)
            out[:, :, rows] = torch.matmul(probs.to(value.dtype), value)
            n_mask, d_mask = recency_mask(rows, L, self.window, self.exclude_first_token)
            numer += (probs * n_mask).sum((-1, -2)).double()
            denom += (probs * d_mask).sum((-1, -2)).double()
            entropy += self._row_entropy(scores, probs, rows, first, skip)
        rr = (numer / denom.clamp_min(1e-30)).cpu()  # (B, H)
        layer = module.layer_idx
        self.rai[layer] += (rr > self.alpha).sum(0)
        self.rr_sum[layer] += rr.sum(0)
        self.entropy_sum[layer] += (entropy / max(1, L - first)).sum(0).cpu()  # mean over counted rows
        if layer == 0:
            self.samples += B
        return out.transpose(1, 2).contiguous()  # (B, L, H, d) as HF attention functions return

    @staticmethod
    def _row_entropy(scores, probs, rows, first: int, skip: int) -> torch.Tensor:
        """Sum over the chunk's counted rows of their normalised entropy, (B, H) float64.
        ``scores`` (B, H, c, L) are causally masked; ``probs`` their softmax."""
        if skip:  # renormalise over tokens 1..i: a softmax without column 0 (one more (B, H, c, L) buffer)
            probs = scores[..., skip:].softmax(-1)  # row 0 gives NaN; never counted
        visible = (rows + 1 - skip).to(torch.float64)  # tokens each row sees
        per_row = -torch.special.xlogy(probs, probs).sum(-1).double() / visible.log()  # (B, H, c)
        counted = rows >= first
        return torch.where(counted, per_row, torch.zeros_like(per_row)).sum(-1)


# attention implementation name -> the collector of the capture in progress under that name
_ACTIVE: dict[str, object] = {}
# attention implementation name -> the error raised when it runs outside a capture
_OUTSIDE: dict[str, str] = {}


def _capture_function(name: str):
    """The attention function registered as ``name``: hands each layer's call to the active
    collector's ``attend``."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        collector = _ACTIVE.get(name)
        if collector is None:
            raise RuntimeError(_OUTSIDE[name])
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        return collector.attend(module, query, key, value, scaling), None

    return attention


def _register(name: str, outside: str) -> None:
    from transformers import AttentionInterface

    _OUTSIDE[name] = outside
    AttentionInterface.register(name, _capture_function(name))
    try:  # the mask is not used (blocks are unpadded; causality is applied in attend()), but must be built
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(name, sdpa_mask)
    except ImportError:  # older transformers without a mask registry
        pass


@contextmanager
def capture_attention(
    model,
    collector,
    name: str = PROFILE_ATTENTION,
    outside: str = "rfkit profiling attention called outside profile_heads()",
):
    """Run every attention layer of ``model`` through ``collector.attend(module, query, key,
    value, scaling)`` for the duration; the previous attention implementation comes back after.

    ``attend`` gets query (B, H, L, d) and key/value (B, Hkv, L, d) after RoPE, must apply the
    causal mask itself (unpadded blocks only) and returns the attention output (B, L, H, d), as
    HF attention functions do. The function is registered with transformers'
    ``AttentionInterface`` under ``name``; ``outside`` is the error it raises when called with
    no capture under way. Used by :func:`profile_heads` and by :mod:`rfkit.conversion.head_report`.
    """
    _register(name, outside)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    _ACTIVE[name] = collector
    try:
        yield
    finally:
        _ACTIVE.pop(name, None)
        model.set_attn_implementation(previous)


def dist_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default ``torch.distributed`` process group, or ``(0, 1)``
    when there is none (or it has one process)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world > 1:
            return dist.get_rank(), world
    return 0, 1


def collective_device(fallback: torch.device) -> torch.device:
    """Where tensors must live for a collective on the default process group: the CPU when the
    backend serves CPU tensors (gloo, mpi, or a ``cpu:gloo,cuda:nccl`` mix), else ``fallback``
    (the model's device; NCCL takes CUDA tensors only)."""
    backend = str(torch.distributed.get_backend()).lower()
    if any(name in backend for name in ("gloo", "mpi")):
        return torch.device("cpu")
    return fallback


def _all_reduce(tensors: list[torch.Tensor], device: torch.device, op=None) -> list[torch.Tensor]:
    """Sum (or ``op``) ``tensors`` over all ranks; returns CPU tensors."""
    dist = torch.distributed
    out = []
    for t in tensors:
        moved = t.to(device).contiguous()
        dist.all_reduce(moved, op=dist.ReduceOp.SUM if op is None else op)
        out.append(moved.cpu())
    return out


@torch.no_grad()
def profile_heads(
    model,
    batches,
    window: int,
    alpha: float,
    exclude_first_token: bool = True,
    chunk: int = 128,
    progress: bool = True,
) -> HeadProfile:
    """Run calibration ``batches`` (dicts with ``input_ids`` (B, L)) through ``model``; return RR
    and entropy stats.

    With an initialised ``torch.distributed`` process group of more than one rank, every rank
    must call this with the same ``batches``: rank r runs batches r, r + world_size, ... and the
    counts and sums are all-reduced, so all ranks return the single-process profile (RA-I and
    ``samples`` exactly, the means to float64 summation order). The progress bar shows on rank 0.
    """
    layout = AttentionLayout.from_config(model.config)
    collector = _RecencyCollector(layout, window, alpha, exclude_first_token, chunk)
    device = next(model.parameters()).device
    rank, world = dist_rank_world()
    seq_len = 0
    was_training = model.training
    model.eval()
    with capture_attention(model, collector):
        for i, batch in enumerate(tqdm(batches, desc="profiling heads", disable=not progress or rank != 0, unit="batch")):
            if i % world != rank:  # another rank's shard
                continue
            ids = batch["input_ids"].to(device)
            seq_len = ids.shape[1]
            model(input_ids=ids, use_cache=False)
    model.train(was_training)
    if world > 1:  # every rank reaches this, also one whose shard was empty
        where = collective_device(device)
        counts = torch.cat([collector.rai.flatten(), torch.tensor([collector.samples], dtype=torch.long)])
        sums = torch.stack([collector.rr_sum, collector.entropy_sum])
        counts, sums = _all_reduce([counts, sums], where)
        (longest,) = _all_reduce([torch.tensor([seq_len], dtype=torch.long)], where, torch.distributed.ReduceOp.MAX)
        collector.rai = counts[:-1].view_as(collector.rai)
        collector.samples = int(counts[-1])
        collector.rr_sum, collector.entropy_sum = sums[0], sums[1]
        seq_len = int(longest)
    if collector.samples == 0:
        raise ValueError("profiling got no calibration samples")
    rr_mean = (collector.rr_sum / collector.samples).tolist()
    entropy_mean = (collector.entropy_sum / collector.samples).tolist()
    return HeadProfile(
        window=window,
        alpha=alpha,
        exclude_first_token=exclude_first_token,
        seq_len=seq_len,
        samples=collector.samples,
        rai=collector.rai.tolist(),
        rr_mean=[[round(v, 6) for v in row] for row in rr_mean],
        entropy_mean=[[round(v, 6) for v in row] for row in entropy_mean],
    )
