"""Callbacks that the fault tests add to real ``rfkit fit`` runs with ``--trainer.callbacks+=``.

They record what a run did or inject a fault at a chosen optimizer step; the fault itself (a
``kill -9``, a NaN weight) is real. The subprocess finds this module through PYTHONPATH.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import torch


class LossRecorder(L.Callback):
    """Append ``{"step": global step after the update, "loss": training loss}`` lines to ``path``."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": float(loss)}) + "\n")


class HangAt(L.Callback):
    """At the start of the batch after optimizer step ``step``, write ``marker`` and sleep, so
    the test can ``kill -9`` a run that is known to be mid-training."""

    def __init__(self, step: int, marker: str):
        self.step, self.marker = step, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            Path(self.marker).write_text(str(trainer.global_step))
            while True:
                time.sleep(1)


class Crash(RuntimeError):
    """What :class:`CrashAt` raises: not an error rfkit describes, so it propagates."""


class CrashAt(L.Callback):
    """At the start of the batch after optimizer step ``step``, raise :class:`Crash`: a run in
    process that dies mid-training without saving anything (Lightning saves no checkpoint on an
    exception), where a ``kill -9`` would need a process of its own."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Crash(f"crash after step {self.step}")


class PoisonAt(L.Callback):
    """Before the batch after optimizer step ``step``, set one trainable weight to NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            param = next(p for p in pl_module.parameters() if p.requires_grad)
            with torch.no_grad():
                param.fill_(float("nan"))


class ParamDigest(L.Callback):
    """At the end of training, write this rank's trainable-or-adapter parameters (name -> sum,
    abs-sum) to ``<prefix>.rank<N>.json``, so a test can compare the ranks of a DDP run."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def on_train_end(self, trainer, pl_module) -> None:
        digest = {
            name: [float(p.detach().double().sum()), float(p.detach().double().abs().sum())]
            for name, p in pl_module.model.named_parameters()
            if ".mixer." in name or ".lora_" in name
        }
        Path(f"{self.prefix}.rank{trainer.global_rank}.json").write_text(json.dumps(digest))


class LoraSteps(L.Callback):
    """After every optimizer step, record to ``path`` (a JSON list, rewritten) the step, the summed
    absolute LoRA B weights (0 until the adapters train: B starts at 0) and the dtypes of the new
    weights, mixers and adapters, as the optimizer sees them."""

    def __init__(self, path: str):
        self.path = path
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == (self.steps[-1]["step"] if self.steps else 0):
            return  # an accumulation batch: no optimizer step since the last record
        named = list(pl_module.model.named_parameters())
        self.steps.append({
            "step": trainer.global_step,
            "lora_B": float(sum(p.detach().double().abs().sum() for n, p in named if ".lora_B." in n)),
            "mixer_dtypes": sorted({str(p.dtype) for n, p in named if ".mixer." in n}),
            "lora_dtypes": sorted({str(p.dtype) for n, p in named if ".lora_" in n}),
        })  # fmt: skip
        Path(self.path).write_text(json.dumps(self.steps))
