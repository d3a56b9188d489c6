"""Long-document sources (``data.long_source``, ``model.transfer.long_source``): their one-line
errors, and the training loader that interleaves their blocks with the short batches. The blocks
themselves are read by :func:`rfkit.data.datamodule.train_split_blocks`."""

from __future__ import annotations

from torch.utils.data import DataLoader

from rfkit.data.sampling import InterleavedBatches, _MixedBlocks
from rfkit.data.recall import planter_for


def long_source_message(message: str, field: str) -> str:
    """A data error about a long-document source, naming ``field`` (the data code names
    ``data.source`` or ``data.text_field``)."""
    for prefix in ("data.source: ", "data.text_field: "):
        if message.startswith(prefix):
            return f"{field}: " + message.removeprefix(prefix)
    return message


def interleaved_loader(data) -> DataLoader:
    """The training loader of a :class:`~rfkit.data.TextDataModule` with ``long_source``: its
    shuffled training batches with a batch of long blocks after every ``long_every`` of them
    (:class:`~rfkit.data.sampling.InterleavedBatches`), sharded over the trainer's ranks and
    resumed where a checkpoint left off."""
    dataset = _MixedBlocks(data.train, data.long_blocks(), planter_for(data))
    replicas, rank = data._ranks()
    sizes = (data.batch_size, data.long_batch_size, data.long_every)
    order = InterleavedBatches(dataset, data.seed, *sizes, num_replicas=replicas, rank=rank)
    return DataLoader(
        dataset,
        batch_size=None,  # every item the sampler yields is a whole batch
        sampler=data._resumed(order),
        num_workers=data.num_workers,
        persistent_workers=data.num_workers > 0,
    )

