"""What the data loaders iterate: packed blocks as a dataset, and the resumable training order."""

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
