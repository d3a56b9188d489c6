"""A thin LightningModule: convert a pretrained model, then train it with next-token loss.

Policy, operator, optimizer and scheduler are injected from the recipe. The conversion runs
in :meth:`configure_model`, so that the datamodule (calibration data) and the callbacks
(which measure the original model first) are in place; it is :mod:`rfkit.pipeline`'s steps,
which ``rfkit convert`` and ``rfkit profile`` run too.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from jsonargparse import lazy_instance

from rfkit import pipeline
from rfkit.classpath import public_path
from rfkit.conversion.headmap import HeadMap
from rfkit.conversion.policies import HeadSelectionPolicy, PolicyError, RecencyRatioPolicy
from rfkit.hub import ModelSource, SourceError
from rfkit.models.lora import LoraSettings
from rfkit.models.mixer import draw_for_batch
from rfkit.models.precision import keep_new_weights_float32
from rfkit.models.operators import MambaOperator, ReplacementOperator
from rfkit.models.source import check_model_source
from rfkit.training.distill import DistillConfig, training_loss
from rfkit.training.freeze import (
    FREEZE_PRESETS,
    FreezeStage,
    apply_freeze,
    check_schedule,
    no_weights_message,
    stage_at,
    trainable_names,
    trains,
)
from rfkit.training.losses import summed_nll
from rfkit.training.precision import prepare_fsdp, restore_frozen_parameters
from rfkit.training.progress import Phases
from rfkit.training.teacher import SHARED_TEACHER_FROZEN
from rfkit.training.transfer import TransferConfig
from rfkit.validate import one_of, positive_int

log = logging.getLogger(__name__)

INIT_CHOICES = ("random", "from_attention")
JITTER_BATCHES = ("all", "long")  # model.position_jitter_batches


class RecurFormerModule(L.LightningModule):
    """Convert ``base_model`` with ``policy`` and ``operator``, then continue training it.

    Args:
        base_model: HF model id, local directory, or ``embedded:smollm2-135m-instruct``.
        policy: Which heads to replace (a ``HeadSelectionPolicy`` subclass).
        operator: What replaced heads become (a ``ReplacementOperator`` subclass).
        freeze: ``pretrained`` freezes the pretrained weights (the new blocks and LoRA adapters
            train); ``mixers`` trains only the new blocks; ``lora`` only the adapters; ``none``
            trains everything; ``all`` nothing; or a list of glob patterns of parameter names
            to freeze (for example ``["model.embed_tokens.*", "lm_head.*"]``).
        freeze_schedule: Stages that replace ``freeze`` step by step, for example
            ``[{freeze: mixers, steps: 20}, {freeze: pretrained}]``.
        init: How the new blocks start: ``random`` (the paper) or ``from_attention`` (from the
            replaced heads' weights; see the operator's ``init_from_attention``).
        transfer: Attention transfer before training (:class:`rfkit.training.transfer.TransferConfig`);
            also runs in ``rfkit convert``.
        distill: Distillation losses (:class:`rfkit.training.distill.DistillConfig`); default plain CE.
        lora: LoRA adapters on kept projections (:class:`rfkit.models.lora.LoraSettings`), merged on save.
        gradient_checkpointing: Recompute decoder layers in the backward pass instead of keeping
            their activations (HF's non-reentrant checkpointing): less memory, about a third
            more compute. For long sequences on GPUs.
        position_jitter: Training reads each batch at positions shifted by a random offset in
            ``[0, position_jitter]`` (at most up to the model's context; the teacher reads the
            same positions). Exact attention is relative and does not change; a state whose
            feature map reads rotated queries and keys sees the angles of positions beyond the
            training blocks, which it would otherwise meet first at inference. 0 (default): none.
        position_jitter_batches: Which training batches ``position_jitter`` shifts: ``all``
            (default), or ``long``: only the long-document blocks (``data.long_source``), so the
            short batches keep training the positions short inputs use.
        head_map: Path or URL of an existing ``head_map.json`` to use instead of profiling
            (the same as ``policy: rfkit.conversion.policies.FromHeadMap``).
        reuse_profile: Reuse a cached profile for the same model, data and settings, and the
            original model's cached validation perplexity for the same model, data, dtype and device.
        dtype: Weight dtype the base model loads in. ``auto``: bfloat16 where the device the trainer
            runs on computes bf16 natively (a CPU with AMX or AVX512-BF16, a bf16 GPU), with
            ``trainer.precision: bf16-true`` unless the recipe pins a precision; float32 elsewhere.
            The new weights and recurrent sums stay float32 either way.
        trust_remote_code: Passed to transformers; off unless you trust the model's code.
        optimizer: Optimizer factory, called with the trainable parameters (default AdamW, lr 1e-3).
        lr_scheduler: Optional scheduler factory, called with the optimizer; stepped per step.
    """

    def __init__(
        self,
        base_model: str = "embedded:smollm2-135m-instruct",
        policy: HeadSelectionPolicy = lazy_instance(RecencyRatioPolicy),
        operator: ReplacementOperator = lazy_instance(MambaOperator),
        freeze: str | list[str] = "pretrained",
        freeze_schedule: list[FreezeStage] | None = None,
        init: Literal["random", "from_attention"] = "random",
        transfer: TransferConfig | None = None,
        distill: DistillConfig | None = None,
        lora: LoraSettings | None = None,
        position_jitter: int = 0,
        position_jitter_batches: Literal["all", "long"] = "all",
        gradient_checkpointing: bool = False,
        head_map: str | None = None,
        reuse_profile: bool = True,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32",
        trust_remote_code: bool = False,
        optimizer: Callable[[Iterable], torch.optim.Optimizer] | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None,
    ):
        super().__init__()
        self.base_model = base_model
        self.policy, self.operator = policy, operator
        if not isinstance(self.policy, HeadSelectionPolicy):
            raise PolicyError(f"model.policy: {type(self.policy).__name__} is not a HeadSelectionPolicy subclass")
        from rfkit.conversion.policies import check_all_heads

        check_all_heads(self.policy)  # beta = 1 needs allow_all_heads: true (the paper: quality is destroyed)
        if not isinstance(self.operator, ReplacementOperator):
            raise PolicyError(f"model.operator: {type(self.operator).__name__} is not a ReplacementOperator subclass")
        if isinstance(freeze, str) and freeze not in FREEZE_PRESETS:
            raise PolicyError(
                f"model.freeze: {freeze!r} is not allowed; allowed: {', '.join(FREEZE_PRESETS)} or a list of name patterns"
            )
        self.freeze = freeze
        self.freeze_schedule = check_schedule(freeze_schedule)
        if init not in INIT_CHOICES:
            raise PolicyError(f"model.init: {init!r} is not allowed; allowed: {', '.join(INIT_CHOICES)}")
        self.init = init
        self.transfer_config = transfer
        self.distill = distill
        self.lora = lora
        self.gradient_checkpointing = bool(gradient_checkpointing)
        positive_int("model.position_jitter", position_jitter, 0, error=PolicyError)
        self.position_jitter = int(position_jitter)
        one_of("model.position_jitter_batches", position_jitter_batches, JITTER_BATCHES, error=PolicyError)
        self.position_jitter_batches = position_jitter_batches
        if distill is not None and distill.needs_teacher and distill.share_modules:
            if "none" in self.freeze_stages():
                raise PolicyError(SHARED_TEACHER_FROZEN)
        self.teacher = None
        self._stage = None
        self.head_map_path = head_map
        from rfkit.conversion.headmap import is_url

        if head_map is not None and not is_url(head_map) and not Path(head_map).exists():
            raise SourceError(f"model.head_map: path '{head_map}' does not exist")
        self.reuse_profile = reuse_profile
        if dtype == "auto":  # built outside the CLI, which resolves it with the trainer (choose_precision)
            from rfkit.devices import native_bf16

            dtype = "bfloat16" if native_bf16("cuda" if torch.cuda.is_available() else "cpu")[0] else "float32"
        self.dtype_name = dtype
        self.trust_remote_code = trust_remote_code
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        check_model_source(base_model, trust_remote_code)
        self.source: ModelSource | None = None  # base_model resolved, once (rfkit.pipeline.resolve)

        self.model = None
        self.head_map: HeadMap | None = None
        self.run_metrics: dict = {}  # filled by callbacks and by this module; summary.json reads it
        self.phases = Phases()  # one log line and one summary entry per phase of the run
        self.train_tokens = 0
        self.started = time.time()
        self.resumed_from: str | None = None  # the checkpoint this run's architecture was rebuilt from
        self._wall_before = 0.0  # seconds spent by the runs this one resumes
        self._epoch_batches = 0  # training batches done in the current epoch (saved as the data position)
        self._saved_step: int | None = None  # global step of the last checkpoint this run wrote
        self._hold_by_grad = False  # freeze stages by dropping gradients (DDP/FSDP; see place_freezing)
        self._sharded = False  # FSDP wraps the model (see place_freezing)

    # -- conversion ---------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Before ``fit`` loads anything: a training-free operator with a freeze setting that
        trains nothing else is refused here rather than after the model has loaded."""
        if stage != "fit" or getattr(self.operator, "trainable", True):
            return
        stages = self.freeze_stages()
        idle = {"mixers", "all"} | ({"pretrained", "lora"} if self.lora is None else set())
        if all(isinstance(f, str) and f in idle for f in stages):
            raise PolicyError(no_weights_message(self.operator, stages[0]))

    def configure_model(self) -> None:
        if self.model is not None:
            return
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        resume = getattr(self._trainer, "rf_ckpt_path", None)
        if resume:  # --ckpt_path: the converted architecture comes from the checkpoint
            self.prepare_from_checkpoint(resume, datamodule, getattr(self._trainer, "rf_ckpt_meta", None))
            return
        self.prepare(datamodule, callbacks=self.trainer.callbacks if self._trainer is not None else [])

    def conversion_device(self, device=None):
        """Where profiling, conversion and transfer run: ``device`` when given (``rfkit convert
        --device``, the evaluations), else the trainer's (this rank's GPU under DDP and FSDP,
        which shards a module already there), else the CPU."""
        if device is not None:
            return device
        return self.trainer.strategy.root_device if self._trainer is not None else "cpu"

    def selection_policy(self) -> HeadSelectionPolicy:
        """The policy that selects the heads: ``model.policy``, or with ``model.head_map`` that
        map (the same as ``policy: FromHeadMap``: no profiling, its provenance kept)."""
        if not self.head_map_path:
            return self.policy
        from rfkit.conversion.policies import FromHeadMap

        return FromHeadMap.for_field(self.head_map_path, "model.head_map")

    def freeze_stages(self) -> list:
        """The freeze settings this run goes through: each stage's of ``freeze_schedule``, or ``[freeze]``."""
        return [st.freeze for st in self.freeze_schedule] if self.freeze_schedule else [self.freeze]

    def _apply(self, fn, *args, **kwargs):
        """Every cast of the module (Lightning's ``bf16-true`` casts it with ``.to(torch.bfloat16)``)
        leaves the new weights in float32 (:mod:`rfkit.training.precision`)."""
        out = super()._apply(fn, *args, **kwargs)
        model = self._modules.get("model")
        if model is not None:
            keep_new_weights_float32(model)
        return out

    def prepare_from_checkpoint(self, path: str, datamodule=None, meta: dict | None = None) -> None:
        """Rebuild the converted model that checkpoint ``path`` was saved from: load the base
        model, replace the heads of the checkpoint's head map with its operator, and add the
        recipe's LoRA adapters, freezing and teacher. No profiling and no attention transfer:
        Lightning loads the trained weights into this architecture next."""
        from rfkit.training.checkpointing import read_meta

        meta = meta or self.check_checkpoint(path, read_meta(path))  # the trainer has checked the meta it passes
        head_map = HeadMap.from_dict(meta["head_map"], where=f"--ckpt_path '{path}'")
        pipeline.rebuild(self, head_map, str(path), datamodule)
        self.run_metrics.update(meta.get("run_metrics") or {})
        self.resumed_from = str(path)
        log.info(
            "rebuilt the converted model from checkpoint %s (%d of %d query heads replaced); no profiling",
            path, head_map.replaced_heads, head_map.total_heads,
        )  # fmt: skip
        pipeline.improve(self, datamodule, restoring=True)
        self.model.train()
        if hasattr(datamodule, "resume_at"):  # the loader does resume mid-epoch (see on_load_checkpoint)
            import warnings

            from lightning.pytorch.utilities.warnings import PossibleUserWarning

            warnings.filterwarnings("ignore", "You're resuming from a checkpoint that ended before", PossibleUserWarning)

    def check_checkpoint(self, path: str, meta: dict) -> dict:
        """``meta`` (a checkpoint's rfkit entry) if this recipe can resume it; a one-line
        :class:`CheckpointError` when the checkpoint was made with another operator or model."""
        from rfkit.training.checkpointing import CheckpointError

        ours, theirs = self.operator.to_dict(), meta.get("operator")
        if isinstance(theirs, dict) and isinstance(theirs.get("class_path"), str):  # older: rfkit.models.operators.X
            theirs = {**theirs, "class_path": public_path(theirs["class_path"])}
        if theirs and theirs != ours:
            raise CheckpointError(
                f"--ckpt_path: '{path}' was trained with another model.operator ({_difference(theirs, ours)}); "
                "resume with the recipe that made it"
            )
        if meta.get("base_model") not in (None, self.base_model):
            raise CheckpointError(
                f"--ckpt_path: '{path}' was converted from {meta['base_model']!r}, the recipe's model.base_model "
                f"is {self.base_model!r}; resume with the recipe that made it"
            )
        HeadMap.from_dict(meta["head_map"], where=f"--ckpt_path '{path}'")  # a readable map
        return meta

    # -- checkpoints --------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Put the converted architecture (head map, operator) and the run's state into the
        checkpoint, as plain data that ``torch.load(weights_only=True)`` reads."""
        from rfkit.training.checkpointing import META_FORMAT, META_KEY, RNG_KEY, random_states
        from rfkit.version import __version__

        if self.head_map is None:
            return
        self._saved_step = self.global_step
        plain = lambda value: json.loads(json.dumps(value, default=float))  # noqa: E731  (no numpy / tensors)
        checkpoint[META_KEY] = {
            "format": META_FORMAT,
            "rfkit_version": __version__,
            "base_model": self.base_model,
            "operator": self.operator.to_dict(),
            "head_map": plain(asdict(self.head_map)),
            "run_metrics": plain(self.run_metrics),
            "train_tokens": int(self.train_tokens),
            "wall_seconds": round(self._wall_before + time.time() - self.started, 1),
            "data_position": {"epoch": int(self.current_epoch), "batches": int(self._epoch_batches)},
        }
        checkpoint[RNG_KEY] = random_states(self)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restore what the checkpoint's run had counted, where its data stood and its random
        streams."""
        from rfkit.training.checkpointing import META_KEY, RNG_KEY, restore_random_states

        meta = checkpoint.get(META_KEY) or {}
        if RNG_KEY in checkpoint:
            restore_random_states(self, checkpoint[RNG_KEY])
        self.train_tokens = int(meta.get("train_tokens", 0))
        self._wall_before = float(meta.get("wall_seconds", 0.0))
        self.run_metrics.update(meta.get("run_metrics") or {})
        position = meta.get("data_position")
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if position and hasattr(datamodule, "resume_at"):
            datamodule.resume_at(position["epoch"], position["batches"])

    def prepare(self, datamodule=None, callbacks=(), device=None, improve_model: bool = True) -> None:
        """Load, profile, select and replace, on ``device`` (default: the trainer's, else the CPU),
        then the quality methods unless ``improve_model`` is False: :func:`rfkit.pipeline.prepare`.
        Callbacks with ``on_before_convert`` / ``on_after_convert`` see the original and the
        converted model."""
        pipeline.prepare(self, datamodule, callbacks, device, improve_model)

    def place_freezing(self) -> None:
        """Freeze what the (first) freeze stage holds, as the trainer's strategy allows (part of
        :func:`rfkit.pipeline.improve`): under FSDP the new weights get their own units; once DDP
        or FSDP owns the parameters a freeze schedule works by dropping gradients instead."""
        strategy = self.trainer.strategy if self._trainer is not None else None
        sharded = self._sharded = prepare_fsdp(strategy, self.model) > 0  # under FSDP: the new weights' own units
        # Once a wrapper owns the parameters (DDP over several processes, FSDP on any number) a freeze
        # schedule cannot switch requires_grad: DDP would not all-reduce newly unfrozen gradients, FSDP
        # fixes a unit's requires_grad when it flattens it. Every stage's parameters keep requires_grad
        # and each step drops the gradients of those its stage holds (on_before_optimizer_step).
        wrapped = sharded or (self._trainer is not None and self.trainer.world_size > 1)
        self._hold_by_grad = bool(self.freeze_schedule) and wrapped
        if self._hold_by_grad:
            names = set().union(*(trainable_names(self.model, st.freeze) for st in self.freeze_schedule))
            for name, param in self.model.named_parameters():
                param.requires_grad_(name in names)
        else:
            apply_freeze(self.model, self.freeze_schedule[0].freeze if self.freeze_schedule else self.freeze)
        self._stage = 0 if self.freeze_schedule else None

    # -- training -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, **kwargs):
        return self.model(input_ids=input_ids, **kwargs)

    def _nll(self, batch) -> tuple[torch.Tensor, int]:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return summed_nll(logits, ids, batch.get("labels"))

    def training_step(self, batch, batch_idx):
        loss, parts = training_loss(self.model, self._jittered(batch), self.distill, self.teacher)
        self._stop_unless_finite(loss, "loss")
        self.train_tokens += batch["input_ids"].numel()
        self._epoch_batches = batch_idx + 1
        if self.distill is not None:
            for name, value in parts.items():
                self.log(f"train_{name}", value)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _jittered(self, batch: dict) -> dict:
        """``batch`` with ``position_ids`` shifted by an offset drawn from (seed, step), so a
        resumed fit draws the same ones (``position_jitter``; the batch itself without it)."""
        if not self.position_jitter or (self.position_jitter_batches == "long" and not batch.get("long")):
            return batch
        ids = batch["input_ids"]
        room = min(self.position_jitter, int(getattr(self.model.config, "max_position_embeddings", 0) or 0) - ids.shape[1])
        if room <= 0:
            return batch
        generator = torch.Generator().manual_seed(1_000_003 * int(torch.initial_seed() % 1_000_003) + int(self.global_step))
        offset = int(torch.randint(0, room + 1, (), generator=generator))
        positions = torch.arange(offset, offset + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        return {**batch, "position_ids": positions}

    def on_after_backward(self) -> None:
        if self._sharded:
            restore_frozen_parameters(self.trainer.strategy.model)  # an FSDP flaw (rfkit.training.precision)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Stop before an optimizer step with non-finite gradients would spoil the weights (and
        the next checkpoint). fp16 AMP skips such steps itself, so it is left to its scaler. Under
        DDP / FSDP with a freeze schedule, first drops the gradients the current stage holds (``place_freezing``)."""
        if self._hold_by_grad:
            freeze = self.freeze_schedule[self._stage].freeze
            for name, param in self.model.named_parameters():
                if param.grad is not None and not trains(name, freeze):
                    param.grad = None
        if self._trainer is not None and str(self.trainer.precision).startswith("16"):
            return
        norms = [p.grad.detach().float().norm() for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if norms:
            self._stop_unless_finite(torch.stack(norms).sum(), "gradient norm")

    def _stop_unless_finite(self, value: torch.Tensor, what: str) -> None:
        """Raise :class:`TrainingDiverged` on every rank if ``value`` is NaN or inf on any rank."""
        from rfkit.training.checkpointing import TrainingDiverged

        bad = not bool(torch.isfinite(value.detach()).all())
        if self._trainer is not None:
            bad = self.trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            return
        step = self.global_step + 1 if self._trainer is not None else 0
        shown = float(value.detach().float().sum())
        raise TrainingDiverged(f"training: the {what} is {shown:g} at step {step}; stopped before the update. {self._last_good()}")

    def _last_good(self) -> str:
        callback = getattr(self._trainer, "checkpoint_callback", None) if self._trainer is not None else None
        last = getattr(callback, "last_model_path", "") if callback is not None else ""
        if last and Path(last).exists():
            return (
                f"The last good checkpoint is {last} (step {self._saved_step}): resume it with --ckpt_path last and a lower learning rate "
                "(model.optimizer), or check the data"
            )
        return "No checkpoint was saved before it (checkpoint.every_n_train_steps); lower the learning rate or check the data"

    def on_train_start(self) -> None:
        self.phases.start("train")

    def on_train_end(self) -> None:
        draw_for_batch(self.model, active=False)
        self.phases.end("train", f"{self.global_step} steps")

    def on_train_epoch_start(self) -> None:
        self._epoch_batches = 0

    def on_train_batch_start(self, batch, batch_idx):
        draw_for_batch(self.model)  # one window per batch: a layer recomputed in backward sees its forward's
        if not self.freeze_schedule:
            return
        stage = stage_at(self.freeze_schedule, self.global_step)
        if stage != self._stage:
            if not self._hold_by_grad:
                apply_freeze(self.model, self.freeze_schedule[stage].freeze)
            log.info("freeze schedule: step %d, stage %d (freeze %s)", self.global_step, stage, self.freeze_schedule[stage].freeze)
            self._stage = stage

    def validation_step(self, batch, batch_idx):
        nll, n = self._nll(batch)
        self.log("val_loss", nll / n, prog_bar=True, sync_dist=True)
        return {"nll_sum": nll.detach(), "tokens": n}

    def test_step(self, batch, batch_idx):
        nll, n = self._nll(batch)
        self.log("test_loss", nll / n, sync_dist=True)
        return {"nll_sum": nll.detach(), "tokens": n}

    def configure_optimizers(self):
        names = set().union(*(trainable_names(self.model, f) for f in self.freeze_stages()))
        params = [p for n, p in self.model.named_parameters() if n in names]
        if not params:
            if not getattr(self.operator, "trainable", True):
                raise PolicyError(no_weights_message(self.operator, self.freeze))
            raise PolicyError("model.freeze: no parameter is left to train; use freeze: pretrained or none")
        factory = self.optimizer_factory or (lambda p: torch.optim.AdamW(p, lr=1e-3))
        optimizer = factory(params)
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"}}


def _difference(theirs: dict, ours: dict) -> str:
    """What differs between two operator specs, as 'checkpoint X, recipe Y'."""
    if theirs.get("class_path") != ours.get("class_path"):
        return f"checkpoint {theirs.get('class_path')}, recipe {ours.get('class_path')}"
    a, b = theirs.get("init_args") or {}, ours.get("init_args") or {}
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return "; ".join(f"{k}: checkpoint {a.get(k)!r}, recipe {b.get(k)!r}" for k in keys)


