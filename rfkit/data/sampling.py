"""What the data loaders iterate: packed blocks as a dataset, the resumable training order, and
that order with long blocks interleaved (``data.long_source``)."""

from __future__ import annotations

import logging
from typing import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler

log = logging.getLogger(__name__)


class _Blocks(Dataset):
    """Rows of an ``(N, seq_len)`` tensor as ``{"input_ids": LongTensor(seq_len)}``."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


class ResumableShuffle(DistributedSampler):
    """The training order: a fresh permutation per epoch from ``seed``, resumable mid-epoch.

    Epoch ``e`` gets the order a ``DataLoader(shuffle=True, generator=seeded)`` gives in its
    ``e``-th pass (so runs made before this sampler train on the same batches), but as a function
    of (seed, epoch) alone, so a process that starts in epoch 3 (a resumed run) sees epoch 3's
    order. Lightning calls
    :meth:`set_epoch` at every epoch start. Under DDP (``num_replicas`` > 1) rank ``r`` takes
    every ``num_replicas``-th index of the permutation from ``r`` (the tail that does not divide
    evenly is dropped); as a ``DistributedSampler`` it is kept as it is by Lightning.

    :meth:`resume_at` makes the next pass over ``epoch`` start after ``batches`` batches, the
    ones the checkpoint already trained on.
    """

    def __init__(self, dataset, seed: int, batch_size: int, num_replicas: int = 1, rank: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, batches: int) -> None:
        self._resume = (int(epoch), int(batches))

    def order(self, epoch: int) -> list[int]:
        """This rank's indices for ``epoch``, before any resume skip."""
        n, generator = len(self.dataset), torch.Generator().manual_seed(self.seed)
        for _ in range(epoch + 1):  # the draws a seeded DataLoader(shuffle=True) makes per epoch:
            torch.empty((), dtype=torch.int64).random_(generator=generator)  # its iterator's base seed,
            perm = torch.randperm(n, generator=generator)  # RandomSampler's permutation,
            torch.randperm(n, generator=generator)  # and its (empty) remainder slice of another
        return perm[: self.total_size][self.rank :: self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        indices = self.order(self.epoch)
        if self._resume is not None and self._resume[0] == self.epoch:
            indices = indices[self._resume[1] * self.batch_size :]
            log.info("data: resuming epoch %d after its first %d batches", self.epoch, self._resume[1])
        self._resume = None
        return iter(indices)


class _MixedBlocks(Dataset):
    """Short and long blocks (two tensors of different widths) for the interleaved training
    loader: the sampler yields whole batches as ``(kind, rows)`` with kind ``"short"`` or
    ``"long"``, and an item is ``{"input_ids": LongTensor(len(rows), width), "long": bool}`` (the
    loss reads ``long``: ``model.distill.long_ce``). With a ``planter``
    (:class:`rfkit.data.recall.RecallPlanter`, ``data.long_recall``) a long item also carries the
    planted answers' ``answer_mask`` (``model.distill.recall``)."""

    def __init__(self, short: torch.Tensor, long: torch.Tensor, planter=None):
        self.blocks = {"short": short, "long": long}
        self.planter = planter

    def __len__(self) -> int:
        return sum(b.shape[0] for b in self.blocks.values())

    def __getitem__(self, item: tuple[str, tuple[int, ...]]) -> dict:
        kind, rows = item
        ids = self.blocks[kind][list(rows)]
        if kind == "long" and self.planter is not None:
            return {**self.planter.batch(ids, rows), "long": True}
        return {"input_ids": ids, "long": kind == "long"}


class InterleavedBatches(ResumableShuffle):
    """The training order with long blocks mixed in: after every ``long_every`` batches of
    short blocks, one batch of ``long_batch_size`` long blocks.

    The short blocks keep :class:`ResumableShuffle`'s order for (seed, epoch), cut into batches
    of ``batch_size`` (an incomplete last batch is dropped); the long blocks follow their own
    permutation per epoch (a generator seeded from ``seed`` and the epoch), sharded over ranks
    the same way and cycled when an epoch needs more of them than there are. An epoch is one pass over the short blocks.
    Each element the sampler yields is a whole batch, ``("short" | "long", rows)``, so the
    loader runs with ``batch_size=None`` and :meth:`resume_at` counts those batches.
    """

    def __init__(
        self,
        dataset: _MixedBlocks,
        seed: int,
        batch_size: int,
        long_batch_size: int = 1,
        long_every: int = 1,
        num_replicas: int = 1,
        rank: int = 0,
    ):
        super().__init__(_Blocks(dataset.blocks["short"]), seed, batch_size, num_replicas=num_replicas, rank=rank)
        self.n_long = int(dataset.blocks["long"].shape[0])
        self.long_batch_size = int(long_batch_size)
        self.long_every = int(long_every)

    def _long_rows(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + 1 + 7919 * epoch)
        rows = torch.randperm(self.n_long, generator=generator).tolist()
        mine = rows[self.rank :: self.num_replicas] if self.n_long >= self.num_replicas else rows
        return mine or rows

    def batches(self, epoch: int) -> list[tuple[str, tuple[int, ...]]]:
        """This rank's batches for ``epoch``, before any resume skip."""
        short = self.order(epoch)
        n_short = len(short) // self.batch_size
        long_rows, used = self._long_rows(epoch), 0
        out: list[tuple[str, tuple[int, ...]]] = []
        for b in range(n_short):
            out.append(("short", tuple(short[b * self.batch_size : (b + 1) * self.batch_size])))
            if (b + 1) % self.long_every == 0:
                rows = [long_rows[(used + i) % len(long_rows)] for i in range(self.long_batch_size)]
                used += self.long_batch_size
                out.append(("long", tuple(rows)))
        return out

    def __len__(self) -> int:
        n_short = self.num_samples // self.batch_size
        return n_short + n_short // self.long_every

    def __iter__(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        batches = self.batches(self.epoch)
        if self._resume is not None and self._resume[0] == self.epoch:
            batches = batches[self._resume[1] :]
            log.info("data: resuming epoch %d after its first %d batches", self.epoch, self._resume[1])
        self._resume = None
        return iter(batches)
