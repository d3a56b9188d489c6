"""Fine-tuning on generated HashHop samples (the paper's appendix B): :class:`HashHopDataModule`
trains on them (loss on the completion only) while calibration and validation stay on the
parent's text blocks; see ``recipes/smollm2_hashhop_b05.yaml``. The samples come from
:mod:`rfkit.evals.hashhop_samples`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from rfkit.data import TextDataModule
from rfkit.evals.hashhop_samples import generate_samples, hash_len_problem
from rfkit.hub import EMBEDDED_DATA, SourceError
from rfkit.validate import integer, positive_int

log = logging.getLogger(__name__)

IGNORE = -100


class _Tokenized(Dataset):
    """Pre-tokenised samples: ``(ids, prompt_len)`` pairs."""

    def __init__(self, rows: list[tuple[list[int], int]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.rows[i]


class _Collate:
    """Right-pads ``(ids, prompt_len)`` rows to the longest in the batch."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for r, (ids, prompt_len) in enumerate(rows):
            n = len(ids)
            input_ids[r, :n] = torch.tensor(ids)
            attention_mask[r, :n] = 1
            labels[r, prompt_len:n] = torch.tensor(ids[prompt_len:])
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class HashHopDataModule(TextDataModule):
    """Fine-tuning on generated HashHop samples (the paper's appendix B); calibration and
    validation stay on the parent's packed text blocks.

    * ``calibration_dataloader()``, ``val_dataloader()``, ``fingerprint()`` and the
      ``calibration``/``validation`` tensors are the parent's (Wikipedia by default): heads are
      profiled on general text, and the fit's perplexity and cache numbers stay comparable
      with the plain recipe (the head profile cache is shared with it, too).
    * ``train_dataloader()`` yields HashHop batches: ``input_ids`` = tokens(prompt) +
      tokens(completion) + EOS, ``labels`` = -100 on the prompt and the padding and the token
      ids elsewhere (the model learns to write the chain and stop), ``attention_mask``; right-
      padded to the longest sample in the batch. Shuffled with a generator seeded by ``seed``.
    * ``hashhop_val_dataloader()`` yields held-out HashHop batches in the same format, for a
      completion loss outside the fit (``val_dataloader()`` stays on text).

    Args (on top of :class:`~rfkit.data.TextDataModule`'s):
        hops: Links in each queried chain.
        hash_len: Letters per hash.
        chars: Target prompt length in characters.
        train_samples: Number of training samples (split ``train`` of the generator).
        val_samples: Number of held-out samples for ``hashhop_val_dataloader`` (split
            ``validation``).
        seed: Seed of the samples and of the training shuffle (the text split does not use it).
    """

    def __init__(
        self,
        source: str = EMBEDDED_DATA,
        tokenizer: str | None = None,
        seq_len: int = 512,
        batch_size: int = 4,
        calibration_samples: int = 64,
        val_blocks: int = 64,
        train_blocks: int | None = None,
        split: tuple[float, float] | None = None,
        text_field: str = "text",
        hf_split: str = "train",
        hf_max_documents: int | None = 50000,
        num_workers: int = 0,
        seed: int = 0,
        hops: int = 16,
        hash_len: int = 8,
        chars: int = 6144,
        train_samples: int = 512,
        val_samples: int = 32,
    ):
        # set before the parent's __init__, which calls check()
        self.hops = hops
        self.hash_len = hash_len
        self.chars = chars
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.hashhop_train: list[tuple[list[int], int]] | None = None
        self.hashhop_validation: list[tuple[list[int], int]] | None = None
        super().__init__(
            source=source,
            tokenizer=tokenizer,
            seq_len=seq_len,
            batch_size=batch_size,
            calibration_samples=calibration_samples,
            val_blocks=val_blocks,
            train_blocks=train_blocks,
            split=split,
            text_field=text_field,
            hf_split=hf_split,
            hf_max_documents=hf_max_documents,
            num_workers=num_workers,
            seed=seed,
        )

    def check(self) -> None:
        """The parent's checks plus ``data.hops``, ``data.hash_len``, ``data.chars``,
        ``data.train_samples`` and ``data.val_samples``.

        Raises:
            SourceError: one line naming the field and what is allowed.
        """
        super().check()
        for field in ("hops", "chars", "train_samples", "val_samples"):
            positive_int(f"data.{field}", getattr(self, field), error=SourceError)
        # only the type here: hash_len_problem says why a short hash is too short
        integer("data.hash_len", self.hash_len, error=SourceError, message="{field}: must be an integer >= 2, got {value!r}")
        problem = hash_len_problem(self.hash_len, self.hops, self.chars)
        if problem:
            raise SourceError(f"data.hash_len: {problem.replace('--chars', 'data.chars').replace('--hops', 'data.hops')}")

    def hashhop_settings(self) -> dict[str, Any]:
        return {
            "hops": self.hops,
            "hash_len": self.hash_len,
            "chars": self.chars,
            "train_samples": self.train_samples,
            "val_samples": self.val_samples,
            "seed": self.seed,
        }

    def _encode(self, samples: list[dict]) -> list[tuple[list[int], int]]:
        from tqdm.auto import tqdm

        tok = self.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        rows = []
        for s in tqdm(samples, desc="tokenising hashhop", unit="sample", leave=False):
            prompt = tok(s["prompt"])["input_ids"]  # as greedy_generate tokenises it
            completion = tok(s["completion"], add_special_tokens=False)["input_ids"]
            rows.append((prompt + completion + ([eos] if eos is not None else []), len(prompt)))
        return rows

    def setup(self, stage: str | None = None) -> None:
        """The parent's text blocks, then the HashHop train and validation samples (generated
        and tokenised once). Idempotent."""
        super().setup(stage)
        if self.hashhop_train is not None:
            return
        kw = {"hops": self.hops, "hash_len": self.hash_len, "chars": self.chars}
        self.hashhop_train = self._encode(generate_samples(self.train_samples, self.seed, "train", **kw))
        self.hashhop_validation = self._encode(generate_samples(self.val_samples, self.seed, "validation", **kw))
        if self.train_samples < self.batch_size:
            log.warning(
                "data: only %d HashHop training samples for batch_size %d; with drop_last the training loader is empty",
                self.train_samples, self.batch_size,
            )

    def _pad_id(self) -> int:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return 0 if pad is None else int(pad)

    def _hashhop_loader(self, rows, shuffle: bool) -> DataLoader:
        dataset = _Tokenized(rows)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self.train_sampler(dataset) if shuffle else None,
            drop_last=shuffle,
            collate_fn=_Collate(self._pad_id()),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """HashHop training batches (``input_ids``, ``attention_mask``, ``labels``), shuffled
        with a generator seeded by ``seed``; the incomplete last batch is dropped."""
        self.setup()
        return self._hashhop_loader(self.hashhop_train, shuffle=True)

    def hashhop_val_dataloader(self) -> DataLoader:
        """Held-out HashHop batches in fixed order (same format as training)."""
        self.setup()
        return self._hashhop_loader(self.hashhop_validation, shuffle=False)

    def describe(self) -> dict[str, Any]:
        """The parent's provenance plus the HashHop settings and token counts."""
        info = super().describe()
        train_tokens = [len(ids) for ids, _ in self.hashhop_train]
        info["hashhop"] = {
            **self.hashhop_settings(),
            "train_tokens": sum(train_tokens),
            "train_completion_tokens": sum(len(ids) - p for ids, p in self.hashhop_train),
            "max_sample_tokens": max(train_tokens + [len(ids) for ids, _ in self.hashhop_validation]),
        }
        return info
