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
    """Right-pads ``(ids, prompt_len)`` rows to the longest in the batch. With ``grouped`` each
    item is already a whole batch (a list of rows from one setting) and the loader's batch size is 1."""

    def __init__(self, pad_id: int, grouped: bool = False):
        self.pad_id = pad_id
        self.grouped = grouped

    def __call__(self, rows) -> dict[str, torch.Tensor]:
        if self.grouped:
            rows = [row for group in rows for row in group]
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

    * Several settings at once: ``hops`` and ``chars`` may be lists (of one length, or one of
      them a single number that every setting shares), e.g. ``hops: [2, 4]``, ``chars: [2048,
      1024]``. The samples are split evenly between the settings (setting ``j`` draws from seed
      ``seed + j``) and every training batch holds samples of one setting only, so a short
      sample is never padded to a long one; the batches' order is shuffled.

    Args (on top of :class:`~rfkit.data.TextDataModule`'s):
        hops: Links in each queried chain (a list: one per setting).
        hash_len: Letters per hash.
        chars: Target prompt length in characters (a list: one per setting).
        train_samples: Number of training samples (split ``train`` of the generator), over all
            settings.
        val_samples: Number of held-out samples for ``hashhop_val_dataloader`` (split
            ``validation``), over all settings.
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
        hops: int | list[int] = 16,
        hash_len: int = 8,
        chars: int | list[int] = 6144,
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
        self._train_groups: list[list[tuple[list[int], int]]] | None = None  # several settings: whole batches
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
        for field in ("hops", "chars"):
            value = getattr(self, field)
            if isinstance(value, (list, tuple)):
                if not value:
                    raise SourceError(f"data.{field}: an empty list; give one number, or one per setting")
                for i, v in enumerate(value):
                    positive_int(f"data.{field}[{i}]", v, error=SourceError)
            else:
                positive_int(f"data.{field}", value, error=SourceError)
        for field in ("train_samples", "val_samples"):
            positive_int(f"data.{field}", getattr(self, field), error=SourceError)
        lengths = {len(v) for v in (self.hops, self.chars) if isinstance(v, (list, tuple))}
        if len(lengths) > 1:
            raise SourceError(
                f"data.chars: {len(self.chars)} settings but data.hops has {len(self.hops)}; give lists of one length "
                "(or one number for either)"
            )
        n = len(self.settings())
        for field in ("train_samples", "val_samples"):
            if getattr(self, field) < n:
                raise SourceError(f"data.{field}: must be >= the number of settings ({n}), got {getattr(self, field)}")
        # only the type here: hash_len_problem says why a short hash is too short
        integer("data.hash_len", self.hash_len, error=SourceError, message="{field}: must be an integer >= 2, got {value!r}")
        for hops, chars in self.settings():
            problem = hash_len_problem(self.hash_len, hops, chars)
            if problem:
                raise SourceError(f"data.hash_len: {problem.replace('--chars', 'data.chars').replace('--hops', 'data.hops')}")

    def settings(self) -> list[tuple[int, int]]:
        """``[(hops, chars), ...]``: one pair per setting (a single number is shared by all)."""
        hops = list(self.hops) if isinstance(self.hops, (list, tuple)) else None
        chars = list(self.chars) if isinstance(self.chars, (list, tuple)) else None
        n = len(hops or chars or [0])
        return list(zip(hops or [self.hops] * n, chars or [self.chars] * n))

    def _generate(self, n: int, split: str) -> list[list[dict]]:
        """``n`` samples of ``split`` split evenly over the settings (the first ones take the
        remainder): one list per setting."""
        settings = self.settings()
        counts = [n // len(settings) + (j < n % len(settings)) for j in range(len(settings))]
        return [
            generate_samples(count, self.seed + j, split, hops=hops, hash_len=self.hash_len, chars=chars)
            for j, (count, (hops, chars)) in enumerate(zip(counts, settings))
        ]

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
        train = [self._encode(samples) for samples in self._generate(self.train_samples, "train")]
        self.hashhop_train = [row for rows in train for row in rows]
        self.hashhop_validation = [row for samples in self._generate(self.val_samples, "validation") for row in self._encode(samples)]
        self._train_groups = self._group(train) if len(train) > 1 else None
        if self.train_samples < self.batch_size:
            log.warning(
                "data: only %d HashHop training samples for batch_size %d; with drop_last the training loader is empty",
                self.train_samples, self.batch_size,
            )

    def _group(self, per_setting: list[list[tuple[list[int], int]]]) -> list[list[tuple[list[int], int]]]:
        """Whole batches of one setting each: every setting's rows in a seeded order, cut into
        ``batch_size`` pieces (an incomplete last piece is dropped, as ``drop_last`` would)."""
        generator = torch.Generator().manual_seed(self.seed)
        groups = []
        for rows in per_setting:
            order = torch.randperm(len(rows), generator=generator).tolist()
            groups += [[rows[i] for i in order[k : k + self.batch_size]] for k in range(0, len(rows) - self.batch_size + 1, self.batch_size)]
        return groups

    def _pad_id(self) -> int:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return 0 if pad is None else int(pad)

    def _hashhop_loader(self, rows, shuffle: bool, grouped: bool = False) -> DataLoader:
        """``rows`` in batches of ``batch_size``; ``grouped``: each row is already a whole batch."""
        dataset = _Tokenized(rows)
        per_batch = 1 if grouped else self.batch_size
        return DataLoader(
            dataset,
            batch_size=per_batch,
            sampler=self.train_sampler(dataset, batch_size=per_batch) if shuffle else None,
            drop_last=shuffle,
            collate_fn=_Collate(self._pad_id(), grouped=grouped),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """HashHop training batches (``input_ids``, ``attention_mask``, ``labels``), shuffled
        with a generator seeded by ``seed``; the incomplete last batch is dropped. With several
        settings each batch holds one setting, and the batches are shuffled."""
        self.setup()
        if self._train_groups is None:
            return self._hashhop_loader(self.hashhop_train, shuffle=True)
        return self._hashhop_loader(self._train_groups, shuffle=True, grouped=True)

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
