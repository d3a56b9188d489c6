"""Distillation from the original model during continual training (the ``distill:`` section).

The loss is a weighted sum of three terms, each optional:

- ``ce``: next-token cross-entropy on the data (the paper's continual-training loss);
- ``kl``: KL(teacher || student) on the next-token distributions at temperature ``T``,
  multiplied by ``T**2`` (so its gradient scale does not depend on ``T``);
- ``hidden``: mean over layers of the MSE between student and teacher hidden states, each
  relative to the teacher's mean square at that layer.

The teacher is the original model, run through :class:`rfkit.training.teacher.SharedTeacher`: it
shares every module the student did not replace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rfkit.errors import RFKitError
from rfkit.validate import in_range


class DistillError(RFKitError):
    """A bad distillation setting; one line for the user."""


@dataclass
class DistillConfig:
    """The ``distill:`` section of a recipe.

    Args:
        ce: Weight of the next-token cross-entropy.
        kl: Weight of the logit KL to the teacher.
        temperature: Softmax temperature of the KL term.
        hidden: Weight of the per-layer hidden-state MSE to the teacher.
        share_modules: Run the teacher inside the student, sharing its unchanged modules
            (``false``: a frozen full copy, needed only when shared weights are trained).
        long_ce: Weight of the cross-entropy on the long blocks that ``data.long_source`` mixes
            into training (``null``: ``ce``). ``0`` distils them alone: the student learns the
            original's long-context behaviour, not the long source's text.
        recall: Weight of a cross-entropy on the planted answers alone (``data.long_recall``:
            the numbers a recall line must copy from far back), added to the loss of the long
            batches that carry them. 0: the answers count as any other token.
    """

    ce: float = 1.0
    kl: float = 1.0
    temperature: float = 1.0
    hidden: float = 0.0
    share_modules: bool = True
    long_ce: float | None = None
    recall: float = 0.0

    def __post_init__(self):
        for name in ("ce", "kl", "hidden", "recall") + (("long_ce",) if self.long_ce is not None else ()):
            in_range(f"model.distill.{name}", getattr(self, name), 0, finite=True, error=DistillError)
        if self.ce == 0 and self.kl == 0 and self.hidden == 0:
            raise DistillError("model.distill: ce, kl and hidden are all 0; at least one weight must be > 0")
        if self.long_ce == 0 and self.kl == 0 and self.hidden == 0:
            raise DistillError("model.distill: long_ce, kl and hidden are all 0; the long blocks would have no loss")
        in_range("model.distill.temperature", self.temperature, 0, low_open=True, finite=True, error=DistillError)

    def ce_weight(self, batch: dict) -> float:
        """The cross-entropy weight of ``batch``: ``long_ce`` for a batch of long blocks (marked
        ``long`` by the interleaved loader) when it is set, else ``ce``."""
        return self.long_ce if batch.get("long") and self.long_ce is not None else self.ce

    @property
    def needs_teacher(self) -> bool:
        return self.kl > 0 or self.hidden > 0


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) at ``temperature``, times ``temperature**2``.

    Logits are (B, L, V); ``mask`` (B, L) selects the positions that count (default all).
    """
    t = float(temperature)
    log_s = F.log_softmax(student_logits.float() / t, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / t, dim=-1)
    per_position = (log_t.exp() * (log_t - log_s)).sum(-1)  # (B, L)
    if mask is not None:
        mask = mask.to(per_position.dtype)
        return (per_position * mask).sum() / mask.sum().clamp_min(1) * t * t
    return per_position.mean() * t * t


def hidden_loss(student_hidden, teacher_hidden) -> torch.Tensor:
    """Mean over layers of MSE(student, teacher) / mean(teacher**2) (the embeddings excluded)."""
    terms = [
        F.mse_loss(s.float(), t.float()) / t.float().pow(2).mean().clamp_min(1e-12)
        for s, t in zip(student_hidden[1:], teacher_hidden[1:])
    ]
    return torch.stack(terms).mean()


def training_loss(model, batch: dict, config: DistillConfig | None = None, teacher=None) -> tuple[torch.Tensor, dict]:
    """The training loss of one batch and its logged parts (``ce``, ``kl``, ``hidden``).

    Without ``config`` this is plain next-token cross-entropy (the paper's). ``teacher`` (a
    :class:`rfkit.training.teacher.SharedTeacher`) is needed when ``config`` has a KL or hidden term.
    """
    from rfkit.training.losses import summed_nll

    ids = batch["input_ids"]
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
    need_hidden = config is not None and config.hidden > 0
    out = model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=need_hidden, **positions)
    nll, n = summed_nll(out.logits, ids, labels)
    ce = nll / n
    if config is None:
        return ce, {"ce": ce.detach()}
    parts = {"ce": ce.detach()}
    loss = config.ce_weight(batch) * ce
    if config.needs_teacher:
        if teacher is None:
            raise DistillError("model.distill: the kl and hidden terms need a teacher")
        reference = teacher(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=need_hidden, **positions)
        if config.kl > 0:
            keep = labels[:, 1:] != -100 if labels is not None else (mask[:, 1:] if mask is not None else None)
            kl = kl_loss(out.logits[:, :-1], reference.logits[:, :-1], config.temperature, keep)
            loss = loss + config.kl * kl
            parts["kl"] = kl.detach()
        if need_hidden:
            hidden = hidden_loss(out.hidden_states, reference.hidden_states)
            loss = loss + config.hidden * hidden
            parts["hidden"] = hidden.detach()
    answers = batch.get("answer_mask")
    if config.recall > 0 and answers is not None:
        recall = answer_loss(out.logits, ids, answers)
        loss = loss + config.recall * recall
        parts["recall"] = recall.detach()
    return loss, parts


def answer_loss(logits: torch.Tensor, input_ids: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions ``answers`` (B, L) marks (0 when none)."""
    targets = answers[:, 1:]
    picked = logits[:, :-1][targets].float()
    if picked.shape[0] == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(picked, input_ids[:, 1:][targets])
