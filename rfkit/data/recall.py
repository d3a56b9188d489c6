"""Planted recall in the long training blocks (``data.long_recall``).

A replaced head forgets what left its window; the heads that stay must carry it, and the new
ones must not drown them out. Plain text rarely asks for an exact token from thousands of
tokens back, so the training signal for it is weak. With ``data.long_recall: n``, each long
block of the training mix carries ``n`` short records written into the real text at random
places, and for each one, at least ``long_recall_gap`` tokens later (and at most
``long_recall_max_gap``, when set), a recall line that repeats its label and must repeat its number:

    ... (Record: the cobalt number is 48213.) ...   ...   (Recall: the cobalt number is 48213.) ...

The number's tokens in the recall line are the *answers*: the batch carries their positions
(``answer_mask``), so ``model.distill.recall`` can weigh a cross-entropy on them alone. Nothing
here is the passkey evaluation's template (``rfkit eval passkey`` hides "The pass key is ..." in
repeated filler sentences); the skill, copying a number seen far back, is the same.

With a small ``long_recall_max_gap`` (below the hybrid's window) the record is still inside every
replaced head's exact window when it is recalled: the skill asked is then to quote what the window
holds without the recurrent state drowning it out, which a far recall (only the kept heads and the
states reach it) never asks.

A record's number has 3 to 6 digits unless ``long_recall_digits: [fewest, most]`` says otherwise:
a key of 20 digits (``rfkit eval needles``' long keys) asks the model to copy every digit to the
last, which a five-digit record never does.

Each block's records are fixed by (seed, row): a resumed fit sees the same blocks.
"""

from __future__ import annotations

import random

import torch

from rfkit.hub import SourceError
from rfkit.validate import is_int

LABELS = (
    "amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
    "kestrel", "lantern", "maple", "nickel", "orchid", "pepper", "quartz", "raven", "saffron", "timber",
    "umber", "violet", "walnut", "yarrow", "zephyr", "anchor", "bramble", "cedar", "dune", "elm",
    "fjord", "glacier", "hazel", "iris", "jasper", "kelp", "lichen", "meadow", "nutmeg", "onyx",
    "pine", "quill", "reed", "sable", "thistle", "tundra", "willow", "basalt", "copper", "drift",
)
RECORD = "\n(Record: the {label} number is {value}.)\n"
RECALL = "\n(Recall: the {label} number is {value}.)\n"
TRIES = 64  # placements tried per record before it is left out
DIGITS = (3, 6)  # a record's number has between 3 and 6 digits unless data.long_recall_digits says otherwise


def check_digits(digits, field: str) -> tuple[int, int]:
    """``digits`` as ``(fewest, most)``, or a :class:`SourceError` naming ``field`` unless it is two
    integers with 1 <= fewest <= most (a list from a recipe, a tuple from Python)."""
    ok = isinstance(digits, (list, tuple)) and len(digits) == 2
    ok = ok and all(is_int(d) for d in digits) and 1 <= digits[0] <= digits[1]
    if not ok:
        shown = list(digits) if isinstance(digits, (list, tuple)) else digits
        raise SourceError(f"{field}: must be two integers [fewest, most] with 1 <= fewest <= most, got {shown!r}")
    return int(digits[0]), int(digits[1])


def _encode(tokenizer, template: str, label: str, value: str) -> tuple[list[int], list[bool]]:
    """Token ids of ``template`` filled in, and which of them hold ``value``'s characters."""
    text = template.format(label=label, value=value)
    start = text.index(value, text.index(label) + len(label))
    end = start + len(value)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    answer = [a < end and b > start for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), answer


class RecallPlanter:
    """Writes ``count`` record / recall pairs into long blocks (see the module docstring).

    Args:
        tokenizer: A fast tokenizer (offsets are needed to find the number's tokens).
        count: Records per block.
        gap: Fewest tokens between the end of a record and its recall line.
        max_gap: Most tokens between the end of a record and its recall line (None: up to the
            block's end).
        digits: Fewest and most digits of a record's number (each record draws its length
            uniformly between them, then the number).
        seed: With the row index, fixes each block's records.
        field: The setting that asked for records, named in errors.
    """

    def __init__(
        self,
        tokenizer,
        count: int,
        gap: int,
        seed: int = 0,
        field: str = "data.long_recall",
        max_gap: int | None = None,
        digits: tuple[int, int] = DIGITS,
    ):
        if not getattr(tokenizer, "is_fast", False):
            raise SourceError(f"{field}: needs a fast tokenizer (its offsets find the answers); use 0 with this tokenizer")
        self.tokenizer = tokenizer
        self.count = int(count)
        self.gap = int(gap)
        self.max_gap = None if max_gap is None else int(max_gap)
        if self.max_gap is not None and self.max_gap < self.gap:
            raise SourceError(f"{field}_max_gap: must be >= the gap ({self.gap}) or null, got {self.max_gap}")
        self.digits = check_digits(digits, f"{field}_digits")
        self.seed = int(seed)

    def __call__(self, block: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, answer_mask)`` for one block ``(L,)``: a copy with the records written over
        the text, and a bool mask of the answer tokens (all False where nothing fits)."""
        rng = random.Random(f"recall:{self.seed}:{row}")
        ids = block.clone()
        answers = torch.zeros(ids.shape[0], dtype=torch.bool)
        taken: list[tuple[int, int]] = []
        length = ids.shape[0]
        for label in rng.sample(LABELS, min(self.count, len(LABELS))):
            value = str(rng.randint(10 ** (d := rng.randint(*self.digits)) // 10, 10**d - 1))
            record, _ = _encode(self.tokenizer, RECORD, label, value)
            recall, answer = _encode(self.tokenizer, RECALL, label, value)
            room = length - len(record) - self.gap - len(recall)
            for _ in range(TRIES if room >= 0 else 0):
                at = rng.randint(0, room)
                last = length - len(recall)
                if self.max_gap is not None:
                    last = min(last, at + len(record) + self.max_gap)
                back = rng.randint(at + len(record) + self.gap, last)
                spans = ((at, at + len(record)), (back, back + len(recall)))
                if all(b <= s or e <= a for a, b in spans for s, e in taken):
                    taken.extend(spans)
                    ids[at : at + len(record)] = torch.tensor(record, dtype=ids.dtype)
                    ids[back : back + len(recall)] = torch.tensor(recall, dtype=ids.dtype)
                    answers[back : back + len(recall)] = torch.tensor(answer)
                    break
        return ids, answers

    def batch(self, blocks: torch.Tensor, rows) -> dict[str, torch.Tensor]:
        """The long batch's ``input_ids`` and ``answer_mask`` for ``blocks`` ``(B, L)`` taken
        from rows ``rows`` of the long blocks."""
        pairs = [self(block, int(row)) for block, row in zip(blocks, rows)]
        return {"input_ids": torch.stack([p[0] for p in pairs]), "answer_mask": torch.stack([p[1] for p in pairs])}


def planter_for(data) -> RecallPlanter | None:
    """The planter of a :class:`~rfkit.data.TextDataModule`'s ``long_recall`` (None at 0)."""
    if not data.long_recall:
        return None
    return data.recall_planter(
        data.long_recall, data.long_recall_gap, "data.long_recall", data.long_recall_max_gap, tuple(data.long_recall_digits)
    )
