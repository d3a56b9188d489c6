"""What a run shows while it runs: one line per phase with its time, and a training bar that
counts optimizer steps.

* :class:`Phases` times the phases of a run (load, profile, measure, transfer, train, save) and
  logs one line as each ends; the seconds go into ``summary.json`` under ``phases``.
* :class:`StepProgressBar` is Lightning's tqdm bar, except that a step-bounded run
  (``trainer.max_steps`` set) reads ``train (steps): 12/20`` instead of ``Epoch 0/-2``, and its
  bar starts as that: no ``Training: 0/?`` or ``Epoch 0`` line before it (``--verbose`` keeps
  Lightning's start); runs bounded by epochs keep Lightning's epoch bar. During a fit, Lightning's
  ``Validation DataLoader 0`` and ``Sanity Checking`` bars stay hidden (``--verbose`` shows them):
  the validation loss shows on the step bar's postfix (``val_loss=...``) once it is logged.
  ``rfkit validate`` keeps its validation bar, the only one it has.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager

from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

log = logging.getLogger("rfkit")


def format_seconds(seconds: float) -> str:
    """``4.2 s``, ``3 min 05 s``, ``1 h 02 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Phases:
    """Wall time per phase; a phase entered twice (``measure`` before and after training) adds up."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._open: dict[str, list[float]] = {}  # name -> [start, seconds of phases run inside it]

    def start(self, name: str) -> None:
        self._open[name] = [time.perf_counter(), 0.0]

    def end(self, name: str, detail: str = "") -> float:
        """Close phase ``name`` (opened by :meth:`start`) and log its line; returns its seconds.
        A phase that ran inside another (the final ``measure`` inside ``train``: Lightning calls
        the callbacks' ``on_train_end`` first) is not counted twice: the outer one excludes it."""
        opened = self._open.pop(name, None)
        if opened is None:
            return 0.0
        took = time.perf_counter() - opened[0] - opened[1]
        for other in self._open.values():
            other[1] += took
        self.seconds[name] = round(self.seconds.get(name, 0.0) + took, 2)
        if rank_zero_only.rank == 0:
            log.info("%-9s %9s%s", name, format_seconds(took), f"  {detail}" if detail else "")
        return took

    @contextmanager
    def __call__(self, name: str, detail: str = ""):
        """``with phases("load", "embedded:smollm2-135m-instruct"): ...``"""
        self.start(name)
        try:
            yield
        finally:
            self.end(name, detail)


def phase(pl_module, name: str, detail: str = ""):
    """The phase context of ``pl_module`` (a :class:`~rfkit.training.module.RecurFormerModule`),
    or a plain one for any other LightningModule a callback may meet."""
    phases = getattr(pl_module, "phases", None)
    return phases(name, detail) if isinstance(phases, Phases) else Phases()(name, detail)


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting optimizer steps out of ``trainer.max_steps`` when the run is
    step-bounded (as every rfkit recipe is); an epoch-bounded run gets Lightning's own bar."""

    DESCRIPTION = "train (steps)"

    @staticmethod
    def _steps(trainer) -> int | None:
        return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None

    def _quiet(self, trainer) -> bool:
        """Start the step bar as itself, skipping Lightning's ``Training: 0/?`` and ``Epoch 0``
        lines (step-bounded runs without ``--verbose``)."""
        from rfkit.output import verbose

        return self._steps(trainer) is not None and not verbose()

    def _hidden_during_fit(self) -> Tqdm:
        """A bar that draws nothing, in place of Lightning's validation / sanity-check bar during a
        fit (not ``--verbose``); Lightning still sets its total and closes it as usual."""
        return Tqdm(disable=True, file=sys.stdout)

    def _show_validation(self) -> bool:
        from rfkit.output import verbose

        return verbose() or self.trainer.state.fn != "fit"

    def init_sanity_tqdm(self):
        return super().init_sanity_tqdm() if self._show_validation() else self._hidden_during_fit()

    def init_validation_tqdm(self):
        # after validation, Lightning puts the logged metrics (val_loss) on the step bar's postfix
        return super().init_validation_tqdm() if self._show_validation() else self._hidden_during_fit()

    def init_train_tqdm(self):
        trainer = self.trainer
        if not self._quiet(trainer):
            return super().init_train_tqdm()
        # Lightning's training bar, created already reading "train (steps): n/total"
        return Tqdm(
            desc=self.DESCRIPTION, total=self._steps(trainer), initial=trainer.global_step,
            position=2 * self.process_position, disable=self.is_disabled, leave=True,
            dynamic_ncols=True, file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT,
        )  # fmt: skip

    def on_train_epoch_start(self, trainer, *args) -> None:
        total = self._steps(trainer)
        if not self._quiet(trainer):
            super().on_train_epoch_start(trainer, *args)
            if total is None:
                return
        bar = self.train_progress_bar
        showing = getattr(bar, "desc", "").startswith(self.DESCRIPTION)
        if showing and bar.total == total and bar.n == trainer.global_step:
            return  # already showing where the run stands (a quiet bar, or a later epoch)
        bar.reset(total=total)
        bar.n = bar.last_print_n = trainer.global_step  # a resumed run starts where it stopped
        bar.set_description(self.DESCRIPTION)
        bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._steps(trainer) is None:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        if bar is not None and not bar.disable and trainer.global_step != bar.n:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version number: noise next to the loss
        return metrics

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        # The last step is done: close the bar now, not in on_train_end, which runs after the
        # callbacks that measure the converted model; closed there, the bar redraws itself below
        # their lines and the screen shows it twice.
        bar = self.train_progress_bar
        steps = self._steps(trainer)
        if steps is not None and bar is not None and not bar.disable and trainer.global_step >= steps:
            bar.close()
