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
        long_kl: Weight of the KL to the teacher on those long blocks (``null``: ``kl``). ``0``
            trains them on the cross-entropy alone and skips the teacher's forward on them (with
            ``hidden: 0``): on a CPU at 4,096 tokens that forward is about half of a long step.
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
    long_kl: float | None = None
    recall: float = 0.0

    def __post_init__(self):
        optional = tuple(name for name in ("long_ce", "long_kl") if getattr(self, name) is not None)
        for name in ("ce", "kl", "hidden", "recall") + optional:
            in_range(f"model.distill.{name}", getattr(self, name), 0, finite=True, error=DistillError)
        if self.ce == 0 and self.kl == 0 and self.hidden == 0:
            raise DistillError("model.distill: ce, kl and hidden are all 0; at least one weight must be > 0")
        long = {"long": True}
        if self.ce_weight(long) == 0 and self.kl_weight(long) == 0 and self.hidden == 0:
            names = ", ".join(f"long_{n}" if getattr(self, f"long_{n}") is not None else n for n in ("ce", "kl"))
            raise DistillError(f"model.distill: {names} and hidden are all 0; the long blocks would have no loss")
        in_range("model.distill.temperature", self.temperature, 0, low_open=True, finite=True, error=DistillError)

    def _weight(self, name: str, batch: dict) -> float:
        """``long_<name>`` for a batch of long blocks (marked ``long`` by the interleaved loader)
        when it is set, else ``<name>``."""
        long = getattr(self, f"long_{name}")
        return long if batch.get("long") and long is not None else getattr(self, name)

    def ce_weight(self, batch: dict) -> float:
        """The cross-entropy weight of ``batch`` (``long_ce`` or ``ce``)."""
        return self._weight("ce", batch)

    def kl_weight(self, batch: dict) -> float:
        """The KL weight of ``batch`` (``long_kl`` or ``kl``)."""
        return self._weight("kl", batch)

    @property
    def needs_teacher(self) -> bool:
        """Whether any batch reads the teacher (short or long)."""
        return self.kl > 0 or (self.long_kl or 0) > 0 or self.hidden > 0


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) at ``temperature``, times ``temperature**2``.

    Logits are (B, L, V); ``mask`` (B, L) selects the positions that count (default all).
    """
    return rowwise_loss(student_logits, teacher=teacher_logits, temperature=temperature, kl_mask=mask, ce_weight=0.0)[0]


#: positions per piece of :func:`rowwise_loss` on a CPU: 4 rows of 49,152 float32 logits are
#: 768 KiB, within a core's cache; an accelerator takes bigger pieces (fewer kernel launches)
LOSS_ROWS = 4
LOSS_ROWS_ACCELERATOR = 1024


def rowwise_loss(
    student: torch.Tensor,
    *,
    targets: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
    temperature: float = 1.0,
    kl_mask: torch.Tensor | None = None,
    ce_weight: float = 1.0,
    kl_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ce_weight * CE + kl_weight * KL`` on the student's logits (B, L, V), a few positions at a
    time, and the two terms apart (detached, for logging).

    CE: mean next-token cross-entropy over the ``targets`` (B, L) that are not -100 (as
    :func:`rfkit.training.losses.summed_nll`). KL: :func:`kl_loss` (``kl_mask`` the positions that
    count). Either may be absent (its value 0). All in float32, with the gradient for the student's
    logits made in the same pass (:class:`_RowwiseLoss`): a row of a 49,152-word vocabulary is
    192 KiB in float32, and the whole tensor, hundreds of MiB, would be read and written a dozen
    times over by the plain expressions.
    """
    B, L, _ = student.shape
    ce_rows = kl_rows = None
    if targets is not None:
        valid = (targets != -100).to(torch.float32)
        ce_rows = valid / valid.sum().clamp_min(1)
    if teacher is not None:
        t = float(temperature)
        keep = torch.ones(B, L, device=student.device) if kl_mask is None else kl_mask.to(torch.float32)
        kl_rows = keep / keep.sum().clamp_min(1) * (t * t)
        teacher = teacher.detach()
    return _RowwiseLoss.apply(student, teacher, targets, ce_rows, kl_rows, float(ce_weight), float(kl_weight), float(temperature))


class _RowwiseLoss(torch.autograd.Function):
    """:func:`rowwise_loss`: the values and the gradient (kept in the logits' dtype until
    backward) in one pass, through the compiled CPU loss where it serves (:func:`_kernel_takes`;
    three passes over each row), else in PyTorch ops a few positions at a time. Row weights ``a`` (CE) and ``b``
    (KL, with ``T**2``): d/ds of ``sum a CE`` is ``a (softmax(s) - onehot)``, of ``sum b KL`` is
    ``b (softmax(s / T) - p_teacher) / T``."""

    @staticmethod
    def forward(ctx, student, teacher, targets, ce_rows, kl_rows, ce_weight, kl_weight, t):
        grad = torch.empty_like(student) if student.requires_grad else None
        args = (student, teacher, targets, ce_rows, kl_rows, ce_weight, kl_weight, t, grad)
        parts = _rowwise_kernel(*args) if _kernel_takes(student, teacher, grad) else _rowwise_torch(*args)
        ctx.save_for_backward(grad)
        total = ce_weight * parts[0] + kl_weight * parts[1]
        ce, kl = parts[0].clone(), parts[1].clone()
        ctx.mark_non_differentiable(ce, kl)
        return total, ce, kl

    @staticmethod
    def backward(ctx, out_grad, _ce_grad, _kl_grad):
        (grad,) = ctx.saved_tensors
        return grad * out_grad.to(grad.dtype), None, None, None, None, None, None, None


def _kernel_takes(student, teacher, grad) -> bool:
    """Whether the compiled CPU loss (:func:`rfkit.ops.cpu_kernels.rowwise_loss_cpu`) serves:
    CPU float32 or bf16 logits, each position's row contiguous (a batch's rows stride apart)."""
    if student.device.type != "cpu":
        return False
    from rfkit.ops import cpu_kernels

    return cpu_kernels.rowwise_loss_ready(student[0], None if teacher is None else teacher[0], None if grad is None else grad[0])


def _rowwise_kernel(student, teacher, targets, ce_rows, kl_rows, ce_weight, kl_weight, t, grad) -> torch.Tensor:
    """:class:`_RowwiseLoss`'s values (CE, KL) through the compiled CPU loss, one batch row at a
    time, the gradient written into ``grad``."""
    from rfkit.ops.cpu_kernels import rowwise_loss_cpu

    parts = torch.zeros(2, dtype=torch.float32)
    for b in range(student.shape[0]):
        ga = None if ce_rows is None else ce_weight * ce_rows[b]
        gb = None if kl_rows is None else kl_rows[b] * (kl_weight / t)
        ce, kl = rowwise_loss_cpu(
            student[b], None if teacher is None else teacher[b], None if targets is None else targets[b],
            ga, gb, None if grad is None else grad[b], 1.0 / t,
        )  # fmt: skip
        if ce is not None:
            parts[0] += (ce * ce_rows[b]).sum()
        if kl is not None:
            parts[1] += (kl * kl_rows[b]).sum()
    return parts


def _rowwise_torch(student, teacher, targets, ce_rows, kl_rows, ce_weight, kl_weight, t, grad) -> torch.Tensor:
    """:class:`_RowwiseLoss`'s values (CE, KL) in PyTorch ops, :data:`LOSS_ROWS` positions at a
    time (any device and dtype; the compiled loss's twin), the gradient written into ``grad``."""
    B, L, _ = student.shape
    parts = torch.zeros(2, dtype=torch.float32, device=student.device)
    step = LOSS_ROWS if student.device.type == "cpu" else LOSS_ROWS_ACCELERATOR
    for b in range(B):
        for start in range(0, L, step):
            rows = slice(start, min(L, start + step))
            s = student[b, rows].float()
            log_s = F.log_softmax(s, dim=-1)
            g = torch.zeros_like(s) if grad is not None else None
            if ce_rows is not None:
                a, target = ce_rows[b, rows], targets[b, rows].clamp_min(0).unsqueeze(-1)
                parts[0] += (-log_s.gather(-1, target).squeeze(-1) * a).sum()
                if g is not None:
                    g.add_(log_s.exp().scatter_add_(-1, target, -torch.ones_like(target, dtype=g.dtype)) * (ce_weight * a).unsqueeze(-1))
            if kl_rows is not None:
                log_st = log_s if t == 1.0 else F.log_softmax(s / t, dim=-1)
                log_t = F.log_softmax(teacher[b, rows].float() / t, dim=-1)
                p_t = log_t.exp()
                w = kl_rows[b, rows]
                parts[1] += ((p_t * (log_t - log_st)).sum(-1) * w).sum()
                if g is not None:
                    g.add_((log_st.exp() - p_t) * (kl_weight * w / t).unsqueeze(-1))
            if grad is not None:
                grad[b, rows] = g
    return parts


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
    ids = batch["input_ids"]
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
    need_hidden = config is not None and config.hidden > 0
    out = model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=need_hidden, **positions)
    targets = (ids if labels is None else labels)[:, 1:]
    if config is None:  # the paper's loss: CE alone, through the same rowwise pass
        loss, ce, _ = rowwise_loss(out.logits[:, :-1], targets=targets)
        return loss, {"ce": ce}
    reference = None
    kl_weight = config.kl_weight(batch)
    if kl_weight > 0 or need_hidden:  # a batch without either never runs the teacher
        if teacher is None:
            raise DistillError("model.distill: the kl and hidden terms need a teacher")
        reference = teacher(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=need_hidden, **positions)
    # CE and KL in one pass over the logits (rowwise_loss), the KL over the positions that count
    keep = labels[:, 1:] != -100 if labels is not None else (mask[:, 1:] if mask is not None else None)
    loss, ce, kl = rowwise_loss(
        out.logits[:, :-1],
        targets=targets,
        teacher=reference.logits[:, :-1] if kl_weight > 0 else None,
        temperature=config.temperature,
        kl_mask=keep,
        ce_weight=config.ce_weight(batch),
        kl_weight=kl_weight,
    )
    parts = {"ce": ce}
    if kl_weight > 0:
        parts["kl"] = kl
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
