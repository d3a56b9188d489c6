"""``data.long_recall``: records planted in the long training blocks and recalled far later, and
``model.distill.recall``, the loss on their answers. The embedded tokenizer, small local text."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from rfkit.data.recall import RECALL, RECORD, RecallPlanter, _encode
from rfkit.hub import EMBEDDED_MODEL, SourceError, resolve_model
from rfkit.training.distill import DistillConfig, DistillError, answer_loss, training_loss

pytestmark = pytest.mark.usefixtures("data_cache")

PAIR = re.compile(r"\((Record|Recall): the (\w+) number is (\d+)\.\)")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL))


@pytest.fixture(scope="module")
def block(tokenizer):
    text = " ".join(f"line {i} of a long and quiet play." for i in range(400))
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:1024])


def _lines(tokenizer, ids: torch.Tensor, width: int = 20) -> list[tuple[int, str, str, str]]:
    """(token position, kind, label, number) of every record and recall line in ``ids``
    (``width``: tokens read from each position; a line with a 6-digit number is 17 tokens)."""
    found = []
    for start in range(len(ids)):
        text = tokenizer.decode(ids[start : start + width])
        match = PAIR.match(text.lstrip("\n"))
        if match and not (found and start - found[-1][0] < 4):
            found.append((start, *match.groups()))
    return found


def test_each_record_is_recalled_after_the_gap_and_the_answers_are_its_digits(tokenizer, block):
    planter = RecallPlanter(tokenizer, count=5, gap=300, seed=0)
    ids, answers = planter(block, row=3)
    lines = _lines(tokenizer, ids)
    records = {label: (at, number) for at, kind, label, number in lines if kind == "Record"}
    recalls = {label: (at, number) for at, kind, label, number in lines if kind == "Recall"}
    assert len(records) == len(recalls) == 5 and records.keys() == recalls.keys()
    for label, (at, number) in records.items():
        back, repeated = recalls[label]
        assert repeated == number and 3 <= len(number) <= 6
        assert back - at >= 300  # never within an exact window of this size
    # the answer mask holds exactly the recalled numbers' digits, in order
    assert tokenizer.decode(ids[answers]) == "".join(recalls[label][1] for label in sorted(recalls, key=lambda k: recalls[k][0]))
    changed = (ids != block).sum().item()
    assert 0 < changed <= 10 * 20  # the text around the records is untouched
    assert (ids == block)[: min(at for at, _ in records.values())].all()


def test_records_are_fixed_by_seed_and_row(tokenizer, block):
    planter = RecallPlanter(tokenizer, count=3, gap=100, seed=0)
    first, again = planter(block, row=1), planter(block, row=1)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])  # a resumed fit sees the same
    assert not torch.equal(first[0], planter(block, row=2)[0])
    assert not torch.equal(first[0], RecallPlanter(tokenizer, count=3, gap=100, seed=1)(block, row=1)[0])


def test_a_block_too_short_for_the_gap_is_left_as_it_is(tokenizer, block):
    ids, answers = RecallPlanter(tokenizer, count=4, gap=2000, seed=0)(block, row=0)
    assert torch.equal(ids, block) and not answers.any()


def test_templates_are_not_the_passkey_evaluations():
    from rfkit.evals.passkey import FILLER, NEEDLE, QUESTION

    for template in (RECORD, RECALL):
        assert "pass key" not in template.lower()
        assert not set(template.split()) & set((NEEDLE + QUESTION + FILLER).split()) - {"the", "is"}


def test_the_long_batches_carry_the_answers(tokenizer):
    from rfkit.data.sampling import _MixedBlocks

    long = torch.randint(100, 1000, (3, 256))
    data = _MixedBlocks(torch.zeros(6, 8, dtype=torch.long), long, RecallPlanter(tokenizer, 2, 64, seed=0))
    item = data[("long", (2, 0))]
    assert item["long"] and item["input_ids"].shape == item["answer_mask"].shape == (2, 256)
    assert item["answer_mask"].any(dim=1).all()
    assert torch.equal(item["input_ids"][0], RecallPlanter(tokenizer, 2, 64, seed=0)(long[2], 2)[0])
    assert "answer_mask" not in data[("short", (0, 1))]


def test_a_slow_tokenizer_is_refused_in_one_line():
    class Slow:
        is_fast = False

    with pytest.raises(SourceError, match=r"^data\.long_recall: needs a fast tokenizer"):
        RecallPlanter(Slow(), 2, 64)


def test_answer_loss_is_the_cross_entropy_of_the_marked_positions():
    torch.manual_seed(0)
    logits, ids = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    answers = torch.zeros(2, 6, dtype=torch.bool)
    answers[0, 3], answers[1, 5] = True, True  # predicted from positions (0, 2) and (1, 4)
    expected = (F.cross_entropy(logits[0, 2:3], ids[0, 3:4]) + F.cross_entropy(logits[1, 4:5], ids[1, 5:6])) / 2
    assert torch.allclose(answer_loss(logits, ids, answers), expected)
    assert answer_loss(logits, ids, torch.zeros_like(answers)).item() == 0.0


def test_the_recall_weight_adds_the_answers_loss_and_logs_it():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 11)

        def forward(self, input_ids, **_):
            return type("Out", (), {"logits": self.embed(input_ids)})()

    torch.manual_seed(0)
    model, ids = Tiny(), torch.randint(0, 11, (1, 8))
    answers = torch.zeros(1, 8, dtype=torch.bool)
    answers[0, 5:7] = True
    batch = {"input_ids": ids, "answer_mask": answers, "long": True}
    plain, _ = training_loss(model, batch, DistillConfig(kl=0.0))
    weighted, parts = training_loss(model, batch, DistillConfig(kl=0.0, recall=2.0))
    assert torch.allclose(weighted - plain, 2.0 * answer_loss(model(ids).logits, ids, answers))
    assert "recall" in parts and "recall" not in training_loss(model, batch, DistillConfig(kl=0.0))[1]
    with pytest.raises(DistillError, match=r"model\.distill\.recall"):
        DistillConfig(recall=-1.0)


@pytest.mark.slow
def test_a_fit_with_planted_recall_logs_the_answers_loss(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    """Through ``rfkit fit``: the long batches carry records (``data.long_recall``) and the
    answers' loss is logged beside the others; the head map's data section records the setting."""
    from helpers import run_cli, tiny_args

    args = [
        "fit", *tiny_args(tiny_model_dir, tiny_corpus, tmp_path),
        "--data.long_recall", "2", "--data.long_recall_gap", "16", "--data.long_recall_max_gap", "24",
        "--data.long_recall_digits", "[8, 12]", "--model.distill.recall", "1", "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "1", "--trainer.logger", "CSVLogger",
        "--trainer.logger.save_dir", str(tmp_path),
    ]  # fmt: skip
    code, _, err = run_cli(args, capsys)
    assert code == 0, err[-3000:]
    metrics = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()
    column = metrics[0].split(",").index("train_recall")
    logged = [float(row.split(",")[column]) for row in metrics[1:] if row.split(",")[column]]
    assert logged and all(value > 0 for value in logged)  # the tiny model cannot copy the numbers yet
    config = next(tmp_path.rglob("config.yaml")).read_text()
    assert "long_recall: 2" in config and "recall: 1" in config and "long_recall_max_gap: 24" in config
    assert re.search(r"long_recall_digits:\s*- 8\s*- 12", config), config


def test_a_max_gap_keeps_every_recall_within_it(tokenizer, block):
    planter = RecallPlanter(tokenizer, count=6, gap=0, seed=0, max_gap=40)
    ids, answers = planter(block, row=5)
    lines = _lines(tokenizer, ids)
    records = {label: (at, number) for at, kind, label, number in lines if kind == "Record"}
    recalls = {label: (at, number) for at, kind, label, number in lines if kind == "Recall"}
    assert len(records) == len(recalls) == 6 and records.keys() == recalls.keys()
    record_length = len(_encode(tokenizer, RECORD, "amber", "1")[0])
    for label, (at, number) in records.items():
        back, repeated = recalls[label]
        assert repeated == number
        # from the record's end to the recall line: at most 40 tokens (the record is a few
        # tokens longer with a longer label or number)
        assert 0 <= back - at - record_length <= 40 + 4
    far = RecallPlanter(tokenizer, count=6, gap=0, seed=0)(block, row=5)[0]
    far_lines = _lines(tokenizer, far)
    spans = [b[0] - a[0] for a in far_lines for b in far_lines if a[2] == b[2] and a[1] == "Record" and b[1] == "Recall"]
    assert max(spans) > 100  # without it the recall lands anywhere after the record


def test_record_numbers_take_the_digits_asked(tokenizer, block):
    """``digits``: every number has between the fewest and the most digits asked, all of them
    recalled and masked as answers; the default lengths draw the same blocks as before."""
    ids, answers = RecallPlanter(tokenizer, count=4, gap=100, seed=0, digits=(20, 20))(block, row=2)
    lines = _lines(tokenizer, ids, width=40)
    recalls = [number for _, kind, _, number in lines if kind == "Recall"]
    records = sorted(number for _, kind, _, number in lines if kind == "Record")
    assert len(recalls) == 4 and sorted(recalls) == records
    assert all(len(number) == 20 for number in recalls)
    assert tokenizer.decode(ids[answers]) == "".join(recalls)
    mixed = RecallPlanter(tokenizer, count=6, gap=0, seed=0, digits=(8, 12))(block, row=4)[0]
    lengths = {len(number) for _, _, _, number in _lines(tokenizer, mixed, width=32)}
    assert lengths and min(lengths) >= 8 and max(lengths) <= 12 and len(lengths) > 1
    default = RecallPlanter(tokenizer, count=4, gap=100, seed=0)(block, row=2)[0]
    assert torch.equal(default, RecallPlanter(tokenizer, count=4, gap=100, seed=0, digits=(3, 6))(block, row=2)[0])


def test_digits_out_of_order_are_refused_in_one_line(tokenizer):
    with pytest.raises(SourceError, match=r"^data\.long_recall_digits: must be two integers \[fewest, most\] with 1 <= fewest <= most, got \[6, 3\]$"):
        RecallPlanter(tokenizer, 2, 64, digits=(6, 3))


def test_a_max_gap_below_the_gap_is_refused_in_one_line(tokenizer):
    with pytest.raises(SourceError, match=r"^data\.long_recall_max_gap: must be >= the gap \(64\) or null, got 10$"):
        RecallPlanter(tokenizer, 2, 64, max_gap=10)
